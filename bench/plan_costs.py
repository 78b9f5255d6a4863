"""What one training step costs a rank, measured: the counterpart of ``megatron-siamese plan``.

``measure_rank(case, layout)`` runs on every rank of a launched job, like the check's ``step.run_rank``: it
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
* the bytes the rank sends, by process group (``collective_counter.py``).

``measure_layouts(case, layouts)`` runs a list of layouts in one job (each on the job's first
ranks, as the check does) and returns every rank's measurements per layout.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_siamese.check.case import ModelCase
from collective_counter import CollectiveCounter, group_kinds
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
    pipeline: int = 0  # pipeline buffers: received stage inputs, unsent stage outputs
    gathered: int = 0  # FSDP's unsharded weights and gradients, at their peak
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

    def __init__(self, excluded: Iterable[int], counter: CollectiveCounter,
                 gathered: Callable[[], List[torch.Tensor]] = lambda: [], moments: Sequence[Tuple[object, str]] = ()):
        self.excluded = set(excluded)
        self.counter = counter
        self.gathered = gathered
        self.moments = list(moments)  # methods at whose start gathered is sampled too
        self._originals: List[Tuple[object, str, object]] = []
        self.live: Dict[int, List] = {}  # key -> [holders, storage]
        self.outputs: List[weakref.ref] = []
        self.peak_activations = 0
        self.peak_pipeline = 0
        self.peak_gathered = 0
        self._gathered_keys: set = set()
        self._packing = False
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        self._sample_gathered()
        key = _storage_key(tensor)
        if key in self.excluded:
            return tensor
        entry = self.live.setdefault(key, [0, tensor.untyped_storage()])
        entry[0] += 1
        self._packing = True
        return _Held(tensor, key, self)

    def _unpack(self, held):
        self._sample_gathered()
        if not isinstance(held, _Held):
            return held
        if self._packing:  # a backward pass begins (or a recomputation's): the peak is now
            self._packing = False
            self.sample()
        return held.tensor

    def _sample_gathered(self) -> None:
        """The weights and gradients FSDP holds unsharded now (at every save and use of an
        activation: they come and go unit by unit); autograd keeps the weights as it keeps
        activations, so their storages are left out of those."""
        storages = {_storage_key(t): t.untyped_storage() for t in self.gathered()}
        self._gathered_keys |= storages.keys()
        self.peak_gathered = max(self.peak_gathered, sum(storage.nbytes() for storage in storages.values()))

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
            elif key not in self._gathered_keys:
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
        for owner, name in self.moments:
            original = vars(owner)[name]
            self._originals.append((owner, name, original))

            def sampled(*args, __original=original, **kwargs):
                self._sample_gathered()
                return __original(*args, **kwargs)

            setattr(owner, name, sampled)
        return self

    def __exit__(self, *exc):
        self.sample()
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()
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


def _megatron_fsdp_buffers(chunks, kind: str) -> List[torch.Tensor]:
    """Megatron-FSDP's flat buffers of one kind for every parameter group: ``model_weight``
    (the weights, sharded or whole by its strategy), ``main_weight`` (the optimizer's fp32 copy),
    ``main_grad`` (the reduced gradients)."""
    found = []
    for chunk in chunks:
        for group in chunk.param_and_grad_buffer.parameter_groups:
            buffer = getattr(group, f"{kind}_buffer", None)
            if buffer is not None and getattr(buffer, "data", None) is not None:
                found.append(buffer.data)
    return found


def gathered_peak_moments(layout: Layout) -> List[Tuple[object, str]]:
    """The methods at whose start fully sharded data parallelism holds a unit's gradients whole (and
    its weights, and the next unit's prefetched), before it reduce-scatters and frees them: where
    the unsharded peak is, beside the saving and use of activations."""
    import importlib

    if layout.fsdp == "torch":
        group = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param_group")
        return [(group.FSDPParamGroup, "post_backward")]
    if layout.fsdp == "megatron":
        buffer = importlib.import_module("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer")
        return [(buffer.GradReducePipeline, "reduce_gradients")]
    return []


def gathered_tensors(chunks, layout: Layout) -> List[torch.Tensor]:
    """The weights and gradients fully sharded data parallelism holds unsharded now: torch FSDP2's
    unsharded parameters, their all-gather outputs and unsharded gradients; Megatron-FSDP's
    temporary weight and gradient buckets."""
    found: List[torch.Tensor] = []
    if layout.fsdp == "torch":
        from torch.distributed.fsdp import FSDPModule

        for module in (m for chunk in chunks for m in chunk.modules() if isinstance(m, FSDPModule)):
            group = module._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group is not None else ():
                unsharded = getattr(param, "_unsharded_param", None)
                found += [t for t in (unsharded, getattr(unsharded, "grad", None), param.unsharded_accumulated_grad,
                                      *getattr(param, "all_gather_outputs", ())) if t is not None]
    elif layout.fsdp == "megatron":
        for chunk in chunks:
            for group in chunk.param_and_grad_buffer.parameter_groups:
                for buffer in (group.model_weight_buffer, getattr(group, "transpose_weight_buffer", None),
                               group.main_grad_buffer):
                    allocator = getattr(buffer, "temporary_bucket_allocator", None)
                    found += [bucket.data for bucket in getattr(allocator, "buckets", {}).values()]
    return found


def _held_parameters(chunks) -> List[torch.Tensor]:
    """The parameters as this rank holds them for compute: the modules' own (DTensor shards under
    torch FSDP2)."""
    return [p for chunk in chunks for p in chunk.parameters()]


def _stepped_parameters(chunks, layout: Layout) -> List[torch.Tensor]:
    """What the optimizer steps and holds gradients for: the parameters, or under Megatron-FSDP
    the DTensor shards of its main weights."""
    if layout.fsdp != "megatron":
        return _held_parameters(chunks)
    from megatron_siamese.check.step import fsdp_shards

    return [shard for chunk in chunks for shard in fsdp_shards(chunk).values()]


def _gradient(param: torch.Tensor):
    """The reduced gradient a rank holds: a DDP buffer's ``main_grad``, or a shard's ``grad``."""
    main = None if is_dtensor(param) else getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def measure_rank(case: ModelCase, layout: Layout) -> MeasuredCosts:
    """One step on this rank (see the module docstring), measured, with the case's fault planted."""
    from megatron_siamese.check.step import with_case_fault

    return with_case_fault(case, layout, _measured_step)


