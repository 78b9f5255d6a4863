"""Run Megatron-Core on CPU with the gloo backend.

megatron-core assumes a GPU in a handful of places: tensors allocated on
``torch.cuda.current_device()`` or ``device="cuda"``, ``torch.cuda.synchronize()``,
the CUDA RNG state behind its tensor-parallel RNG tracker, and optimizer type checks
against ``"torch.cuda.FloatTensor"``. This module redirects exactly those to CPU so
that TP, SP, PP (1F1B and interleaved), CP, DP with the distributed optimizer and fully
sharded DP (torch FSDP2, Megatron-FSDP) run
as several CPU processes on one machine. Nothing in Megatron is edited on disk.

What ``install()`` changes, and only while it is installed:

* every device request that names CUDA (``"cuda"``, ``"cuda:N"``, an int ordinal,
  ``torch.device("cuda")``) in torch's tensor factories (``torch.empty``, ``zeros``,
  ``tensor``, ...), in ``Tensor.new_empty/new_zeros/new_ones/new_full/new_tensor`` and in
  ``Tensor.to`` is served on CPU, and ``Tensor.cuda()`` returns the
  tensor itself (plain wrappers rather than a ``TorchFunctionMode``: a mode is switched
  off inside its own handler, so the backward pass launched through it would escape);
* ``Tensor.type()`` with no argument reports the CUDA type name
  (``"torch.cuda.FloatTensor"``), which Megatron's optimizers check before accepting
  a parameter;
* Megatron's inference pipeline broadcasts (``communication_utils._is_cuda``) accept CPU
  tensors;
* ``torch.Generator`` asked for on a CUDA device is made on the CPU (Megatron's inference
  controller seeds its sampler there);
* ``torch.cuda.Stream/Event/current_stream/default_stream/stream`` are host stand-ins
  (CPU kernels run in program order; an async gloo collective does not, and is safe only where
  Megatron waits on its ``Work`` before a buffer it uses is read or freed), and
  ``torch.cuda.current_device/synchronize/empty_cache`` and the CUDA RNG entry points
  (``get_rng_state``/``set_rng_state``/``manual_seed`` and Megatron's own
  ``_get_cuda_rng_state``/``_set_cuda_rng_state``) work against a private CPU
  ``torch.Generator`` that stands in for the GPU generator. CPU operations (dropout
  included) always draw from the CPU default generator, so forking Megatron's RNG
  tracker on CPU changes bookkeeping only, not which numbers CPU ops draw;
* Megatron's MoE layers and token dispatchers (expert parallelism on gloo):
  ``maybe_move_tensor_to_cpu(as_numpy=True)`` converts CPU tensors too (the original converts
  only CUDA ones, leaving the alltoall dispatcher's split sizes tensors, which gloo's
  ``all_to_all_single`` rejects); the uneven all-gather and reduce-scatter along the first
  dimension that the alltoall dispatcher runs over the expert TP group
  (``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` with split
  sizes), which gloo lacks, become an even all-gather of pieces padded to the largest one,
  and an all-reduce followed by this rank's slice (the same sums); and megatron-core 0.16.1's
  router, built without Transformer Engine, gets the ``te_general_gemm = None`` it leaves
  undefined;
* Megatron's fully sharded data parallelism (cpu_fsdp.py): the device meshes its torch FSDP2
  wrapper and Megatron-FSDP's adapter build for CUDA are made on the CPU, and Megatron-FSDP's
  parameter all-gathers finish before they return (no collective left running on gloo's worker
  thread beside the rank's own work: docs/testing.md, "Memory safety in the ranks"). Megatron-FSDP
  waits on its gradient-reduce events (``Event.wait``: a no-op, as every stand-in stream's; safe
  because the reduce-scatter they follow is synchronous), and megatron-core 0.16.1's adapter asks
  ``isinstance(module, TELinear)`` under TP, which without Transformer Engine is a MagicMock that
  ``isinstance`` refuses: there it is a class no module is an instance of (and in multi-latent
  attention, which asks the same of its output projection);
* without Transformer Engine, the FP8 bookkeeping that Megatron's ``CheckpointWithoutOutput`` asks
  TE for whatever its ``fp8`` argument (stock selective "layernorm" recompute): FP8 off, as TE
  answers when FP8 is off.

It refuses to install when CUDA is available: on a GPU machine Megatron must run on
the GPU, never through this shim. Only the launcher (``runtime/launch.py``, for gloo
ranks), the Megatron-LM CPU runner (``runtime/megatron_lm.py``) and the tests install it.

It is long because install() must undo exactly what it did: every stand-in above is registered in
one table and restored from it, so splitting them over modules would split that bookkeeping.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any, Dict, List, Tuple

import torch

from megatron_siamese import device
from megatron_siamese.runtime import cpu_fsdp, cpu_optimizer
from megatron_siamese.runtime.emulation import standing_in_for

ENV_VAR = "MEGATRON_SIAMESE_CPU_SHIM"  # set in the ranks it is installed in (inherited by their helpers)

_lock = threading.Lock()
_state: Dict[str, Any] = {}


def _names_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare ordinal means a CUDA device in torch's API
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn",
    "randint", "empty_strided", "empty_like", "zeros_like", "ones_like", "full_like",
)


_NEW_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")  # Tensor methods


def _on_cpu(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    if _names_cuda(kwargs.get("device")):
        kwargs = dict(kwargs, device="cpu")
    if kwargs.get("pin_memory"):
        kwargs = dict(kwargs, pin_memory=False)
    return kwargs


def _factory_on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        return factory(*args, **_on_cpu(kwargs))

    return wrapper


def _tensor_method_replacements() -> Dict[Tuple[Any, str], Any]:
    original_to, original_type = torch.Tensor.to, torch.Tensor.type

    def to(self, *args, **kwargs):
        args = tuple("cpu" if _names_cuda(a) else a for a in args)
        return original_to(self, *args, **_on_cpu(kwargs))

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return original_type(self, *args, **kwargs)
        name = original_type(self)  # report the CUDA type Megatron's optimizers check for
        return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)

    def cuda(self, *args, **kwargs):
        return self

    replacements = {(torch.Tensor, "to"): to, (torch.Tensor, "type"): type_, (torch.Tensor, "cuda"): cuda}
    for name in _NEW_FACTORIES:
        replacements[(torch.Tensor, name)] = _factory_on_cpu(getattr(torch.Tensor, name))
    return replacements


def _cuda_rng_replacements(generator: torch.Generator) -> Dict[Tuple[Any, str], Any]:
    """(owner, attribute) -> replacement, for every CUDA RNG entry point Megatron uses."""
    from megatron.core.tensor_parallel import random as megatron_random

    def get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return generator.get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
        generator.set_state(new_state.clone())

    def manual_seed(seed: int) -> None:
        generator.manual_seed(int(seed))

    return {
        (torch.cuda, "get_rng_state"): get_rng_state,
        (torch.cuda, "set_rng_state"): set_rng_state,
        (torch.cuda, "manual_seed"): manual_seed,
        (torch.cuda, "manual_seed_all"): manual_seed,
        (torch.cuda.random, "get_rng_state"): get_rng_state,
        (megatron_random, "_get_cuda_rng_state"): get_rng_state,
        (megatron_random, "_set_cuda_rng_state"): set_rng_state,
    }


class HostStream:
    """Stands in for a CUDA stream or event: CPU work runs in program order, so there is
    nothing to wait for or record (megatron-core >= 0.19 syncs DDP's gradient buffers through
    streams even without overlap)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.recorded_at = time.perf_counter()

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def wait(self, stream: Any = None) -> None:  # an event's: Megatron-FSDP waits on its reduce events
        pass

    def record_event(self, event: Any = None) -> "HostStream":
        return event if event is not None else HostStream()

    def record(self, stream: Any = None) -> None:
        self.recorded_at = time.perf_counter()

    def elapsed_time(self, end: "HostStream") -> float:
        """Milliseconds between two recorded events (Megatron's inference controller times its steps)."""
        return (end.recorded_at - self.recorded_at) * 1e3

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    @staticmethod
    def priority_range():
        return 0, 0


