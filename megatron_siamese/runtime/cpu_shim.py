"""Run Megatron-Core on CPU with the gloo backend.

megatron-core assumes a GPU in a handful of places (tensors on ``"cuda"``, ``torch.cuda.synchronize``, the
CUDA RNG behind its TP RNG tracker, ``"torch.cuda.FloatTensor"`` type checks, and MoE, FSDP, MLA,
inference and recompute paths: each ``_*_replacements`` below says why). ``install()`` redirects exactly
those to CPU, editing nothing on disk, and refuses when CUDA is available. Plain wrappers, not a
``TorchFunctionMode``: a mode is off inside its own handler, so a backward launched through it would
escape. docs/testing.md, "The CPU shim"; FSDP's calls: docs/parallelism.md.
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
    """A CUDA stream or event on the host: CPU work runs in program order (an async gloo collective
    does not, and is safe only where Megatron waits on its ``Work`` before using the buffer)."""

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
    """``torch.Generator(device=<CUDA>)`` (Megatron's sampler) made on the CPU; ``isinstance`` still works."""

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
    """megatron-core 0.16.1 without TE leaves a MagicMock for ``TELinear``, which ``isinstance()`` refuses
    (Megatron-FSDP's adapter under TP; MLA's output projection): a class no module is an instance of."""
    no_te = type("NoTELinear", (), {})
    return {(module, "TELinear"): no_te for module in modules
            if not isinstance(getattr(module, "TELinear", type), type)}


def _attention_replacements() -> Dict[Tuple[Any, str], Any]:
    """Multi-latent attention without TE (``TELinear`` above; 0.19's local ``Linear`` is None, imported in
    TE's try block), and its YaRN RoPE, which MLA builds on ``current_device()`` (CUDA): on the CPU here."""
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
    """``CheckpointWithoutOutput()`` takes its default ``fp8=False`` as on (``self.fp8 = fp8 is not None``)
    and asks TE, so stock "layernorm" recompute fails without TE (``NameError: FP8GlobalStateManager``,
    0.16.1 and 0.19.2): TE's answers with FP8 off."""
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
    """``with torch.device(...)`` knows factories by identity, from a set torch builds once on first use:
    built while they are wrapped, it would ignore the real ones for good (RoPE buffers come back
    uninitialized under transformers' meta-device loading). So it is built now, from the real ones."""
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
