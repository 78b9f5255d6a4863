"""Parallel layouts: how one model is split over ranks (and recomputes), and their names.

A name reads ``tp2-pp2-sp``: sizes (``tp pp vpp cp dp ep etp``), then flags: ``sp``, ``do`` (distributed
optimizer), ``full``/``sel`` (recompute), ``fsdp2`` (torch FSDP2), ``mfsdpN`` (Megatron-FSDP, strategy N
in its own numbering); ``single`` is one rank. Expert parallelism adds no ranks (as in Megatron), so a
name with ``ep`` but no ``dp`` takes the smallest DP that holds it. docs/parallelism.md.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

from megatron_siamese.runtime.registry import config_kwargs, setting

# Megatron's selective-recompute modules (TransformerConfig.recompute_modules), with the first
# megatron-core release that has each
RECOMPUTE_MODULES = {"core_attn": (0, 0), "moe_act": (0, 0), "layernorm": (0, 0), "mla_up_proj": (0, 0),
                     "mlp": (0, 0), "moe": (0, 0), "shared_experts": (0, 0), "gdn_norm_out": (0, 19)}
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)  # Megatron's, when selective names none


@dataclass(frozen=True)
class Recompute:
    """Activation recompute as Megatron's TransformerConfig has it. A layout name spells it ``full``
    (uniform, 1), ``fullN``, ``fullblockN``, ``sel`` (layernorm and mlp) or ``sel=MOD.MOD``."""

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None
    modules: Tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "modules", tuple(sorted(set(self.modules))))  # one set of modules, one name
        problem = recompute_problem(self.granularity, self.method, self.num_layers, self.modules)
        if problem:
            raise ValueError(problem)

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute checkpoints ``module`` (a name of ``RECOMPUTE_MODULES``)."""
        return self.granularity == "selective" and module in self.modules

    @property
    def preset(self) -> Optional[str]:
        """The name of the preset (``train --recompute``) this is, or None."""
        return next((name for name, preset in RECOMPUTE_PRESETS.items() if preset == self), None)

    @property
    def name(self) -> str:
        """Its part of a layout name ("" without recompute)."""
        if self.granularity is None:
            return ""
        if self.full:
            return "full" + ("block" if self.method == "block" else "") + (
                "" if (self.method, self.num_layers) == ("uniform", 1) else str(self.num_layers))
        return "sel" if self.modules == ("layernorm", "mlp") else "sel=" + ".".join(self.modules)

    def __str__(self) -> str:
        if self.granularity is None:
            return "none"
        if self.full:
            layers = f"{self.num_layers} layer{'' if self.num_layers == 1 else 's'}"
            return f"full ({'groups of ' + layers if self.method == 'uniform' else 'the first ' + layers + ' of a chunk'})"
        return f"selective ({', '.join(self.modules) or 'nothing'})"

    def config(self) -> dict:
        """TransformerConfig keyword arguments."""
        if self.granularity is None:
            return {}
        if self.full:
            return dict(recompute_granularity="full", recompute_method=self.method, recompute_num_layers=self.num_layers)
        return dict(recompute_granularity="selective", recompute_modules=list(self.modules))


def recompute_problem(granularity, method, num_layers, modules, spell=lambda name: name) -> Optional[str]:
    """What Megatron's TransformerConfig refuses of these recompute settings, or None. ``spell``
    names a setting (``recompute_method``, ...) as the caller's words do (train: its flag)."""
    if granularity not in (None, *RECOMPUTE_GRANULARITIES):
        return f"{spell('recompute_granularity')} must be full or selective (got {granularity!r})"
    if granularity == "full":
        if method not in RECOMPUTE_METHODS:
            return (f"full recompute needs {spell('recompute_method')} uniform (layers in groups of "
                    f"{spell('recompute_num_layers')}) or block (the first {spell('recompute_num_layers')} of each "
                    f"model chunk)")
        if num_layers is None or num_layers < 1:
            return f"full recompute needs {spell('recompute_num_layers')} of at least 1"
        if modules:
            return f"{spell('recompute_modules')} applies to selective recompute, not full: drop it"
        return None
    given = [spell(name) for name, value in (("recompute_method", method), ("recompute_num_layers", num_layers))
             if value is not None]
    if given:
        return f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to full recompute only: drop " + (
            "them" if len(given) > 1 else "it")
    unknown = [module for module in modules if module not in RECOMPUTE_MODULES]
    if unknown:
        return (f"{spell('recompute_modules')} {' '.join(unknown)}: not a module Megatron recomputes (it has "
                f"{', '.join(RECOMPUTE_MODULES)})")
    if granularity is None and modules:
        return f"{spell('recompute_modules')} needs selective recompute: add {spell('recompute_granularity')} selective"
    return None


