"""The microbatches in flight on a pipeline rank, as Megatron's schedules order them.

Forward passes in the order of Megatron's schedule table, ``warmup`` of them before the first backward, then one
forward and one backward at a time (backwards in the same order, chunks reversed). ``peak``: the most the
forwards not yet run backward hold at once (one chunk: ``min(pp - rank, microbatches)`` microbatches).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

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


def _moments(layout: Layout, rank: int, microbatches: int) -> List[Tuple[List[int], Optional[int]]]:
    """Each moment a backward begins: the microbatches of each chunk holding activations, and the
    chunk whose forward ran just before it (None in the cool-down, where no forward runs)."""
    chunks = layout.vpp or 1
    forwards = schedule_table(microbatches, chunks, layout.pp)
    first = warmup(layout, rank, microbatches)
    held = [0] * chunks
    for _, chunk in forwards[:first]:
        held[chunk] += 1
    moments = []
    for step in range(len(forwards) - first if first < len(forwards) else 1):
        just_run = None
        if first + step < len(forwards):
            just_run = forwards[first + step][1]
            held[just_run] += 1
        moments.append((list(held), just_run))
        held[chunks - 1 - forwards[step][1]] -= 1  # the backward pass that follows
    return moments


def in_flight(layout: Layout, rank: int, microbatches: int) -> List[List[int]]:
    """How many microbatches of each chunk hold activations at each moment a backward begins."""
    return [held for held, _ in _moments(layout, rank, microbatches)]


def peak(layout: Layout, rank: int, microbatches: int, held_by_chunk: Callable[[int], float],
         unsent_by_chunk: Callable[[int], float] = lambda chunk: 0.0) -> float:
    """The most bytes the in-flight microbatches hold at once, ``held_by_chunk(chunk)`` each, and
    the forward just run ``unsent_by_chunk(chunk)`` more: its output, which the interleaved
    schedule sends (and may free) only with the gradient of the backward that follows."""
    held = [held_by_chunk(chunk) for chunk in range(layout.vpp or 1)]
    return max(sum(count * bytes_ for count, bytes_ in zip(moment, held))
               + (0.0 if just_run is None else unsent_by_chunk(just_run))
               for moment, just_run in _moments(layout, rank, microbatches))
