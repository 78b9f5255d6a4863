"""The plan held against what CPU ranks measure: every term, every layout, within 5%.

    python bench/plan_agreement.py        # one job of up to 4 ranks (about a minute on 2 cores)

``CASES`` are the layouts (stock Pre-Norm and SiameseNorm on the path the CPU runs, joined; apart
and PyTorch on a few; multi-head attention without RoPE; an MoE model under expert parallelism)
that ``measure`` runs in one job through ``plan_costs.py``; ``compare`` predicts each with the plan
(``megatron_siamese/plan/per_gpu.py``, for the check's tiny fp32 GPT on Megatron's local modules)
and lists, per pipeline stage and term, the measured and predicted bytes (weights, grads,
optimizer, activations, pipeline buffers, and the bytes sent over tp, sp, pp, dp and ep).
Measurements are averaged over the ranks of a pipeline stage, which hold the same but for a
router's imbalance under expert parallelism (the plan assumes a balanced one). SiameseNorm minus
stock is compared too, layout by layout. The script prints the terms, the worst error per term,
and whether every term is within 5% (the table docs/scale.md quotes); tests/test_plan_measured.py
asserts it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from megatron_siamese.check.case import MOE_CASE, ModelCase
from megatron_siamese.plan.activations import STOCK, Implementation
from megatron_siamese.plan.per_gpu import HELD, GpuCosts, PlanInputs, gpu_costs
from megatron_siamese.plan.shapes import shape_of
from megatron_siamese.plan.states import layout_sharding
from megatron_siamese.plan.traffic import KINDS
from megatron_siamese.runtime.layout import Layout, parse_layout

TOLERANCE = 0.05
TERMS = HELD + KINDS

_DENSE = ("single", "tp2", "tp2-sp", "pp2", "pp2-vpp2", "dp2-do", "dp2-fsdp2", "full")
_APART, _PYTORCH = dict(fused_ops=True, boundary_ops=False), dict(fused_ops=False)
# multi-head attention without RoPE: Q, K and V as views of one stored projection, position ids
_MHA = dict(num_query_groups=4, position_embedding_type="learned_absolute")
# without biases: stock Megatron's selective "mlp" recompute cannot train them (check/command.py)
_NO_BIAS = dict(add_bias_linear=False)
_SHARED = dataclasses.replace(MOE_CASE, moe_shared_expert_intermediate_size=32)


def _both(case: ModelCase, *names: str) -> Tuple[Tuple[ModelCase, str], ...]:
    """Stock Pre-Norm and SiameseNorm each under every layout named."""
    return tuple((dataclasses.replace(case, norm=norm), name) for norm in ("pre", case.norm) for name in names)


CASES: Tuple[Tuple[ModelCase, str], ...] = (
    tuple((ModelCase(norm="pre"), name) for name in _DENSE)
    + tuple((ModelCase(), name) for name in _DENSE + ("sel",))
    + tuple((ModelCase(**_APART), name) for name in ("single", "tp2-sp", "sel"))
    + tuple((ModelCase(**_PYTORCH), name) for name in ("single", "pp2"))
    + _both(ModelCase(**_MHA), "tp2-sp")
    + _both(MOE_CASE, "ep2")
    # bf16 (the CPU runs it): fp32 main weights, torch's softmax's fp32 output beside its bf16 copy,
    # statistics in the norms' dtype, FSDP2's bf16 gradients
    + _both(ModelCase(dtype="bf16"), "single", "dp2-fsdp2") + ((ModelCase(dtype="bf16", **_PYTORCH), "single"),)
    # Megatron-FSDP, sharding weights (what it gathers) or gradients only
    + _both(ModelCase(), "dp2-mfsdp3") + ((ModelCase(), "dp2-mfsdp2"),)
    # dropout (its masks), the fused activation, the ablation without depth scale (nothing changes)
    + _both(ModelCase(hidden_dropout=0.1, attention_dropout=0.1), "single")
    + _both(ModelCase(bias_activation_fusion=True), "single") + ((ModelCase(siamese_depth_scale=False), "single"),)
    # recompute, as Megatron-LM's flags spell it: selective per module, full by groups or blocks
    + _both(ModelCase(**_NO_BIAS), "sel", "sel=mlp") + _both(ModelCase(), "sel=core_attn", "fullblock1")
    + ((ModelCase(), "sel=layernorm"), (ModelCase(), "full2"))
    + _both(MOE_CASE, "ep2-sel") + _both(_SHARED, "ep2-sel=moe", "tp2-ep2-sp-sel=moe") + ((_SHARED, "ep2-sel=shared_experts"),)
    # context parallelism through the local specs' attention (keys and values all-gathered over CP)
    + _both(ModelCase(), "cp2", "tp2-cp2-sp", "cp2-sel=core_attn") + _both(ModelCase(**_MHA), "cp2")
    + tuple((ModelCase(), name) for name in ("pp2-cp2", "dp2-cp2-do", "cp2-full"))
)


def case_label(case: ModelCase, name: str) -> str:
    """The layout's name, with what sets the case's model apart from the check's GPT."""
    tags = [tag for tag, on in (("moe", case.num_moe_experts), ("mha", case.num_query_groups == case.num_attention_heads),
                                ("bf16", case.dtype == "bf16"), ("nobias", not case.add_bias_linear and not case.num_moe_experts),
                                ("dropout", case.hidden_dropout or case.attention_dropout),
                                ("fused-act", case.bias_activation_fusion), ("shared", case.moe_shared_expert_intermediate_size),
                                ("no-depth-scale", not case.siamese_depth_scale)) if on]
    return "+".join([name] + tags)


