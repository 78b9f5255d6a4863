"""Megatron's GPTDataset over an indexed dataset of byte tokens, for the tools that read data
outside a training run (``analyze``'s validation batches), split as Megatron-LM's runs split it."""

from __future__ import annotations

import contextlib
from typing import Dict, List, Tuple

import torch

SPLIT = "98,2,0"  # train, validation, test weights (Megatron-LM's --split, the one train passes)


def build_gpt_datasets(prefix: str, tokenizer, seq_length: int, seed: int, train_samples: int, valid_samples: int,
                       cache_dir: str, split: str = SPLIT) -> Tuple[object, object]:
    """Train and validation GPTDatasets over the indexed dataset at ``prefix``. Megatron writes
    its index caches where it builds, on global rank 0, under the cache's lock (cache_lock.py)
    against other jobs; ``cache_dir`` "" keeps them in memory."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron_siamese.data.cache_lock import building

    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=([prefix], None), split=split,
                              path_to_cache=cache_dir, tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=True)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, valid_samples, None], lambda: True, config)
    builds_here = cache_dir and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
    with building(cache_dir) if builds_here else contextlib.nullcontext():
        train, valid, _ = builder.build()
    return train, valid


def validation_batches(prefix: str, tokenizer, seq_length: int, seed: int, micro_batch_size: int,
                       count: int) -> List[Dict[str, torch.Tensor]]:
    """The first ``count`` microbatches of the validation split, the same for the same arguments."""
    from torch.utils.data import default_collate

    _, valid = build_gpt_datasets(prefix, tokenizer, seq_length, seed, 1, count * micro_batch_size, "")
    return [default_collate([valid[i] for i in range(b * micro_batch_size, (b + 1) * micro_batch_size)])
            for b in range(count)]
