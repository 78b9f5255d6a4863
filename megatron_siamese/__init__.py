"""SiameseNorm for Megatron-Core: two residual streams (Pre-Norm-like Y, Post-Norm-like X)
sharing every block's weights (Li et al., arXiv 2602.08064).

Python API::

    from megatron_siamese import get_siamese_block_spec
    model = GPTModel(config, transformer_layer_spec=get_siamese_block_spec(config, vp_stage), ...)

HybridModel (megatron-core >= 0.19): ``megatron_siamese.hybrid.siamese_hybrid_stack_spec``.

Megatron-LM: ``pretrain_gpt.py --spec megatron_siamese.specs siamese_layer_spec``, or
``pretrain_hybrid.py --spec megatron_siamese.hybrid siamese_hybrid_stack_spec``.
"""

from importlib import import_module

from megatron_siamese import extension_file
from megatron_siamese.versions import check_megatron_core

check_megatron_core()  # before anything touches Megatron: a clear message, not a TypeError mid-forward
extension_file.install()  # MEGATRON_SIAMESE_EXTENSION: another build of the extension (a sanitizer's)

__version__ = "0.1.0"

# The public API, imported on first use: importing the package (and its command line) stays
# cheap, so a bad flag is refused before torch or Megatron is loaded.
_PUBLIC = {
    "SiameseFinalNorm": "merge",
    "SiameseP2PCommunicator": "pipeline",
    "SiameseTransformerLayer": "layer",
    "SiameseTransformerLayerSubmodules": "layer",
    "StreamMerge": "merge",
    "TorchNorm": "norms",
    "UnsupportedConfigError": "support",
    "get_siamese_block_spec": "specs",
    "get_siamese_layer_local_spec": "specs",
    "get_siamese_layer_te_spec": "specs",
    "siamese_layer_spec": "specs",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(import_module(f"megatron_siamese.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'megatron_siamese' has no attribute {name!r}")
