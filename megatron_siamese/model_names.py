"""The names of the residual schemes and model classes, each list written once. Plain data: the
command line offers them before any rank starts; ``models.py`` refuses to import if they differ.
"""

# siamese: SiameseNorm (Python API); siamese-layer: the layer spec Megatron-LM's --spec names;
# siamese-hybrid: the authors' QK-norm variant; pre: Megatron's Pre-Norm layer; the single-stream
# baselines: post (Post-Norm), hybridnorm (HybridNorm), mixln (Mix-LN)
SCHEME_NAMES = ("siamese", "siamese-layer", "siamese-hybrid", "pre", "post", "hybridnorm", "mixln")

# gpt: GPTModel; hybrid: HybridModel (megatron-core >= 0.19, SiameseNorm only)
MODEL_CLASSES = ("gpt", "hybrid")
