"""What one training step costs a rank, measured: the counterpart of ``megatron-siamese plan``.

``measure_rank(case, layout)`` runs on every rank of a launched job, like ``step.run_rank``: it
builds the same seeded ``MegatronGPT`` and runs one step (schedule, ``finalize_model_grads``,
optimizer) while it measures

* the bytes of weights, gradients and optimizer state the rank holds (the storages of its
  parameters, of their ``main_grad`` buffers, and of the optimizer's state and fp32 main
  parameters, each storage once);
* the activations kept for backward: every tensor autograd saves passes a saved-tensor hook;
  each storage is counted once (parameters left out) while anything still holds it, and the
  peak over the step is taken at the moments it can occur (the start of each forward step and
  of each backward pass). Storages the rank received from the previous pipeline stage, and the
  stage outputs it keeps until their backward (a chunk's output streams, while alive), are its
  pipeline buffers instead;
* the bytes the rank sends, by process group (``collectives.py``).

``measure_layouts(case, layouts)`` runs a list of layouts in one job (each on the job's first
ranks, as the check does) and returns every rank's measurements per layout.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_siamese.check.case import ModelCase
from megatron_siamese.check.collectives import CollectiveCounter, group_kinds
from megatron_siamese.check.sharding import is_dtensor
from megatron_siamese.runtime.layout import Layout


@dataclass
class MeasuredCosts:
    """One rank's measurements of one step, in bytes."""

    rank: int
    pp_rank: int
    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    pipeline_buffers: int = 0
    sent: Dict[str, float] = field(default_factory=dict)  # by kind: tp, sp, pp, dp, ep, other
    calls: List[Tuple[str, str, int, float]] = field(default_factory=list)  # (kind, op, group size, sent)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A fully sharded tensor's (DTensor's) part on this rank; any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _storage_key(tensor: torch.Tensor) -> int:
    """The storage's identity, stable while it is resized (selective recompute frees and refills)."""
    return tensor.untyped_storage()._cdata


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: Dict[int, int] = {}
    for tensor in map(_local, tensors):
        seen[_storage_key(tensor)] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


class _Held:
    """What autograd keeps for a saved tensor while the hooks are on: the tensor, and the count
    of its storage's holders, released when autograd drops it."""

    __slots__ = ("tensor", "key", "tracker", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: int, tracker: "SavedActivations"):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        self.tracker._release(self.key)


class SavedActivations:
    """Peak bytes of the storages autograd keeps for backward, apart from ``excluded`` ones
    (parameters, gradient buffers), split into activations and pipeline buffers: storages
    ``counter`` saw received over p2p, and the chunks' output streams (``output``) while alive."""

    def __init__(self, excluded: Iterable[int], counter: CollectiveCounter):
        self.excluded = set(excluded)
        self.counter = counter
        self.live: Dict[int, List] = {}  # key -> [holders, storage]
        self.outputs: List[weakref.ref] = []
        self.peak_activations = 0
        self.peak_pipeline = 0
        self._packing = False
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key in self.excluded:
            return tensor
        entry = self.live.setdefault(key, [0, tensor.untyped_storage()])
        entry[0] += 1
        self._packing = True
        return _Held(tensor, key, self)

    def _unpack(self, held):
        if not isinstance(held, _Held):
            return held
        if self._packing:  # a backward pass begins (or a recomputation's): the peak is now
            self._packing = False
            self.sample()
        return held.tensor

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                del self.live[key]

    def sample(self) -> None:
        received = self.counter.received_keys()
        activations = pipeline = 0
        for key, (_, storage) in self.live.items():
            if key in received:
                pipeline += storage.nbytes()
            else:
                activations += storage.nbytes()
        sent = {}
        self.outputs = [ref for ref in self.outputs if ref() is not None]
        for tensor in (ref() for ref in self.outputs):
            # once sent, Megatron frees an output's data (deallocate_pipeline_outputs), leaving a
            # one-element stand-in: nothing held
            if tensor is not None and tensor.dim() == 3 and _storage_key(tensor) not in self.live:
                sent[_storage_key(tensor)] = tensor.untyped_storage().nbytes()
        self.peak_activations = max(self.peak_activations, activations)
        self.peak_pipeline = max(self.peak_pipeline, pipeline + sum(sent.values()))

    def output(self, tensor: torch.Tensor) -> None:
        """A chunk's output streams ``[s, b, w]``, held until their backward (the last stage
        returns its losses ``[b, s]`` instead)."""
        if tensor.dim() == 3:
            self.outputs.append(weakref.ref(tensor))

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.sample()
        return self._hooks.__exit__(*exc)


