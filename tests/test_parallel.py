"""Multi-rank CPU runs (gloo) of one training step agree with one rank."""

import dataclasses
from typing import List, Optional, Tuple

import pytest

from megatron_siamese.check.compare import TOLERANCES, compare
from megatron_siamese.check.step import ModelCase, StepResult, layout_step
from megatron_siamese.runtime.launch import run_job
from megatron_siamese.runtime.layout import Layout, parse_layout

# the PyTorch path here; the check matrix (test_check.py) runs the fused ops
CASE = ModelCase(fused_ops=False)
_results = {}


def run_layout(case: ModelCase, layout: Layout, backend: Optional[str] = None) -> StepResult:
    """Run one step on ``layout.world_size`` ranks (spawned here, or the launched job's), return
    it as global tensors."""
    # the ranks' own output goes to logs, shown only if one fails: the check prints its table
    return run_job(layout_step, layout.world_size, case, layout, backend=backend,
                   quiet_ranks=range(layout.world_size), needs=f"layout {layout.name}")


def replica_disagreements(result: StepResult, prefix: str = "grad:") -> List[Tuple[str, float]]:
    """Replicated tensors whose copies on different ranks are not bitwise equal."""
    return [(k, v) for k, v in sorted(result.replica_spread.items()) if k.startswith(prefix) and v != 0.0]


def step(layout_name: str, case: ModelCase = CASE):
    """One step of ``case`` under a layout, computed once per test session."""
    key = (layout_name, case)
    if key not in _results:
        _results[key] = run_layout(case, parse_layout(layout_name))
    return _results[key]


def assert_matches_single(layout_name: str, case: ModelCase = CASE):
    comparison = compare(step(layout_name, case), step("single", case), TOLERANCES[case.dtype])
    for quantity in ("losses", "grads", "params"):
        check = getattr(comparison, quantity)
        assert check.passed, f"{layout_name} {quantity}: {check.failures[:5]}"
    return comparison


@pytest.mark.parametrize("layout", ["pp2", "pp2-vpp2"])
def test_pipeline_matches_single_rank(layout):
    assert_matches_single(layout)


@pytest.mark.parametrize("layout", ["pp2", "pp2-vpp2"])
def test_pipeline_through_megatron_default_p2p(layout):
    """The Megatron-LM path: layer spec object, no SiameseP2PCommunicator (shape exchange)."""
    case = dataclasses.replace(CASE, norm="siamese-layer", siamese_p2p=False)
    assert_matches_single(layout, case)


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
def test_tensor_parallel_matches_single_rank(layout):
    assert_matches_single(layout)


def test_sequence_parallel_norm_gradients_identical_across_tp_ranks():
    result = step("tp2-sp")
    norm_grads = [k for k in result.replica_spread if k.startswith("grad:") and "norm" in k]
    assert len(norm_grads) >= 6 * CASE.num_layers  # 6 norms per layer, plus the final ones
    assert replica_disagreements(result) == []


def test_full_recompute_is_bitwise_identical():
    comparison = assert_matches_single("full")  # the layer replays exactly the same ops
    assert comparison.grads.worst_error == 0.0 and comparison.params.worst_error == 0.0


def test_selective_recompute_matches_no_recompute():
    # "layernorm" + "mlp": gradients of the recomputed pieces are accumulated in another
    # order, so agreement is to fp32 rounding rather than bitwise
    assert_matches_single("sel")
