"""The bytes a rank sends, counted around its process groups' collectives and p2p.

``CollectiveCounter`` wraps the methods of torch.distributed's ``ProcessGroup`` (every
collective and p2p call of torch.distributed, whichever module alias Megatron called it
through, ends in one of them) and books each call under the kind of the group it runs on
(``group_kinds``: Megatron's tensor-, pipeline-, data- and expert-parallel groups). A call's
bytes sent are what the usual ring and pairwise algorithms send per rank, from its payload N
(the whole reduced, gathered or scattered tensor) over a group of g ranks, by the rule the plan
books its predictions by (``plan/traffic.sent_bytes``):

  all-reduce 2 (g-1)/g N;  all-gather, reduce-scatter, broadcast (g-1)/g N;
  all-to-all (g-1)/g of the rank's input (the share a balanced router sends away);  send N.

Over the tensor-parallel group, all-reduces are booked as ``tp`` and all-gathers and
reduce-scatters as ``sp`` (sequence parallelism turns the former into the latter); the tied
embedding's gradient all-reduce between the first and last pipeline stage, and every send (for
two stages Megatron sends one way over the whole job's group), is ``pp``; the
data-parallel and expert-data-parallel groups' traffic is ``dp`` (with CP, the DP x CP group's
too); the expert-parallel groups' is ``ep``; the context-parallel group's ``cp``; anything else (a gradient norm's scalar) is ``other``. Where the CPU shim emulates a
collective gloo lacks (the alltoall dispatcher's uneven gather and scatter over expert TP), the
collective it stands for is booked, not the calls that emulate it.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from megatron_siamese.plan.traffic import (  # the plan predicts by the same rule
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BROADCAST,
    RECV,
    REDUCE_SCATTER,
    SEND,
    sent_bytes,
)
from megatron_siamese.runtime.emulation import emulated_collective


def _nbytes(tensors) -> int:
    if torch.is_tensor(tensors):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _flat(tensors) -> List[torch.Tensor]:
    if torch.is_tensor(tensors):
        return [tensors]
    return [t for item in tensors for t in _flat(item)]


# ProcessGroup method -> (op, payload in bytes from its arguments, the tensors it receives into)
_METHODS: Dict[str, Tuple[str, Callable, Optional[Callable]]] = {
    "allreduce": (ALL_REDUCE, lambda tensors, *a, **k: _nbytes(tensors), None),
    "allreduce_coalesced": (ALL_REDUCE, lambda tensors, *a, **k: _nbytes(tensors), None),
    "allgather": (ALL_GATHER, lambda outputs, inputs, *a, **k: _nbytes(outputs), None),
    "_allgather_base": (ALL_GATHER, lambda output, inputs, *a, **k: _nbytes(output), None),
    "allgather_coalesced": (ALL_GATHER, lambda outputs, inputs, *a, **k: _nbytes(outputs), None),
    "allgather_into_tensor_coalesced": (ALL_GATHER, lambda outputs, inputs, *a, **k: _nbytes(outputs), None),
    "all_gather_single": (ALL_GATHER, lambda output, inputs, *a, **k: _nbytes(output), None),
    "all_gather_single_coalesced": (ALL_GATHER, lambda outputs, inputs, *a, **k: _nbytes(outputs), None),
    "reduce_scatter": (REDUCE_SCATTER, lambda outputs, inputs, *a, **k: _nbytes(inputs), None),
    "_reduce_scatter_base": (REDUCE_SCATTER, lambda output, inputs, *a, **k: _nbytes(inputs), None),
    "reduce_scatter_tensor_coalesced": (REDUCE_SCATTER, lambda outputs, inputs, *a, **k: _nbytes(inputs), None),
    "reduce_scatter_single": (REDUCE_SCATTER, lambda output, inputs, *a, **k: _nbytes(inputs), None),
    "reduce_scatter_single_coalesced": (REDUCE_SCATTER, lambda outputs, inputs, *a, **k: _nbytes(inputs), None),
    "broadcast": (BROADCAST, lambda tensors, *a, **k: _nbytes(tensors), None),
    "alltoall_base": (ALL_TO_ALL, lambda output, inputs, *a, **k: _nbytes(inputs), None),
    "all_to_all_single": (ALL_TO_ALL, lambda output, inputs, *a, **k: _nbytes(inputs), None),
    "alltoall": (ALL_TO_ALL, lambda outputs, inputs, *a, **k: _nbytes(inputs), None),
    "send": (SEND, lambda tensors, *a, **k: _nbytes(tensors), None),
    "recv": (RECV, lambda tensors, *a, **k: _nbytes(tensors), lambda tensors, *a, **k: _flat(tensors)),
}


def group_kinds() -> Dict[int, str]:
    """``id(group) -> kind`` for Megatron's process groups of this rank (after its
    ``initialize_model_parallel``); the first kind that names a group wins."""
    from megatron.core import parallel_state as ps

    getters = [
        ("tp", lambda: ps.get_tensor_model_parallel_group()),
        ("pp", lambda: ps.get_pipeline_model_parallel_group()),
        ("pp", lambda: ps.get_embedding_group()),
        ("dp", lambda: ps.get_data_parallel_group()),
        ("dp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        ("dp", lambda: ps.get_expert_data_parallel_group()),
        ("ep", lambda: ps.get_expert_model_parallel_group()),
        ("cp", lambda: ps.get_context_parallel_group()),
        ("ep", lambda: ps.get_expert_tensor_and_model_parallel_group()),
        ("tp", lambda: ps.get_expert_tensor_parallel_group()),
    ]
    kinds: Dict[int, str] = {}
    for kind, getter in getters:
        try:
            group = getter()
        except (AssertionError, AttributeError, TypeError):  # a group this layout or release does not form
            continue
        if group is not None:
            kinds.setdefault(id(group), kind)
    return kinds


class CollectiveCounter:
    """Counts the bytes sent per kind of group while it is entered (see the module docstring);
    remembers the tensors received over p2p (weakly) for the pipeline-buffer count."""

    def __init__(self, kinds: Dict[int, str]):
        self.kinds = kinds
        self.calls: List[Tuple[str, str, int, float]] = []  # (kind, op, group size, bytes sent)
        self._received: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._originals: Dict[str, Callable] = {}

    def kind_of(self, group, op: str) -> str:
        if op in (SEND, RECV):  # only pipeline stages talk p2p (over the whole job's group, at times)
            return "pp"
        kind = self.kinds.get(id(group), "other")
        if kind == "tp" and op in (ALL_GATHER, REDUCE_SCATTER):
            return "sp"
        return kind

    def _wrap(self, name: str, original: Callable) -> Callable:
        op, payload_of, received_of = _METHODS[name]
        counter = self

        def counted(group, *args, **kwargs):
            size = group.size()
            emulated = emulated_collective()
            if emulated is None:
                counter.calls.append((counter.kind_of(group, op), op, size, sent_bytes(op, payload_of(*args, **kwargs), size)))
            elif not emulated[2]:  # the CPU shim's stand-in for a collective gloo lacks: the real one, once
                real, payload, emulated[2] = emulated[0], emulated[1], True
                counter.calls.append((counter.kind_of(group, real), real, size, sent_bytes(real, payload, size)))
            if received_of is not None:
                for tensor in received_of(*args, **kwargs):
                    counter._received[tensor.untyped_storage()._cdata] = tensor
            return original(group, *args, **kwargs)

        return counted

    def received_keys(self) -> Iterable[int]:
        """The storages received over p2p that are still alive."""
        return set(self._received.keys())

    def sent_by_kind(self) -> Dict[str, float]:
        found: Dict[str, float] = {}
        for kind, _, _, sent in self.calls:
            found[kind] = found.get(kind, 0.0) + sent
        return found

    def __enter__(self):
        group_class = torch.distributed.ProcessGroup
        for name in _METHODS:
            original = group_class.__dict__.get(name)  # the descriptor itself, put back as it was
            if original is not None:
                self._originals[name] = original
                setattr(group_class, name, self._wrap(name, getattr(group_class, name)))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.distributed.ProcessGroup, name, original)
        self._originals.clear()
        return False