def variant_of(case: ModelCase) -> str:
    """The plan's variant for what a CPU rank runs: stock, or SiameseNorm's path (the fused ops
    where the extension is built, joined unless the boundary ops are turned off)."""
    if case.norm == "pre":
        return STOCK
    if case.fused_ops is False:
        return "pytorch"
    return "apart" if case.boundary_ops is False else "joined"


def case_inputs(case: ModelCase, layout: Layout) -> PlanInputs:
    """The plan's inputs for a check case: its GPT in its dtype on Megatron's local modules (unfused
    attention), its activation fusion and dropout, the case's batch split over DP."""
    from megatron_siamese import device

    size = 2 if case.dtype == "bf16" else 4
    # torch's LayerNorm keeps its statistics in fp32 on CUDA, in its weights' dtype on the CPU; its
    # dropout a bool mask on CUDA, the scaled noise in the activation dtype on the CPU
    cuda = device.uses_cuda()
    impl = Implementation(bytes=size, fused_activation=case.bias_activation_fusion, hidden_dropout=case.hidden_dropout,
                          attention_dropout=case.attention_dropout, norm_stat_bytes=4 if cuda else size,
                          dropout_mask_bytes=1 if cuda else size)
    return PlanInputs(shape_of(case, case.vocab_size), layout, "siamese" if case.norm == "pre" else case.norm,
                      impl, case.micro_batch_size, case.num_microbatches // layout.dp, size, layout_sharding(layout),
                      overlapped_prefetch=cuda)


def terms_of(costs) -> Dict[str, float]:
    """A measurement's (``plan_costs.MeasuredCosts``) or a prediction's (``GpuCosts``) terms."""
    return dict({term: getattr(costs, term) for term in HELD}, **{kind: costs.sent.get(kind, 0.0) for kind in KINDS})


@dataclass(frozen=True)
class Term:
    """One term of one pipeline stage of one case: measured against predicted bytes."""

    layout: str
    variant: str
    stage: int
    term: str
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return (self.predicted - self.measured) / self.measured

    @property
    def agrees(self) -> bool:
        return abs(self.error) <= TOLERANCE


