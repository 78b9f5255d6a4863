"""SiameseNorm for Megatron-Core: two residual streams (Pre-Norm-like Y, Post-Norm-like X)
sharing every block's weights (Li et al., arXiv 2602.08064).

Python API::

    from megatron_siamese import get_siamese_block_spec
    model = GPTModel(config, transformer_layer_spec=get_siamese_block_spec(config, vp_stage), ...)

Megatron-LM: ``pretrain_gpt.py --spec megatron_siamese.specs siamese_layer_spec``.
"""

from megatron_siamese.layer import SiameseTransformerLayer, SiameseTransformerLayerSubmodules
from megatron_siamese.merge import SiameseFinalNorm, StreamMerge
from megatron_siamese.norms import TorchNorm
from megatron_siamese.pipeline import SiameseP2PCommunicator
from megatron_siamese.specs import (
    get_siamese_block_spec,
    get_siamese_layer_local_spec,
    get_siamese_layer_te_spec,
    siamese_layer_spec,
)
from megatron_siamese.support import UnsupportedConfigError

__version__ = "0.1.0"

__all__ = [
    "SiameseFinalNorm",
    "SiameseP2PCommunicator",
    "SiameseTransformerLayer",
    "SiameseTransformerLayerSubmodules",
    "StreamMerge",
    "TorchNorm",
    "UnsupportedConfigError",
    "get_siamese_block_spec",
    "get_siamese_layer_local_spec",
    "get_siamese_layer_te_spec",
    "siamese_layer_spec",
]