class _GeneratorOnCpu(type):
    """``torch.Generator(device=<CUDA>)`` (Megatron's text-generation controller seeds its sampler
    on ``torch.cuda.current_device()``) made on the CPU; ``isinstance`` still means a torch
    Generator."""

    original = torch.Generator

    def __call__(cls, device: Any = "cpu"):
        return cls.original(device="cpu" if _names_cuda(device) else device)

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls.original)


class _Generator(metaclass=_GeneratorOnCpu):
    pass


def _device_replacements() -> Dict[Tuple[Any, str], Any]:
    replacements = {(torch, name): _factory_on_cpu(getattr(torch, name)) for name in _FACTORIES}
    replacements.update(_tensor_method_replacements())
    replacements.update(
        {
            (torch, "Generator"): _Generator,
            (torch.cuda, "current_device"): lambda: 0,
            (torch.cuda, "synchronize"): lambda device=None: None,
            (torch.cuda, "empty_cache"): lambda: None,
            (torch.cuda, "Stream"): HostStream,
            (torch.cuda, "Event"): HostStream,
            (torch.cuda, "current_stream"): lambda device=None: HostStream(),
            (torch.cuda, "default_stream"): lambda device=None: HostStream(),
            (torch.cuda, "stream"): lambda stream=None: contextlib.nullcontext(),
        }
    )
    return replacements


