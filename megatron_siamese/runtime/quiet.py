"""Megatron's and torch's known notices, silenced by message in our commands.

Without apex or TE megatron-core warns about each missing package, logs GPTModel's deprecation per
model, torch finds no CUDA runtime, and the resource tracker reports the checkpoint writer's queues:
per process. They say nothing about the run, so exactly they are hidden (by message, never by category).
The test suite hides the same ones in pytest.ini.
"""

from __future__ import annotations

import logging
import re
import warnings

KNOWN_NOTICES = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "full scope is deprecated",
    "MimoModelConfig is experimental",
    "absl.logging is not installed",
    "MLP requires ffn_hidden_size",
    "moe_ffn_hidden_size is not set",  # experts as wide as --ffn-hidden-size: the documented default
    "The 'megatron.core.transformer.custom_layers.transformer_engine'",
    ".*tp_group is None, using default tp group",
    "The following imports from `dynamic_context.py`",
    "`torch.jit.script_method` is deprecated",
    "Only transformer-engine>=1.7.0 supports MoE experts",
    "Please use DTensor instead and we are deprecating ShardedTensor",
    "The argument order of load has been changed",
    "`load_state_dict` is deprecated and will be removed",
    # torch's own deprecations of collectives Megatron calls (with --dp, SP, the distributed optimizer)
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    # torch, when Megatron's distributed optimizer reads a non-leaf tensor's .grad (stock layers too)
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    # at exit, about the queues Megatron's checkpoint writer processes leave behind
    "resource_tracker",
    # logged rather than warned
    "GPTModel IS DEPRECATED",
    "No CUDA runtime is found",
    "DistributedDataParallel: full_param_layout not provided",
    # megatron-core 0.19's synchronous dist_checkpointing.save goes through its deprecated async path
    "MCore's async save is deprecated",
    # generate runs the static engine on purpose where the dynamic one cannot run (docs/inference.md)
    "The static engine will be deprecated",
    # our one-process readers of a checkpoint (export, generate, analyze) load it without torch.distributed
    "torch.distributed is disabled, unavailable or uninitialized",
    # analyze's validation batches are built in memory, on purpose (data/gpt_dataset.py)
    "Unable to save GPTDataset indexes because path_to_cache is None",
    # megatron-core 0.19's pretrain() to its caller (train's ranks): our model provider is the caller's choice
    r"\s*It is recommended to use a ModelConfig",
)
# on the CPU shim Megatron's CUDA RNG tracker forks the CPU's generator, whose dropout draws change the
# state this warns about (thousands of lines a run). On a GPU it means what it says, and shows.
CPU_SHIM_NOTICES = ("CPU RNG state changed within GPU RNG context",)
_PATTERN = re.compile("|".join(f"(?:{notice})" for notice in KNOWN_NOTICES))
_CPU_PATTERN = re.compile("|".join(f"(?:{notice})" for notice in KNOWN_NOTICES + CPU_SHIM_NOTICES))
# loggers that log a known notice while torch is being imported, before its handlers exist:
# filtered at the logger itself
_SOURCE_LOGGERS = ("torch.utils.cpp_extension",)


class _KnownNoticeFilter(logging.Filter):
    def __init__(self, pattern: re.Pattern = _PATTERN):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def warning_options() -> str:
    """The known warnings as PYTHONWARNINGS entries, for processes started from here: the fork server
    imports Megatron before any code of ours could install a filter."""
    literal = [n for n in KNOWN_NOTICES if not re.search(r"[.*+?\\()\[\]{}|^$,:]", n.replace(".", ""))]
    return ",".join(f"ignore:{notice}" for notice in literal)


def silence_known_notices(on_cpu_shim: bool = False) -> None:
    """Hide the known notices in this process (idempotent); ``on_cpu_shim`` adds the CPU shim's. Call it
    again once later log handlers exist (Megatron-LM's logging setup adds its own)."""
    for notice in KNOWN_NOTICES:
        warnings.filterwarnings("ignore", message=notice)
    noticed = _KnownNoticeFilter(_CPU_PATTERN if on_cpu_shim else _PATTERN)
    handlers = [logging.lastResort] + [h for name in (None, "torch", "megatron", "megatron.core")
                                       for h in logging.getLogger(name).handlers]
    for filterer in handlers + [logging.getLogger(name) for name in _SOURCE_LOGGERS]:
        if filterer is not None:
            _guard(filterer, noticed)


def _guard(filterer: logging.Filterer, noticed: _KnownNoticeFilter) -> None:
    """``noticed`` ahead of ``filterer``'s own filtering, composed rather than added with ``addFilter``:
    Megatron-LM's log handler overrides ``filter`` without calling its filters."""
    own = getattr(filterer, "_unguarded_filter", filterer.filter)
    filterer._unguarded_filter = own
    filterer.filter = lambda record: noticed.filter(record) and own(record)
