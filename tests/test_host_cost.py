"""The host's share of a layer's cost (issue 50), counted, not timed: one SiameseNorm layer's forward
and backward dispatches at most 1.10x the operators of the stock Pre-Norm layer, and has no more
Python autograd nodes than it (the fused ops' autograd is C++), on the local spec and the TE spec's
op structure, fp32 and bf16, with the sublayers apart and joined. bench/host_cost.py prints the
same counts beside the host times (docs/kernels.md, "The host's share")."""

import contextlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from host_cost import Case, VARIANTS  # noqa: E402
from te_stand_ins import stood_in  # noqa: E402

OPS_OVER_STOCK = 1.10
FUSED = [v for v in VARIANTS if v.name in ("siamese-apart", "siamese-joined")]


def counts(variant, spec_kind, dtype):
    case = Case(variant, spec_kind, dtype, hidden=64, seq=8, batch=1)
    case.step()  # first calls fill caches
    return case.counts()


@pytest.mark.parametrize("spec_kind", ["local", "te"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_layer_dispatches_about_what_stock_does_and_runs_no_python_autograd_of_ours(
        megatron_single_rank, spec_kind, dtype):
    with (stood_in() if spec_kind == "te" else contextlib.nullcontext()):
        stock_ops, (_, stock_python) = counts(VARIANTS[0], spec_kind, dtype)
        for variant in FUSED:
            ops, (_, python) = counts(variant, spec_kind, dtype)
            assert python <= stock_python, (variant.name, python, stock_python)
            assert ops <= OPS_OVER_STOCK * stock_ops, (variant.name, ops, stock_ops)


def test_the_counts_see_a_python_autograd_node_and_a_cast(megatron_single_rank, monkeypatch):
    """The counter fails a layer that runs a Python autograd Function, or casts its weights per call."""
    from megatron_siamese.ops import fused

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    real = fused.dual_residual

    def through_python_and_casts(base, out, bias, mask, scale, inv_c):
        for _ in range(20):
            out = out.to(torch.float64).to(out.dtype)
        return real(Identity.apply(base), out, bias, mask, scale, inv_c)

    joined = FUSED[-1]
    ops, (_, python) = counts(joined, "local", "fp32")
    monkeypatch.setattr(fused, "dual_residual", through_python_and_casts)
    planted_ops, (_, planted_python) = counts(joined, "local", "fp32")
    assert planted_python == python + 1
    assert planted_ops >= ops + 20