# the package's recompute presets (train's --recompute, the layout names' full and sel)
RECOMPUTE_PRESETS = {
    "none": Recompute(),
    "full": Recompute("full", "uniform", 1),
    "selective": Recompute("selective", modules=("layernorm", "mlp")),
}
RECOMPUTE = tuple(RECOMPUTE_PRESETS)
# fully sharded data parallelism: none, torch FSDP2 (Megatron's TorchFullyShardedDataParallel), Megatron-FSDP
FSDP_KINDS = ("none", "torch", "megatron")
# Megatron-FSDP's data_parallel_sharding_strategy values, in its own order (0-3: what a layout name's mfsdpN says)
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class LayoutWords:
    """How a refusal names a layout's parts: as a layout name spells them (``LAYOUT_NAME``), or as
    ``train``'s flags do (``TRAIN_FLAGS``)."""

    size: Callable[[str, int], str]  # ("pp", 1) -> "pp1" / "--pp 1"
    torch_fsdp: str
    megatron_fsdp: str
    distributed_optimizer: str


LAYOUT_NAME = LayoutWords(lambda key, value: f"{key}{value}", "torch FSDP2 (fsdp2)", "Megatron-FSDP (mfsdpN)",
                          "Megatron's distributed optimizer (do)")
TRAIN_FLAGS = LayoutWords(lambda key, value: f"--{key} {value}", "--use-torch-fsdp2", "--use-megatron-fsdp",
                          "--use-distributed-optimizer")


def fsdp_refusals(fsdp: str, *, tp: int, cp: int, dp: int, pp: int, ep: int, expert_tp: int,
                  distributed_optimizer: bool, words: LayoutWords = LAYOUT_NAME) -> List[str]:
    """What FSDP ``fsdp`` ("torch", "megatron") cannot run with, each rule written once (``Layout``
    refuses the first, ``train`` lists them all in its flags' words)."""
    if fsdp == "none":
        return []
    flag = words.torch_fsdp if fsdp == "torch" else words.megatron_fsdp
    if dp == 1:  # the cause of everything else: said alone
        return [f"{flag} shards over the data-parallel ranks: it needs more than one ({words.size('dp', 2)} or more)"]
    if fsdp == "torch":
        refused = [(pp > 1, "pipeline parallelism (Megatron-LM refuses it)", f"use {words.size('pp', 1)}"),
                   (ep > 1, "expert parallelism (Megatron-LM refuses it)", f"use {words.size('ep', 1)}"),
                   (distributed_optimizer, f"{words.distributed_optimizer} (Megatron-LM refuses it; FSDP2 shards the "
                                           "optimizer state itself)", "drop it")]
    else:
        refused = [(pp > 1, "pipeline parallelism: its adapter builds its device mesh as if every rank were "
                            "dp x ep x tp (mcore_fsdp_adapter.py, _get_dp_tp_mesh, 0.16.1 to Megatron-LM main)",
                    f"use {words.size('pp', 1)}"),
                   (ep > 1 and tp * cp * dp == ep * expert_tp,
                    "experts held by one rank of each expert-data-parallel group: it mis-scales their gradients "
                    "(the check measures it with megatron-core 0.16.1 and 0.19.2; NVIDIA/Megatron-LM#6773, after "
                    "0.19, reworks one-rank reductions)",
                    f"use {words.size('dp', 2 * dp)} (each expert on two data-parallel ranks)")]
    return [f"{flag} does not run with {what}: {change}" for on, what, change in refused if on]


