"""SiameseNorm for Megatron-Core: two residual streams (Pre-Norm-like Y, Post-Norm-like X)
sharing every block's weights (Li et al., arXiv 2602.08064).

Python API::

    from megatron_siamese import get_siamese_block_spec
    model = GPTModel(config, transformer_layer_spec=get_siamese_block_spec(config, vp_stage), ...)

Megatron-LM: ``pretrain_gpt.py --spec megatron_siamese.specs siamese_layer_spec``.
"""

from megatron_siamese.testing.cpu_harness import install_if_requested as _install_if_requested

_install_if_requested()

from megatron_siamese.layer import SiameseTransformerLayer, SiameseTransformerLayerSubmodules  # noqa: E402
from megatron_siamese.merge import SiameseFinalNorm, StreamMerge  # noqa: E402
from megatron_siamese.norms import Norm  # noqa: E402
from megatron_siamese.pipeline import SiameseP2PCommunicator  # noqa: E402
from megatron_siamese.specs import (  # noqa: E402
    get_siamese_block_spec,
    get_siamese_layer_local_spec,
    siamese_layer_spec,
)
from megatron_siamese.support import UnsupportedConfigError  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Norm",
    "SiameseFinalNorm",
    "SiameseP2PCommunicator",
    "SiameseTransformerLayer",
    "SiameseTransformerLayerSubmodules",
    "StreamMerge",
    "UnsupportedConfigError",
    "get_siamese_block_spec",
    "get_siamese_layer_local_spec",
    "siamese_layer_spec",
]