def _optimizer_state(optimizer) -> List[torch.Tensor]:
    """The tensors an optimizer keeps: Adam's moments and, for 16-bit weights, the fp32 main
    parameters (a distributed optimizer's shards of them), of each chained optimizer."""
    found = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            found += [value for value in state.values() if torch.is_tensor(value) and value.dim() > 0]
        for group in inner.param_groups:
            found += list(group["params"])
    return found


def _held_parameters(chunks, layout: Layout) -> List[torch.Tensor]:
    """The parameters as this rank holds them for compute: the modules' own (DTensor shards under
    torch FSDP2)."""
    return [p for chunk in chunks for p in chunk.parameters()]


def _stepped_parameters(chunks, layout: Layout) -> List[torch.Tensor]:
    """What the optimizer steps and holds gradients for: the parameters, or under Megatron-FSDP
    the DTensor shards of its main weights."""
    if layout.fsdp != "megatron":
        return _held_parameters(chunks, layout)
    from megatron_siamese.check.step import fsdp_shards

    return [shard for chunk in chunks for shard in fsdp_shards(chunk).values()]


def _gradient(param: torch.Tensor):
    """The reduced gradient a rank holds: a DDP buffer's ``main_grad``, or a shard's ``grad``."""
    main = None if is_dtensor(param) else getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def measure_rank(case: ModelCase, layout: Layout) -> MeasuredCosts:
    """One step on this rank (see the module docstring), measured."""
    from megatron.core import parallel_state

    from megatron_siamese.check.step import microbatches, seeded_gpt
    from megatron_siamese.runtime import gpt as runtime_gpt

    if case.fault:
        from megatron_siamese.check.faults import plant

        plant(case.fault)
    try:
        model = seeded_gpt(case, layout)
        params = _held_parameters(model.model, layout)
        weights = {_storage_key(_local(p)) for p in params}
        dp_rank, per_rank = parallel_state.get_data_parallel_rank(), case.num_microbatches // layout.dp
        batches = microbatches(case)[dp_rank * per_rank: (dp_rank + 1) * per_rank]
        counter = CollectiveCounter(group_kinds())
        tracker = SavedActivations(weights, counter)

        def forward_step(data_iterator, chunk):
            tracker.sample()  # before this microbatch's forward: the peak of what came before
            output, loss = runtime_gpt.forward_step(data_iterator, chunk)
            tracker.output(output)
            return output, loss

        model.zero_grad()
        with counter, tracker:
            model.forward_backward(batches, step=forward_step)
            model.optimizer.step()
        grads = [g for g in map(_gradient, _stepped_parameters(model.model, layout)) if g is not None]
        excluded = weights | {_storage_key(_local(g)) for g in grads}
        state = [t for t in map(_local, _optimizer_state(model.optimizer)) if _storage_key(t) not in excluded]
        return MeasuredCosts(
            rank=torch.distributed.get_rank(), pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            weights=_storage_bytes(params), grads=_storage_bytes(grads), optimizer=_storage_bytes(state),
            activations=tracker.peak_activations, pipeline_buffers=tracker.peak_pipeline,
            sent=counter.sent_by_kind(), calls=counter.calls)
    finally:
        parallel_state.destroy_model_parallel()


def _measure_layout(case: ModelCase, layout: Layout) -> Optional[List[MeasuredCosts]]:
    from megatron_siamese.runtime.job import gather_to_rank0

    return gather_to_rank0(measure_rank(case, layout))


def measure_job(cases: Sequence[Tuple[ModelCase, Layout]]) -> List[Optional[List[MeasuredCosts]]]:
    """Every rank: each (case, layout) on the job's first ranks; rank 0 returns their ranks' costs."""
    from megatron_siamese.runtime.job import on_first_ranks

    return [on_first_ranks(layout.world_size, _measure_layout, case, layout) for case, layout in cases]


def measure_layouts(cases: Sequence[Tuple[ModelCase, Layout]]) -> List[List[MeasuredCosts]]:
    """Each (case, layout) measured in one job spawned here (or the launched job's)."""
    from megatron_siamese.runtime.launch import run_job

    world = max(layout.world_size for _, layout in cases)
    return run_job(measure_job, world, list(cases), quiet_ranks=range(world), needs="the measured costs")