@dataclass(frozen=True)
class Layout:
    """One way to split a model over ranks; fields TransformerConfig takes as they are say so."""

    tp: int = setting(1, config="tensor_model_parallel_size")
    pp: int = setting(1, config="pipeline_model_parallel_size")
    vpp: Optional[int] = setting(None, config="virtual_pipeline_model_parallel_size")
    cp: int = setting(1, config="context_parallel_size")
    dp: int = 1
    ep: int = setting(1, config="expert_model_parallel_size")
    etp: Optional[int] = setting(None, config="expert_tensor_parallel_size")  # None: Megatron's default, tp
    sp: bool = setting(False, config="sequence_parallel")
    distributed_optimizer: bool = False  # DistributedDataParallelConfig's and OptimizerConfig's
    # several TransformerConfig fields (Recompute.config); a preset's name (RECOMPUTE_PRESETS) is taken too
    recompute: Recompute = Recompute()
    # fully sharded data parallelism over the dp ranks (FSDP_KINDS, runtime/data_parallel.py); fsdp_sharding is
    # Megatron-FSDP's data_parallel_sharding_strategy ("optim_grads_params": full sharding)
    fsdp: str = "none"
    fsdp_sharding: str = "no_shard"

    def __post_init__(self):
        if self.etp == self.tp:  # Megatron's default spelled out: one layout, one name
            object.__setattr__(self, "etp", None)
        self._check_fsdp()
        if self.fsdp == "megatron":  # Megatron-FSDP always steps Megatron's distributed optimizer: one name
            object.__setattr__(self, "distributed_optimizer", True)
        if isinstance(self.recompute, str):
            if self.recompute not in RECOMPUTE:
                raise ValueError(f"recompute must be one of {RECOMPUTE} or a Recompute, got {self.recompute!r}")
            object.__setattr__(self, "recompute", RECOMPUTE_PRESETS[self.recompute])
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism needs tp > 1")
        if self.vpp is not None and self.pp == 1:
            raise ValueError("a virtual pipeline needs pp > 1")
        if self.distributed_optimizer and self.dp == 1:
            raise ValueError("the distributed optimizer needs dp > 1 to shard anything")
        experts = self.ep * self.expert_tp
        if (self.tp * self.cp * self.dp) % experts:
            raise ValueError(
                f"ep{self.ep} x etp{self.expert_tp} must divide tp x cp x dp = {self.tp * self.cp * self.dp} "
                f"(the ranks of a pipeline stage the experts are split over): use dp{self.implied_dp(self.ep, self.expert_tp)}")

    def _check_fsdp(self) -> None:
        """Fully sharded data parallelism's own rules, and the combinations Megatron refuses."""
        if self.fsdp not in FSDP_KINDS:
            raise ValueError(f"fsdp must be one of {FSDP_KINDS}, got {self.fsdp!r}")
        if self.fsdp_sharding not in SHARDING_STRATEGIES:
            raise ValueError(f"fsdp_sharding must be one of {SHARDING_STRATEGIES}, got {self.fsdp_sharding!r}")
        if self.fsdp_sharding != "no_shard" and self.fsdp != "megatron":
            raise ValueError(f"a sharding strategy ({self.fsdp_sharding}) is Megatron-FSDP's: use fsdp='megatron' "
                             "(mfsdpN in a layout name)")
        refused = fsdp_refusals(self.fsdp, tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, ep=self.ep,
                                expert_tp=self.expert_tp, distributed_optimizer=self.distributed_optimizer)
        if refused:
            raise ValueError(refused[0])

    @property
    def expert_tp(self) -> int:
        """The tensor-parallel size of the experts (Megatron's default: the attention's)."""
        return self.tp if self.etp is None else self.etp

    def implied_dp(self, ep: int, expert_tp: int) -> int:
        """The smallest DP whose ``tp x cp x dp`` ranks hold ``ep x expert_tp`` expert shards."""
        dp = 1
        while (self.tp * self.cp * dp) % (ep * expert_tp):
            dp += 1
        return dp

    def model_parallel_sizes(self) -> dict:
        """The model-parallel sizes under Megatron's names: ``parallel_state.initialize_model_parallel``'s
        keywords, and Megatron-LM's arguments (a checkpoint's ``args``); expert TP spelled out."""
        sizes = config_kwargs(self, Layout)
        del sizes["sequence_parallel"]
        return dict(sizes, expert_tensor_parallel_size=self.expert_tp)

    def recompute_options(self) -> dict:
        """This layout's recompute as TransformerConfig keyword arguments."""
        return self.recompute.config()

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def name(self) -> str:
        implied = self.dp == self.implied_dp(self.ep, self.expert_tp) and self.ep > 1
        parts = [f"{key}{value}" for key, value in
                 (("tp", self.tp), ("pp", self.pp), ("vpp", self.vpp), ("cp", self.cp),
                  ("dp", None if implied else self.dp), ("ep", self.ep), ("etp", self.etp))
                 if value not in (None, 1) or (key == "etp" and value == 1)]
        parts += [flag for flag, on in (("sp", self.sp), ("do", self.distributed_optimizer and self.fsdp == "none"))
                  if on]
        parts += {"none": [], "torch": ["fsdp2"],
                  "megatron": [f"mfsdp{SHARDING_STRATEGIES.index(self.fsdp_sharding)}"]}[self.fsdp]
        parts += [self.recompute.name] if self.recompute.name else []
        return "-".join(parts) or "single"

    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)