def _stages(ranks) -> Dict[int, Dict[str, float]]:
    """Each pipeline stage's terms, averaged over its ranks."""
    by_stage: Dict[int, List[Dict[str, float]]] = {}
    for rank in ranks:
        by_stage.setdefault(rank.pp_rank, []).append(terms_of(rank))
    return {stage: {term: sum(t[term] for t in found) / len(found) for term in TERMS}
            for stage, found in sorted(by_stage.items())}


def compare(cases: Sequence[Tuple[ModelCase, str]], measured: Sequence[Sequence],
            predict: Callable[[PlanInputs, str, int], GpuCosts] = gpu_costs) -> List[Term]:
    """Every term of every case's every stage, and SiameseNorm minus stock wherever both ran a layout."""
    found: List[Term] = []
    stages: Dict[Tuple[str, str, bool], Dict[int, Tuple[Dict, Dict]]] = {}
    for (case, name), ranks in zip(cases, measured):
        layout, variant, label = parse_layout(name), variant_of(case), case_label(case, name)
        inputs = case_inputs(case, layout)
        for stage, terms in _stages(ranks).items():
            predicted = terms_of(predict(inputs, variant, stage))
            found += [Term(label, variant, stage, term, terms[term], predicted[term]) for term in TERMS]
            stages.setdefault((label, variant, bool(case.num_moe_experts)), {})[stage] = (terms, predicted)
    for (name, variant, moe), siamese in stages.items():
        stock = stages.get((name, STOCK, moe))
        if variant == STOCK or stock is None:
            continue
        # an MoE model routes each token by its own router's choice: SiameseNorm's and stock's
        # activations differ by what they chose, which no difference of the schemes predicts
        compared = [term for term in TERMS if not (moe and term == "activations")]
        for stage, (terms, predicted) in siamese.items():
            base_terms, base_predicted = stock[stage]
            found += [Term(name, f"{variant} - stock", stage, term, terms[term] - base_terms[term],
                           predicted[term] - base_predicted[term]) for term in compared]
    return found


def measure(cases: Sequence[Tuple[ModelCase, str]] = CASES):
    """Every case measured in one job (``plan_costs.measure_layouts``)."""
    from plan_costs import measure_layouts

    return measure_layouts([(case, parse_layout(name)) for case, name in cases])


def format_terms(terms: Sequence[Term]) -> str:
    """One line per case and stage: each nonzero term's measured bytes and the plan's error."""
    lines, rows = [], {}
    for term in terms:
        rows.setdefault((term.layout, term.variant, term.stage), []).append(term)
    for (layout, variant, stage), row in rows.items():
        cells = [f"{t.term} {t.measured:.0f} {t.error:+.1%}" for t in row if t.measured or t.predicted]
        lines.append(f"{layout:<9} {variant:<16} stage {stage}: " + ", ".join(cells))
    return "\n".join(lines)


def worst_by_term(terms: Sequence[Term]) -> str:
    """Per term, how many case stages measured it nonzero and the plan's worst error there."""
    lines = []
    for name in TERMS:
        found = [t for t in terms if t.term == name and t.measured]
        if found:
            worst = max(found, key=lambda t: abs(t.error))
            lines.append(f"{name:<12} {len(found):>3} stages measured, worst {worst.error:+.2%} "
                         f"({worst.layout} {worst.variant} stage {worst.stage})")
    return "\n".join(lines)


def main():
    start = time.perf_counter()
    terms = compare(CASES, measure(CASES))
    print(format_terms(terms))
    print(worst_by_term(terms))
    worst = max(terms, key=lambda t: abs(t.error))
    print(f"{len(terms)} terms of {len(CASES)} cases in {time.perf_counter() - start:.0f} s; worst: {worst.layout} "
          f"{worst.variant} stage {worst.stage} {worst.term} {worst.error:+.2%}; "
          f"{'all' if all(t.agrees for t in terms) else 'NOT all'} within {TOLERANCE:.0%}")


if __name__ == "__main__":
    main()
