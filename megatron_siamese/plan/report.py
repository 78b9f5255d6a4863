"""The plan as a table: stock Pre-Norm and each SiameseNorm path per GPU of the most loaded pipeline
stage, the difference, whether it fits, and the largest micro-batch that does (the same global batch,
in no fewer microbatches than pipeline stages); or as JSON (every stage)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional

from megatron_siamese.plan.activations import STOCK
from megatron_siamese.plan.gpus import human
from megatron_siamese.plan.per_gpu import HELD, GpuCosts, PlanInputs, every_rank, most_loaded
from megatron_siamese.plan.traffic import KINDS

NAMES = {STOCK: "stock Pre-Norm", "joined": "SiameseNorm joined", "apart": "SiameseNorm apart",
         "pytorch": "SiameseNorm PyTorch"}
LABELS = dict(weights="weights", grads="gradients", optimizer="optimizer state", gathered="FSDP: a layer gathered",
              activations="activations kept for backward", pipeline="pipeline buffers", memory="total")
assert set(LABELS) == {*HELD, "memory"}, "a label for each term a GPU holds"
SENT = (("tp", "TP all-reduce"), ("sp", "SP all-gather, reduce-scatter"), ("pp", "PP p2p, tied embedding"),
        ("dp", "DP"), ("ep", "EP all-to-all"), ("cp", "CP K/V gathers (local attn)"))
assert {kind for kind, _ in SENT} == set(KINDS), "a row for each kind of traffic"



@dataclass
class Plan:
    """Every variant's costs on every pipeline stage, the GPU, and the largest micro-batch that fits."""

    variants: List[str]
    stages: Dict[str, List[GpuCosts]]
    gpu_bytes: int
    largest_micro_batch: Dict[str, Optional[int]]
    micro_batch_limit: int  # the largest the global batch allows (``micro_batches``), memory aside
    sequences_per_rank: int  # a step's sequences on each data-parallel rank

    def loaded(self, variant: str) -> GpuCosts:
        return most_loaded(self.stages[variant])

    def fits(self, variant: str) -> bool:
        return self.loaded(variant).memory <= self.gpu_bytes


def micro_batches(inputs: PlanInputs) -> List[int]:
    """The micro-batches that split a data-parallel rank's sequences evenly into at least as many
    microbatches as there are pipeline stages (fewer leave stages idle)."""
    per_rank = inputs.micro_batch * inputs.microbatches
    return [size for size in range(1, per_rank + 1)
            if per_rank % size == 0 and per_rank // size >= min(inputs.layout.pp, per_rank)]


def with_micro_batch(inputs: PlanInputs, size: int) -> PlanInputs:
    """The same step (global batch) in microbatches of ``size`` sequences."""
    return replace(inputs, micro_batch=size, microbatches=inputs.micro_batch * inputs.microbatches // size)


def largest_micro_batch(inputs: PlanInputs, variant: str, gpu_bytes: int) -> Optional[int]:
    """The largest of ``micro_batches`` whose most loaded stage fits ``gpu_bytes``."""
    fitting = [size for size in micro_batches(inputs)
               if most_loaded(every_rank(with_micro_batch(inputs, size), variant)).memory <= gpu_bytes]
    return max(fitting, default=None)


def make_plan(inputs: PlanInputs, paths: List[str], gpu_bytes: int) -> Plan:
    variants = [STOCK] + paths
    return Plan(variants, {v: every_rank(inputs, v) for v in variants}, gpu_bytes,
                {v: largest_micro_batch(inputs, v, gpu_bytes) for v in variants}, max(micro_batches(inputs)),
                inputs.micro_batch * inputs.microbatches)


def _row(label: str, cells: List[str], width: int) -> str:
    return f"  {label:<31}" + "".join(f"{cell:>{width}}" for cell in cells)


def format_plan(plan: Plan, gpu_name: str) -> str:
    loaded = {v: plan.loaded(v) for v in plan.variants}
    siamese = plan.variants[1:]
    width = max(len(NAMES[v]) for v in plan.variants) + 3
    header = [NAMES[v] for v in plan.variants] + [f"{v} - stock" for v in siamese]
    lines = [_row("per GPU, most loaded stage", header, width),
             _row("pipeline stage", [str(loaded[v].rank) for v in plan.variants] + [""] * len(siamese), width)]

    def values(get):
        numbers = [get(loaded[v]) for v in plan.variants]
        return [human(n) for n in numbers] + [("+" if n - numbers[0] >= 0 else "") + human(n - numbers[0])
                                              for n in numbers[1:]]

    for key in (*HELD, "memory"):
        if key == "gathered" and not any(loaded[v].gathered for v in plan.variants):
            continue  # nothing sharded that a layer needs whole
        lines.append(_row(LABELS[key], values(lambda costs: getattr(costs, key)), width))
    lines.append("  sent per step:")
    for key, label in SENT:
        lines.append(_row("  " + label, values(lambda costs: costs.sent.get(key, 0.0)), width))
    verdicts = []
    for v in plan.variants:
        free = plan.gpu_bytes - loaded[v].memory
        verdicts.append(f"yes, {human(free)} free" if free >= 0 else f"no, {human(-free)} short")
    lines.append(_row(f"fits {gpu_name} ({human(plan.gpu_bytes)})", verdicts, width))
    lines.append(_row("largest micro-batch that fits",
                      [str(plan.largest_micro_batch[v] or "none") for v in plan.variants], width))
    if plan.micro_batch_limit in plan.largest_micro_batch.values():
        stages = len(plan.stages[STOCK])
        lines.append(f"  ({plan.micro_batch_limit}: the largest the global batch allows, memory aside: each data-parallel "
                     f"rank's {plan.sequences_per_rank} sequences a step"
                     + (f" in no fewer microbatches than the {stages} pipeline stages" if stages > 1 else "")
                     + "; a larger --global-batch-size allows more)")
    return "\n".join(lines)


def plan_json(plan: Plan, gpu_name: str) -> dict:
    """The plan as plain data: every stage of every variant."""
    return dict(gpu=gpu_name, gpu_bytes=plan.gpu_bytes, variants=plan.variants,
                largest_micro_batch=plan.largest_micro_batch, fits={v: plan.fits(v) for v in plan.variants},
                stages={v: [dict(asdict(c), memory=c.memory) for c in plan.stages[v]] for v in plan.variants})
