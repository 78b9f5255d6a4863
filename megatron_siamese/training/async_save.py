"""--async-save (Megatron-LM's flag): a checkpoint's shards written by a process forked from each
rank while training goes on; the checkpoint is complete (the tracker file names it) once every
rank's writer has finished.

Megatron core's own machinery: ``dist_checkpointing.save(async_sharded_save=True)`` returns the
request, and an ``AsyncCallsQueue`` runs it in a writer forked per save (Megatron core's
``TemporalAsyncCaller``). Each step, while a save is pending, one all-reduce asks whether every
rank's writer is done; when they are, the request's finalize functions run on every rank:
torch_dist's metadata, then the tracker file (``checkpoint.save`` adds it). The fork copies the
rank's memory as it is at the save (on GPUs the tensors are first copied to the host), so the
steps trained meanwhile never reach the checkpoint. A rank lost before the finalize leaves the
tracker on the last complete checkpoint, and the writer dies with its rank.

Megatron-LM turns --async-save off unless --use-persistent-ckpt-worker is given; its persistent
worker is handed the tensors rather than a copy of the process, which on CPU, where they are not
copied to the host first, would let the steps trained meanwhile change what it writes. So the
forked writer is the one used here, on CPU and GPU.
"""

from __future__ import annotations

import functools
import inspect
import signal
from typing import Callable, List, Optional

_state: dict = {}  # the queue of pending saves (one per rank, made at the first async save)


def save_keywords() -> dict:
    """``dist_checkpointing.save``'s keywords for an async save: megatron-core 0.19 would pick
    nvidia-resiliency-ext's writer (not installed with it); Megatron core's own is asked for."""
    from megatron.core import dist_checkpointing

    keywords = {"async_sharded_save": True}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        keywords["async_strategy"] = "mcore"
    return keywords


def _writer(write: Callable, *args, **kwargs):
    """The forked writer: killed when its rank dies (a lost rank must not leave it writing)."""
    from megatron_siamese.runtime import orphans

    orphans.die_with_parent(signal.SIGKILL)
    return write(*args, **kwargs)


def schedule(request, finalize: Callable[[], None], path: str) -> None:
    """Start writing ``request``, the checkpoint ``path`` (every rank calls it); ``finalize``
    runs on every rank once every rank's writer is done."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if request.async_fn is not None:
        request = request._replace(async_fn=functools.partial(_writer, request.async_fn))
    request.add_finalize_fn(finalize)
    if "queue" not in _state:
        _state.update(queue=AsyncCallsQueue(persistent=False), paths=[])
    _state["queue"].schedule_async_request(request)
    _state["paths"].append(path)


def pending() -> int:
    """Saves started and not yet complete on this rank."""
    queue: Optional[object] = _state.get("queue")
    return queue.get_num_unfinalized_calls() if queue is not None else 0


def oldest_pending() -> Optional[str]:
    """The path of the oldest save not yet complete (the one a failure in ``finish`` is of)."""
    return _state["paths"][0] if pending() else None


def finish(blocking: bool) -> List[str]:
    """Complete the saves every rank's writer has finished (all of them, waiting, if
    ``blocking``); their paths, oldest first. Every rank calls it at the same points: one
    all-reduce per pending save, none when nothing is pending."""
    if not pending():
        return []
    done = len(_state["queue"].maybe_finalize_async_calls(blocking=blocking))
    paths, _state["paths"] = _state["paths"][:done], _state["paths"][done:]
    return paths