def _fsdp_replacements() -> Dict[Tuple[Any, str], Any]:
    """Megatron's FSDP wrappers on the CPU (cpu_fsdp.py), and the TE class Megatron-FSDP's adapter asks for."""
    import importlib

    adapter = importlib.import_module("megatron.core.distributed.fsdp.mcore_fsdp_adapter")
    return {**cpu_fsdp.replacements(), **_no_te_classes(adapter)}


def _no_te_classes(*modules) -> Dict[Tuple[Any, str], Any]:
    """Where megatron-core 0.16.1 without Transformer Engine left a MagicMock for ``TELinear``, which
    ``isinstance()`` refuses (Megatron-FSDP's adapter under TP; multi-latent attention's output
    projection): a class no module is an instance of."""
    no_te = type("NoTELinear", (), {})
    return {(module, "TELinear"): no_te for module in modules
            if not isinstance(getattr(module, "TELinear", type), type)}


def _attention_replacements() -> Dict[Tuple[Any, str], Any]:
    """Multi-latent attention without Transformer Engine (``_no_te_classes``; megatron-core 0.19
    leaves the duplicated local ``Linear`` its local spec uses None, imported in TE's try block), and
    its YaRN RoPE,
    which MLA builds without ``use_cpu_initialization``: under ``with torch.device(current_device())``,
    a CUDA device; built on the CPU here."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding
    from megatron.core.transformer import multi_latent_attention

    original = yarn_rotary_pos_embedding.YarnRotaryEmbedding.__init__

    def on_cpu(self, *args, use_cpu_initialization: bool = False, **kwargs):
        original(self, *args, use_cpu_initialization=True, **kwargs)

    found = {**_no_te_classes(multi_latent_attention), (yarn_rotary_pos_embedding.YarnRotaryEmbedding, "__init__"): on_cpu}
    if multi_latent_attention.Linear is None:  # 0.19 imports it in TE's try block: without TE, None
        from megatron.core.post_training.modelopt.layers import Linear

        found[(multi_latent_attention, "Linear")] = Linear
    return found


def _inference_replacements() -> Dict[Tuple[Any, str], Any]:
    """Megatron's inference stack: its pipeline broadcasts assert that a tensor is on CUDA."""
    from megatron.core.inference import communication_utils

    def is_a_tensor(tensor) -> None:
        assert tensor is not None

    return {(communication_utils, "_is_cuda"): is_a_tensor}


