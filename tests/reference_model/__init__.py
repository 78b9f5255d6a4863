"""A plain-PyTorch SiameseNorm GPT (and the single-stream baselines) on the package's reference math
(``megatron_siamese/reference/functional.py``): the oracle the Megatron models are tested against."""
