"""Which layouts ``check --layouts all`` runs: the CPU (or MoE) matrix's layouts that fit the job,
and splits of the whole job into TP x PP x DP (once more fully sharded without PP; with experts, once
more with EP).
"""

from __future__ import annotations

from math import gcd
from typing import List, Optional

from megatron_siamese.check import DEFAULT_LAYOUTS, MOE_LAYOUTS
from megatron_siamese.runtime.layout import Layout, parse_layout

MAX_TP = 8  # one NVLink domain: tensor parallelism beyond a node is not what anyone runs


def cpu_matrix(num_experts: Optional[int] = None) -> List[str]:
    """The layouts the check runs by default: the MoE matrix for a model with experts."""
    return MOE_LAYOUTS if num_experts else DEFAULT_LAYOUTS


def whole_job_layouts(world: int, num_experts: Optional[int] = None) -> List[str]:
    """Every split of ``world`` ranks into tp (at most 8) x pp x dp: plain, with everything it admits
    (SP, two virtual stages, the distributed optimizer), and with experts over as many DP ranks as divide."""
    names: List[str] = []
    for tp in (t for t in (1, 2, 4, 8) if t <= MAX_TP and world % t == 0):
        for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0):
            dp = world // (tp * pp)
            plain = Layout(tp=tp, pp=pp, dp=dp)
            full = Layout(tp=tp, pp=pp, dp=dp, sp=tp > 1, vpp=2 if pp > 1 else None, distributed_optimizer=dp > 1)
            layouts = [plain, full]
            ep = gcd(num_experts or 1, dp)
            if ep > 1:
                layouts.append(full.with_(ep=ep))
            if dp > 1 and pp == 1:  # fully sharded both ways (neither runs with pipeline parallelism)
                layouts += [Layout(tp=tp, dp=dp, sp=tp > 1, fsdp="torch"),
                            Layout(tp=tp, dp=dp, sp=tp > 1, fsdp="megatron", fsdp_sharding="optim_grads_params")]
            names += [layout.name for layout in layouts if layout.name not in names]
    return names


def layouts_that_fit(world: int, num_experts: Optional[int] = None) -> List[str]:
    """The candidates for a job of ``world`` ranks (the model decides which of them it admits)."""
    matrix = cpu_matrix(num_experts)
    names = [name for name in matrix if parse_layout(name).world_size <= world]
    largest_default = max(parse_layout(name).world_size for name in matrix)
    if world > largest_default:
        names += [name for name in whole_job_layouts(world, num_experts) if name not in names]
    return names
