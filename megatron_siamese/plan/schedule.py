"""The microbatches in flight on a pipeline rank, as Megatron's schedules order them.

A rank runs its chunks' forward passes in the order of Megatron's schedule table (microbatches
in groups of ``pp`` per virtual stage, ``get_schedule_table``), ``warmup`` of them before its
first backward (1F1B: ``pp - rank - 1``; interleaved: ``2 (pp - rank - 1) + (vpp - 1) pp``,
``get_pp_rank_microbatches``), then one forward and one backward at a time, the backward passes
in the same order with the chunks reversed. Between a forward and the next backward the
forwards run so far, less the backwards run, hold their activations: ``peak`` is the largest
sum of what they hold over those moments (for one chunk, ``min(pp - rank, microbatches)``
microbatches; rank 0 of an interleaved schedule ``pp (1 + (pp - 1) / (pp vpp))`` on average,
Megatron's own estimate).
"""

from __future__ import annotations

from typing import Callable, List, Tuple

from megatron_siamese.runtime.layout import Layout


def schedule_table(microbatches: int, chunks: int, group: int) -> List[Tuple[int, int]]:
    """(microbatch, chunk) in the order a rank runs their forward passes."""
    table = []
    for start in range(0, microbatches, group):
        end = microbatches if start + group >= microbatches else start + group
        table += [(mb, chunk) for chunk in range(chunks) for mb in range(start, end)]
    return table


def warmup(layout: Layout, rank: int, microbatches: int) -> int:
    """Forward passes a pipeline rank runs before its first backward."""
    total = microbatches * (layout.vpp or 1)
    if layout.pp == 1:
        return 0
    if layout.vpp is None:
        found = layout.pp - rank - 1
    else:
        found = 2 * (layout.pp - rank - 1) + (layout.vpp - 1) * layout.pp
    return min(found, total)


def in_flight(layout: Layout, rank: int, microbatches: int) -> List[List[int]]:
    """How many microbatches of each chunk hold activations at each moment a backward begins."""
    chunks = layout.vpp or 1
    forwards = schedule_table(microbatches, chunks, layout.pp)
    first = warmup(layout, rank, microbatches)
    held = [0] * chunks
    for _, chunk in forwards[:first]:
        held[chunk] += 1
    moments = []
    for step in range(len(forwards) - first if first < len(forwards) else 1):
        if first + step < len(forwards):
            held[forwards[first + step][1]] += 1
        moments.append(list(held))
        held[chunks - 1 - forwards[step][1]] -= 1  # the backward pass that follows
    return moments


def peak(layout: Layout, rank: int, microbatches: int, held_by_chunk: Callable[[int], float]) -> float:
    """The most bytes the in-flight microbatches hold at once, ``held_by_chunk(chunk)`` each."""
    held = [held_by_chunk(chunk) for chunk in range(layout.vpp or 1)]
    return max(sum(count * bytes_ for count, bytes_ in zip(moment, held))
               for moment in in_flight(layout, rank, microbatches))
