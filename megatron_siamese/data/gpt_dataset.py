"""Megatron's GPTDataset over an indexed dataset of byte tokens, for the tools that read data
outside a training run (``analyze``'s validation batches), split as Megatron-LM's runs split it."""

from __future__ import annotations

from typing import Dict, List

import torch

SPLIT = "98,2,0"  # train, validation, test weights (Megatron-LM's --split, the one train passes)


def validation_batches(prefix: str, tokenizer, seq_length: int, seed: int, micro_batch_size: int,
                       count: int) -> List[Dict[str, torch.Tensor]]:
    """The first ``count`` microbatches of the validation split of the indexed dataset at
    ``prefix``, the same for the same arguments (Megatron's index caches kept in memory)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from torch.utils.data import default_collate

    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=([prefix], None), split=SPLIT,
                              path_to_cache="", tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=True)
    sizes = [1, count * micro_batch_size, None]  # train, validation, test samples
    _, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return [default_collate([valid[i] for i in range(b * micro_batch_size, (b + 1) * micro_batch_size)])
            for b in range(count)]
