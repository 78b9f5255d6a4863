"""``megatron-siamese plan``: what a job costs per GPU, stock Pre-Norm against SiameseNorm, on paper.

Pure arithmetic over a run's settings (no torch, no ranks), one concern a module; ``per_gpu.py`` combines them
and ``report.py`` prints the table. bench/plan_costs.py measures the same quantities on CPU ranks and
tests/test_plan_measured.py holds the two together. The module map: docs/scale.md, "Where it comes from".
"""
