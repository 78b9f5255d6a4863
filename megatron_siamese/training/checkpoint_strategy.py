"""How a checkpoint's shards are written and read: Megatron's default torch_dist strategy, or
(--ckpt-fully-parallel-save / --ckpt-fully-parallel-load, Megatron-LM's names) that strategy
spread over the data-parallel ranks."""

from __future__ import annotations

from typing import Optional


def fully_parallel(wanted: bool, direction: str, checkpoint: Optional[str] = None) -> dict:
    """``dist_checkpointing.save``'s or ``load``'s strategy for --ckpt-fully-parallel-save / -load, as
    Megatron-LM builds it: the default torch_dist strategy wrapped to share the replicated shards
    over the data-parallel group (with context parallelism's ranks, which hold the same weights)."""
    if not wanted:
        return {}
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if direction == "save":
        return {"sharded_strategy": FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)}
    return {"sharded_strategy": FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(checkpoint), group)}
