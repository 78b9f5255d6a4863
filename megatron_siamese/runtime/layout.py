"""Parallel layouts: how one model is split over ranks (and recomputes), and their names.

A layout name reads like ``tp2-pp2-sp`` or ``pp2-vpp2-full``: the parallel sizes
(``tp``, ``pp``, ``vpp``, ``cp``, ``dp``, and for mixture-of-experts layers ``ep`` expert
parallel and ``etp`` expert tensor parallel), then flags: ``sp`` (sequence parallel),
``do`` (distributed optimizer), ``full`` (full recompute), ``sel`` (selective recompute
of "layernorm" and "mlp"), and the fully sharded kinds of data parallelism: ``fsdp2`` (torch
FSDP2 through Megatron's ``TorchFullyShardedDataParallel``) and ``mfsdpN`` (Megatron-FSDP with
``data_parallel_sharding_strategy`` N, Megatron-FSDP's own numbering: 0 ``no_shard``, 1
``optim``, 2 ``optim_grads``, 3 ``optim_grads_params``). ``single`` is one rank with nothing split.

Expert parallelism adds no ranks: as in Megatron, each pipeline stage's ``tp x cp x dp``
ranks are regrouped as ``etp x ep x`` expert-data-parallel for the experts. A name that
gives ``ep`` without ``dp`` takes the smallest DP that holds it (``ep2`` is ``dp2-ep2``,
``tp2-ep2`` is ``tp2-dp2-ep2``), and names leave that DP out again.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace
from typing import Optional

from megatron_siamese.runtime.registry import config_kwargs, setting

# the activation-recompute presets, as TransformerConfig fields
RECOMPUTE_PRESETS = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"]),
}
RECOMPUTE = tuple(RECOMPUTE_PRESETS)
# fully sharded data parallelism: none, torch FSDP2 (Megatron's TorchFullyShardedDataParallel), Megatron-FSDP
FSDP_KINDS = ("none", "torch", "megatron")
# Megatron-FSDP's data_parallel_sharding_strategy values, in its own order (0-3: what a layout name's mfsdpN says)
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Layout:
    """One way to split a model over ranks. The fields TransformerConfig takes as they are
    say so (``runtime/registry.config_kwargs``); the command line's settings fill them
    (``training/args.TrainArgs.layout``)."""

    tp: int = setting(1, config="tensor_model_parallel_size")
    pp: int = setting(1, config="pipeline_model_parallel_size")
    vpp: Optional[int] = setting(None, config="virtual_pipeline_model_parallel_size")
    cp: int = setting(1, config="context_parallel_size")
    dp: int = 1
    ep: int = setting(1, config="expert_model_parallel_size")
    etp: Optional[int] = setting(None, config="expert_tensor_parallel_size")  # None: Megatron's default, tp
    sp: bool = setting(False, config="sequence_parallel")
    distributed_optimizer: bool = False  # DistributedDataParallelConfig's and OptimizerConfig's
    recompute: str = "none"  # a preset of several TransformerConfig fields: recompute_options()
    # fully sharded data parallelism over the dp ranks (runtime/data_parallel.py): "torch" wraps each model
    # chunk in Megatron's TorchFullyShardedDataParallel (use_torch_fsdp2: parameters, gradients and optimizer
    # state sharded), "megatron" in Megatron-FSDP (use_megatron_fsdp), whose fsdp_sharding (its
    # DistributedDataParallelConfig.data_parallel_sharding_strategy, Megatron's default "no_shard")
    # says what it shards: "optim_grads_params" is full sharding
    fsdp: str = "none"
    fsdp_sharding: str = "no_shard"

    def __post_init__(self):
        if self.etp == self.tp:  # Megatron's default spelled out: one layout, one name
            object.__setattr__(self, "etp", None)
        self._check_fsdp()
        if self.fsdp == "megatron":  # Megatron-FSDP always steps Megatron's distributed optimizer: one name
            object.__setattr__(self, "distributed_optimizer", True)
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
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
        if self.fsdp != "none" and self.dp == 1:
            raise ValueError("fully sharded data parallelism needs dp > 1 to shard anything")
        if self.fsdp == "megatron" and self.pp > 1:
            raise ValueError("Megatron-FSDP (mfsdpN) does not run with pipeline parallelism: its adapter builds "
                             "its device mesh as if every rank were dp x ep x tp (mcore_fsdp_adapter.py, "
                             "_get_dp_tp_mesh, 0.16.1 to Megatron-LM main): use pp1")
        if self.fsdp == "megatron" and self.ep > 1 and self.tp * self.cp * self.dp == self.ep * self.expert_tp:
            raise ValueError(f"Megatron-FSDP (mfsdpN) mis-scales the gradients of experts held by one rank of each "
                             f"expert-data-parallel group (the check measures it with megatron-core 0.16.1 and 0.19.2; "
                             f"NVIDIA/Megatron-LM#6773, after 0.19, reworks one-rank reductions): use dp{2 * self.dp} "
                             "(each expert on two data-parallel ranks)")
        if self.fsdp != "torch":
            return
        # Megatron-LM's arguments.py refuses these with --use-torch-fsdp2
        refused = [(self.pp > 1, "pipeline parallelism", "use pp1"),
                   (self.ep > 1, "expert parallelism", "use ep1"),
                   (self.distributed_optimizer, "Megatron's distributed optimizer",
                    "drop do (FSDP2 shards the optimizer state itself)")]
        for on, what, change in refused:
            if on:
                raise ValueError(f"torch FSDP2 (fsdp2) does not run with {what} (Megatron-LM refuses it): {change}")

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
        """This layout's recompute preset as TransformerConfig keyword arguments."""
        return dict(RECOMPUTE_PRESETS[self.recompute])

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
        parts += {"none": [], "full": ["full"], "selective": ["sel"]}[self.recompute]
        return "-".join(parts) or "single"

    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)


_SIZE = re.compile(r"^(tp|pp|vpp|cp|dp|ep|etp)(\d+)$")
_FLAGS = {"sp": ("sp", True), "do": ("distributed_optimizer", True),
          "full": ("recompute", "full"), "sel": ("recompute", "selective"), "fsdp2": ("fsdp", "torch")}
_MEGATRON_FSDP = re.compile(r"^mfsdp([0-3])$")


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
        else:
            close = difflib.get_close_matches(part, [*_FLAGS, *(f"mfsdp{i}" for i in range(4))], n=1)
            raise ValueError(
                f"cannot parse layout {name!r}: unknown part {part!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + " (expected tpN, ppN, vppN, cpN, dpN, epN, etpN, sp, do, fsdp2, mfsdp0-3, full or sel joined by '-')"
            )
    try:
        if "dp" not in fields and fields.get("ep", 1) > 1:
            base = Layout(**{key: value for key, value in fields.items() if key in ("tp", "cp")})
            fields["dp"] = base.implied_dp(fields["ep"], fields.get("etp", fields.get("tp", 1)))
        return Layout(**fields)
    except ValueError as error:  # a layout that cannot be: say which one
        raise ValueError(f"layout {name!r}: {error}") from None
