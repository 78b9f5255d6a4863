"""Training data through megatron.core.datasets: GPTDataset over an indexed dataset.

Every rank builds the same GPTDataset (Megatron caches the shuffling indices, building
them on rank 0 first) and reads its own microbatches: for global step ``k`` the global
batch is samples ``[k * G, (k + 1) * G)`` with ``G = micro_batch_size * num_microbatches
* dp``, and data-parallel rank ``d`` takes the ``d``-th contiguous share of it. Ranks of
one model replica (TP, PP) read identical microbatches, as Megatron-LM's broadcast would
give them. Every microbatch's token ids are checked against the vocabulary as it is read
(``data_checks``): an out-of-range id stops the run with one line, before the model sees it.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils.data import default_collate

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_siamese.data.cache_lock import building
from megatron_siamese.training.data_checks import SPLIT, batch_id_problem, out_of_range_error


def build_gpt_datasets(
    prefix: str,
    tokenizer,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    cache_dir: str,
    split: str = SPLIT,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
) -> Tuple[GPTDataset, GPTDataset]:
    """Train and validation GPTDatasets over the indexed dataset at ``prefix``; the ``reset_*``
    and ``eod_mask_loss`` flags as Megatron-LM's (documents of a sequence kept apart)."""
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=True,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, valid_samples, None], lambda: True, config)
    # Megatron writes the index caches where it builds: on global rank 0 (the others read them
    # after it); that rank builds under the cache's lock (cache_lock.py), against other jobs
    builds_here = cache_dir and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
    with building(cache_dir) if builds_here else contextlib.nullcontext():
        train, valid, _ = builder.build()
    return train, valid


class MicrobatchReader:
    """This data-parallel rank's microbatches of a given global step."""

    def __init__(self, dataset, micro_batch_size: int, num_microbatches: int, dp_rank: int, dp: int,
                 vocab_size: Optional[int] = None, prefix: str = "", name: str = "train"):
        self.dataset = dataset
        self.vocab_size, self.prefix, self.name = vocab_size, prefix, name
        self.micro_batch_size = micro_batch_size
        self.num_microbatches = num_microbatches
        self.dp_rank = dp_rank
        self.global_batch_size = micro_batch_size * num_microbatches * dp

    def step(self, step: int) -> List[Dict[str, torch.Tensor]]:
        first = step * self.global_batch_size + self.dp_rank * self.micro_batch_size * self.num_microbatches
        batches = []
        for m in range(self.num_microbatches):
            samples = [first + m * self.micro_batch_size + i for i in range(self.micro_batch_size)]
            batch = default_collate([self.dataset[s] for s in samples])
            if self.vocab_size is not None:
                self._check_ids(batch, samples)
            batches.append(batch)
        return batches

    def _check_ids(self, batch, samples: List[int]) -> None:
        """Exact and cheap (a min and a max of each microbatch): no out-of-range id trains."""
        found = batch_id_problem(batch["tokens"], batch["labels"], self.vocab_size)
        if found is not None:
            row, bad = found
            raise out_of_range_error(self.prefix, self.name, self.dataset, samples[row], bad, self.vocab_size)

    def steps_available(self) -> int:
        return len(self.dataset) // self.global_batch_size

