"""SiameseNorm for Megatron-Core: two residual streams (Pre-Norm-like Y, Post-Norm-like X)
sharing every block's weights (Li et al., arXiv 2602.08064).

Python API::

    from megatron_siamese import get_siamese_block_spec
    model = GPTModel(config, transformer_layer_spec=get_siamese_block_spec(config, vp_stage), ...)

HybridModel (megatron-core >= 0.19): ``megatron_siamese.hybrid.siamese_hybrid_stack_spec``.

Megatron-LM: ``pretrain_gpt.py --spec megatron_siamese.specs siamese_layer_spec``, or
``pretrain_hybrid.py --spec megatron_siamese.hybrid siamese_hybrid_stack_spec``.
"""

from megatron_siamese.versions import check_megatron_core

check_megatron_core()  # before anything touches Megatron: a clear message, not a TypeError mid-forward

from megatron_siamese.layer import SiameseTransformerLayer, SiameseTransformerLayerSubmodules  # noqa: E402
from megatron_siamese.merge import SiameseFinalNorm, StreamMerge  # noqa: E402
from megatron_siamese.norms import TorchNorm  # noqa: E402
from megatron_siamese.pipeline import SiameseP2PCommunicator  # noqa: E402
from megatron_siamese.specs import (  # noqa: E402
    get_siamese_block_spec,
    get_siamese_layer_local_spec,
    get_siamese_layer_te_spec,
    siamese_layer_spec,
)
from megatron_siamese.support import UnsupportedConfigError  # noqa: E402

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
