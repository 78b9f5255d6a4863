"""``megatron-siamese plan``: what a job costs per GPU, stock Pre-Norm against SiameseNorm, on paper.

Pure arithmetic over a run's settings (no torch, no ranks), split by concern:

* ``shapes.py``: the model's sizes and its parameter tensors, per scheme and layer kind;
* ``placement.py``: which layers, embeddings and heads each pipeline rank's chunks hold, and
  the parameters that puts on a GPU;
* ``states.py``: weights, gradients and optimizer state per GPU, with what data parallelism
  shards (the distributed optimizer, FSDP) and the gradient buffers' padding;
* ``activations.py``: what one microbatch's forward keeps for backward, per chunk, for stock
  Pre-Norm and for SiameseNorm on each of its paths (PyTorch, fused apart, fused joined);
* ``schedule.py``: the microbatches in flight on each pipeline rank (1F1B, interleaved), hence
  the activation peak and the pipeline buffers;
* ``traffic.py``: the bytes each GPU sends per step over TP, SP, PP, DP and EP;
* ``per_gpu.py``: all of it for stock or one SiameseNorm path on every pipeline rank;
  ``report.py``: the table, the difference, whether it fits a GPU and the largest micro-batch
  that does; ``args.py``: the command's settings (train's and the plan's own); ``gpus.py``: GPU
  memories by name.

bench/plan_costs.py measures the same quantities on CPU ranks, bench/plan_agreement.py and
tests/test_plan_measured.py hold the two together (docs/scale.md).
"""