def _moe_replacements() -> Dict[Tuple[Any, str], Any]:
    """What Megatron's MoE layers and token dispatchers need beyond the above on CPU/gloo."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original_move = moe_utils.maybe_move_tensor_to_cpu
    original_gather, original_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        # the original converts only CUDA tensors: on CPU the split sizes would stay tensors
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        # gloo's all_gather wants equal pieces: gather them padded to the largest, then trim
        sizes = [int(size) for size in output_split_sizes]
        padded = input_.new_zeros((max(sizes),) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        row = input_[:1].numel() * input_.element_size()
        with standing_in_for("all_gather", sum(sizes) * row):
            gathered = original_gather(padded.contiguous(), group, None, False)
        return torch.cat([piece[:size] for piece, size in zip(gathered.chunk(len(sizes)), sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original_scatter(input_, group, input_split_sizes, use_global_buffer)
        # gloo has no uneven reduce_scatter: the sum of the whole tensor, then this rank's rows
        summed = input_.clone()
        with standing_in_for("reduce_scatter", input_.numel() * input_.element_size()):
            torch.distributed.all_reduce(summed, group=group)
        sizes = [int(size) for size in input_split_sizes]
        start = sum(sizes[: group.rank()])
        return summed[start : start + sizes[group.rank()]].clone()

    replacements = {
        (moe_utils, "maybe_move_tensor_to_cpu"): maybe_move_tensor_to_cpu,
        (token_dispatcher, "maybe_move_tensor_to_cpu"): maybe_move_tensor_to_cpu,
        (mappings, "_gather_along_first_dim"): gather_along_first_dim,
        (mappings, "_reduce_scatter_along_first_dim"): reduce_scatter_along_first_dim,
    }
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 without TE leaves it undefined
        replacements[(moe_utils, "te_general_gemm")] = None
    return replacements


def _recompute_replacements() -> Dict[Tuple[Any, str], Any]:
    """Megatron's ``CheckpointWithoutOutput()``, built with its default ``fp8=False``, takes FP8 as on
    (``self.fp8 = fp8 is not None``) and asks Transformer Engine whether FP8 runs: stock selective
    "layernorm" recompute then fails without TE (``NameError: FP8GlobalStateManager``, 0.16.1 and
    0.19.2). Without TE these are its answers with FP8 off: no FP8, no recipe, no recompute phase to
    mark (the phase only TE's FP8 modules read), no FP8 autocast for the recomputation."""
    import types

    from megatron.core.tensor_parallel import random

    if hasattr(random, "FP8GlobalStateManager"):  # Transformer Engine is there: its own answers
        return {}
    no_fp8 = types.SimpleNamespace(is_fp8_enabled=lambda: False, get_fp8_recipe=lambda: None)
    return {(random, "FP8GlobalStateManager"): no_fp8,
            (random, "activation_recompute_forward"): lambda **unused: contextlib.nullcontext(),
            (random, "fp8_autocast"): lambda enabled=False, **unused: contextlib.nullcontext()}


_ABSENT = object()  # an attribute install() added rather than replaced


def is_installed() -> bool:
    return bool(_state)


def _remember_real_factories() -> None:
    """``with torch.device(...)`` (transformers' meta-device loading) recognizes factories by
    identity, from a set torch builds once, on first use, from the ``torch.*`` attributes of that
    moment. Built while the factories are wrapped, it holds the wrappers, and the device context
    then ignores the real factories for the rest of the process (RoPE buffers made on the CPU
    instead of the meta device come back uninitialized). So it is built now, from the real ones."""
    import torch.utils._device

    torch.utils._device._device_constructors()


def install() -> None:
    """Redirect megatron-core's CUDA-only calls to CPU in this process (idempotent)."""
    with _lock:
        if _state:
            return
        if device.uses_cuda():
            raise RuntimeError(
                "megatron_siamese CPU shim refused: CUDA is available, so Megatron must run "
                "on the GPU; do not call cpu_shim.install() on GPU machines."
            )
        _remember_real_factories()
        generator = torch.Generator(device="cpu")
        generator.manual_seed(0)
        replacements = {**_device_replacements(), **_cuda_rng_replacements(generator), **_moe_replacements(),
                        **_inference_replacements(), **_fsdp_replacements(), **_recompute_replacements(),
                        **_attention_replacements(), **cpu_optimizer.replacements()}
        originals: List[Tuple[Any, str, Any]] = []
        for (owner, name), replacement in replacements.items():
            originals.append((owner, name, getattr(owner, name, _ABSENT)))
            setattr(owner, name, replacement)
        _state.update(originals=originals)


def uninstall() -> None:
    """Undo install() (used by tests)."""
    with _lock:
        if not _state:
            return
        for owner, name, original in reversed(_state["originals"]):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _state.clear()


@contextlib.contextmanager
def installed():
    """Context manager form of install()/uninstall()."""
    already = is_installed()
    install()
    try:
        yield
    finally:
        if not already:
            uninstall()