_SIZE = re.compile(r"^(tp|pp|vpp|cp|dp|ep|etp)(\d+)$")
_FLAGS = {"sp": ("sp", True), "do": ("distributed_optimizer", True),
          "full": ("recompute", RECOMPUTE_PRESETS["full"]), "sel": ("recompute", RECOMPUTE_PRESETS["selective"]),
          "fsdp2": ("fsdp", "torch")}
_MEGATRON_FSDP = re.compile(r"^mfsdp([0-3])$")
_FULL = re.compile(r"^full(block)?(\d+)$")
_SELECTIVE = re.compile(r"^sel=([a-z_]+(?:\.[a-z_]+)*)$")


def _recompute_part(part: str) -> Optional[Recompute]:
    """A layout name's ``fullN`` / ``fullblockN`` / ``sel=MOD.MOD`` part, or None."""
    full, selective = _FULL.match(part), _SELECTIVE.match(part)
    if full:
        return Recompute("full", "block" if full.group(1) else "uniform", int(full.group(2)))
    if selective:
        return Recompute("selective", modules=tuple(selective.group(1).split(".")))
    return None


def parse_layout(name: str) -> Layout:
    """Inverse of ``Layout.name``."""
    if name == "single":
        return Layout()
    fields = {}
    for part in name.split("-"):
        size = _SIZE.match(part)
        if size:
            fields[size.group(1)] = int(size.group(2))
        elif part in _FLAGS:
            key, value = _FLAGS[part]
            fields[key] = value
        elif _MEGATRON_FSDP.match(part):
            fields.update(fsdp="megatron", fsdp_sharding=SHARDING_STRATEGIES[int(part[-1])])
        elif _FULL.match(part) or _SELECTIVE.match(part):
            try:
                fields["recompute"] = _recompute_part(part)
            except ValueError as error:
                raise ValueError(f"layout {name!r}: {error}") from None
        else:
            close = difflib.get_close_matches(part, [*_FLAGS, *(f"mfsdp{i}" for i in range(4))], n=1)
            raise ValueError(
                f"cannot parse layout {name!r}: unknown part {part!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + " (expected tpN, ppN, vppN, cpN, dpN, epN, etpN, sp, do, fsdp2, mfsdp0-3, full, fullN, fullblockN, sel "
                  "or sel=MODULE.MODULE joined by '-')"
            )
    try:
        if "dp" not in fields and fields.get("ep", 1) > 1:
            base = Layout(**{key: value for key, value in fields.items() if key in ("tp", "cp")})
            fields["dp"] = base.implied_dp(fields["ep"], fields.get("etp", fields.get("tp", 1)))
        return Layout(**fields)
    except ValueError as error:  # a layout that cannot be: say which one
        raise ValueError(f"layout {name!r}: {error}") from None
