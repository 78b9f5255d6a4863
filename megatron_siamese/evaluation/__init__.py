"""Evaluation of exported models with lm-evaluation-harness (``megatron-siamese eval``)."""