def _measured_step(case: ModelCase, layout: Layout) -> MeasuredCosts:
    from megatron.core import parallel_state

    from megatron_siamese.check.step import microbatches, seeded_gpt
    from megatron_siamese.runtime import gpt as runtime_gpt

    model = seeded_gpt(case, layout)
    megatron_fsdp = layout.fsdp == "megatron"
    # Megatron-FSDP's modules hold views of its buffers that change between steps: its buffers are what it holds
    params = _megatron_fsdp_buffers(model.model, "model_weight") if megatron_fsdp else _held_parameters(model.model)
    weights = {_storage_key(_local(p)) for p in params}
    dp_rank, per_rank = parallel_state.get_data_parallel_rank(), case.num_microbatches // layout.dp
    batches = microbatches(case)[dp_rank * per_rank: (dp_rank + 1) * per_rank]
    counter = CollectiveCounter(group_kinds())
    tracker = SavedActivations(weights, counter, lambda: gathered_tensors(model.model, layout),
                               gathered_peak_moments(layout))

    def forward_step(data_iterator, chunk):
        tracker.sample()  # before this microbatch's forward: the peak of what came before
        output, loss = runtime_gpt.forward_step(data_iterator, chunk)
        tracker.output(output)
        return output, loss

    if layout.fsdp != "none":  # the steady state, not the freshly built model (Megatron-FSDP starts it all gathered)
        model.zero_grad()
        model.forward_backward(batches)
        model.optimizer.step()
    model.zero_grad()
    with counter, tracker:
        model.forward_backward(batches, step=forward_step)
        # the reduced gradients as the backward leaves them, beside the activations' peak (a 16-bit
        # optimizer then copies them into fp32 main gradients and may free them, activations gone)
        grads = [g for g in map(_gradient, _stepped_parameters(model.model, layout)) if g is not None]
        if megatron_fsdp:
            grads = _megatron_fsdp_buffers(model.model, "main_grad")
        grad_bytes, grad_keys = _storage_bytes(grads), {_storage_key(_local(g)) for g in grads}
        model.optimizer.step()
    excluded = weights | grad_keys
    state = [t for t in map(_local, _optimizer_state(model.optimizer)) if _storage_key(t) not in excluded]
    if megatron_fsdp:  # its fp32 main weights, a buffer of their own whatever the model's dtype
        state += [t for t in _megatron_fsdp_buffers(model.model, "main_weight") if _storage_key(t) not in excluded]
    return MeasuredCosts(
        rank=torch.distributed.get_rank(), pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        weights=_storage_bytes(params), grads=grad_bytes, optimizer=_storage_bytes(state),
        activations=tracker.peak_activations, pipeline=tracker.peak_pipeline, gathered=tracker.peak_gathered,
        sent=counter.sent_by_kind(), calls=counter.calls)


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
