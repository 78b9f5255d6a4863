"""The fused dual-norm / dual-residual ops (csrc/) against the plain PyTorch reference.

Tests parametrized by ``hybrid`` run ``hybrid_dual_norm`` (the hybrid variant's attention side:
``c1 * x + PreNorm(y)``, base ``[x | y]``) the same way: the op is the one whose weights
``make_inputs`` drew, six for ``dual_norm``, three (c1, y's gamma and bias) for the hybrid."""

import itertools

import pytest
import torch

from megatron_siamese import ops
from megatron_siamese.reference import functional as reference
from op_checks import assert_compiles_like_eager

pytestmark = pytest.mark.usefixtures("two_cpu_threads")  # the kernels' row blocks (tests/conftest.py)


def test_extension_is_built():
    """The suite below needs the compiled ops; a missing build must fail, not skip."""
    assert ops.load_error() is None


if ops.load_error() is None:
    from megatron_siamese.ops import fused

EPS = 1e-5
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and ops.has_cuda_kernels() else [])


def make_inputs(rows, hidden, packed=True, rms=False, input_norm=True, dtype=torch.float32,
                device="cpu", offset=0.0, weight_dtype=None, seed=0, hybrid=False):
    generator = torch.Generator().manual_seed(seed)
    width = 2 * hidden if packed else hidden
    streams = (torch.randn(rows, width, generator=generator) * 2 + offset).to(device, dtype)
    weight_dtype = weight_dtype or dtype

    def vector(scale, center):
        return (torch.randn(hidden, generator=generator) * scale + center).to(device, weight_dtype)

    weights = [vector(0.3, 1.0), None if rms else vector(0.3, 0.0),
               vector(0.3, 1.0), None if rms else vector(0.3, 0.0),
               vector(0.3, 1.0) if input_norm else None,
               None if (rms or not input_norm) else vector(0.3, 0.0)]
    if hybrid:  # hybrid_dual_norm's weights: c1 (drawn around 1, as x's gamma), y's gamma and bias
        weights = [weights[0], weights[2], weights[3]]
    return streams, weights


def reference_dual_norm(streams, hidden, weights, rms, zero_centered=False, compute=None):
    """reference.dual_norm or reference.hybrid_dual_norm (the ops' signatures), by the weights
    given, optionally computed in another dtype."""
    compute = compute or streams.dtype
    w = [None if t is None else t.to(compute) for t in weights]
    op = reference.dual_norm if len(weights) == 6 else reference.hybrid_dual_norm
    return op(streams.to(compute), hidden, *w, EPS, rms, zero_centered)


def fused_dual_norm(streams, hidden, weights, rms, zero_centered=False):
    op = fused.dual_norm if len(weights) == 6 else fused.hybrid_dual_norm
    return op(streams, hidden, *weights, EPS, rms, zero_centered)


# -- gradients: fp64 gradcheck ------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed,rms,input_norm,zero_centered",
                         list(itertools.product([True, False], [False, True], [True, False], [False, True])))
def test_dual_norm_gradcheck_fp64(device, packed, rms, input_norm, zero_centered):
    streams, weights = make_inputs(5, 7, packed, rms, input_norm, dtype=torch.float64, device=device)
    inputs = [streams] + [w for w in weights if w is not None]
    for t in inputs:
        t.requires_grad_(True)

    def run(streams, *present):
        it = iter(present)
        full = [None if w is None else next(it) for w in weights]
        base, normed = fused_dual_norm(streams, 7, full, rms, zero_centered)
        return base, normed

    assert torch.autograd.gradcheck(run, tuple(inputs), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed,rms,zero_centered",
                         list(itertools.product([True, False], [False, True], [False, True])))
def test_hybrid_dual_norm_gradcheck_fp64(device, packed, rms, zero_centered):
    streams, weights = make_inputs(5, 7, packed, rms, dtype=torch.float64, device=device, hybrid=True)
    inputs = [t.requires_grad_(True) for t in [streams] + weights if t is not None]

    def run(streams, x_scale, y_weight, *y_bias):
        return fused.hybrid_dual_norm(streams, 7, x_scale, y_weight, y_bias[0] if y_bias else None, EPS, rms,
                                      zero_centered)

    assert torch.autograd.gradcheck(run, tuple(inputs), eps=1e-6, atol=1e-6)


def test_hybrid_dual_norm_is_the_hybrid_formula():
    """The reference itself, against the formula written out: base keeps x, normed = c1 x + PreNorm(y)."""
    streams, (c1, gamma, beta) = make_inputs(4, 16, dtype=torch.float64, hybrid=True)
    x, y = streams.split(16, dim=-1)
    base, normed = reference_dual_norm(streams, 16, [c1, gamma, beta], rms=False)
    torch.testing.assert_close(base, streams)
    torch.testing.assert_close(normed, c1 * x + torch.nn.functional.layer_norm(y, (16,), gamma, beta, EPS))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias,with_mask", list(itertools.product([True, False], [True, False])))
def test_dual_residual_gradcheck_fp64(device, with_bias, with_mask):
    generator = torch.Generator().manual_seed(1)

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).to(device).requires_grad_(True)

    base, out = leaf(4, 10), leaf(4, 5)
    bias = leaf(5) if with_bias else None
    mask = (torch.rand(4, 5, generator=generator) > 0.3).to(device) if with_mask else None
    inputs = (base, out) + ((bias,) if with_bias else ())

    def run(base, out, *maybe_bias):
        return fused.dual_residual(base, out, maybe_bias[0] if maybe_bias else None, mask, 1.25, 0.5)

    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-6)


# -- values against the reference, every dtype -------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden", [1, 7, 123, 1000, 3000, 4096, 8192])  # wide rows: CUDA's larger launches
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("hybrid", [False, True], ids=["dual_norm", "hybrid"])
def test_dual_norm_matches_reference_fp32(device, hidden, rms, hybrid):
    streams, weights = make_inputs(9, hidden, rms=rms, device=device, hybrid=hybrid)
    for t in [streams] + weights:
        if t is not None:
            t.requires_grad_(True)
    base, normed = fused_dual_norm(streams, hidden, weights, rms)
    ref_base, ref_normed = reference_dual_norm(streams, hidden, weights, rms)
    torch.testing.assert_close(base, ref_base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)
    grads = [torch.randn_like(base), torch.randn_like(normed)]
    present = [t for t in [streams] + weights if t is not None]
    got = torch.autograd.grad((base, normed), present, grads)
    expected = torch.autograd.grad((ref_base, ref_normed), present, grads)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4 * max(1.0, float(e.abs().max())))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [7, 123, 1000])  # tail only, vectors + tail, vectors only
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("hybrid", [False, True], ids=["dual_norm", "hybrid"])
def test_16bit_error_at_most_twice_pytorch_error(device, dtype, hidden, rms, zero_centered, hybrid):
    """As flash-attention tests its norms: against an fp32 reference, the fused op's error is
    at most twice the error of the same-dtype PyTorch composition (plus a hair for ties)."""
    streams32, weights32 = make_inputs(16, hidden, rms=rms, device=device, weight_dtype=torch.float32, hybrid=hybrid)
    streams = streams32.to(dtype)
    weights = [None if w is None else w.to(dtype) for w in weights32]
    gold = reference_dual_norm(streams, hidden, weights, rms, zero_centered, compute=torch.float64)
    torch_way = reference_dual_norm(streams, hidden, weights, rms, zero_centered)
    ours = fused_dual_norm(streams, hidden, weights, rms, zero_centered)
    for o, t, g in zip(ours, torch_way, gold):
        ours_error = float((o.double() - g).abs().max())
        torch_error = float((t.double() - g).abs().max())
        assert ours_error <= 2 * torch_error + 1e-6 * float(g.abs().max()), (ours_error, torch_error)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [2048, 4096, 8192])  # the CUDA kernels' wider launch configurations
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("hybrid", [False, True], ids=["dual_norm", "hybrid"])
def test_16bit_wide_rows_forward_and_backward(device, dtype, hidden, rms, hybrid):
    """Outputs and every gradient at model widths: the fused op's error against an fp64
    reference is at most twice the same-dtype PyTorch composition's, plus one rounding step."""
    streams32, weights32 = make_inputs(8, hidden, rms=rms, device=device, weight_dtype=torch.float32, hybrid=hybrid)
    generator = torch.Generator().manual_seed(1)
    upstream = [torch.randn(8, 2 * hidden, generator=generator), torch.randn(8, hidden, generator=generator)]

    def outputs_and_grads(op, compute):
        leaves = [None if t is None else t.to(dtype).to(compute).requires_grad_(True) for t in [streams32] + weights32]
        outs = op(leaves[0], hidden, leaves[1:], rms)
        present = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(outs, present, [g.to(device, dtype).to(compute) for g in upstream])
        return [t.detach() for t in list(outs) + list(grads)]

    gold = outputs_and_grads(reference_dual_norm, torch.float64)
    torch_way = outputs_and_grads(reference_dual_norm, dtype)
    ours = outputs_and_grads(fused_dual_norm, dtype)
    for index, (o, t, g) in enumerate(zip(ours, torch_way, gold)):
        hair = torch.finfo(dtype).eps * float(g.abs().max())
        ours_error, torch_error = float((o.double() - g).abs().max()), float((t.double() - g).abs().max())
        assert ours_error <= 2 * torch_error + hair, (index, ours_error, torch_error)


def cuda_kernels_refuse_width(device, hidden, hybrid=False):
    """The verified CUDA kernels (the default generation) hold rows up to 8192 wide; wider rows
    are refused with a message naming both ways on (docs/kernels.md). The hybrid op runs the
    general kernels under both generations (dual_norm_cuda.cu): no width limit."""
    return device == "cuda" and ops.cuda_kernel_generation() == "verified" and hidden > 8192 and not hybrid


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [12288, 16384, 20000])  # beyond the tiled kernels' registers: general kernels
@pytest.mark.parametrize("hybrid", [False, True], ids=["dual_norm", "hybrid"])
def test_rows_of_any_width(device, dtype, hidden, hybrid):
    """No width limit that the PyTorch path lacks: rows wider than any register plan match the
    reference forward and backward (the 16-bit error at most twice PyTorch's, plus a rounding)."""
    streams32, weights32 = make_inputs(3, hidden, rms=False, device=device, weight_dtype=torch.float32, hybrid=hybrid)
    if cuda_kernels_refuse_width(device, hidden, hybrid):
        with pytest.raises(RuntimeError, match="MEGATRON_SIAMESE_CUDA_KERNELS=tiled.*siamese_fused_ops=False"):
            fused_dual_norm(streams32.to(dtype), hidden, weights32, rms=False)
        return
    upstream = [torch.randn(3, 2 * hidden, device=device), torch.randn(3, hidden, device=device)]

    def outputs_and_grads(op, compute):
        leaves = [None if t is None else t.to(dtype).to(compute).requires_grad_(True) for t in [streams32] + weights32]
        outs = op(leaves[0], hidden, leaves[1:], False)
        present = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(outs, present, [g.to(dtype).to(compute) for g in upstream])
        return [t.detach() for t in list(outs) + list(grads)]

    gold = outputs_and_grads(reference_dual_norm, torch.float64)
    torch_way = outputs_and_grads(reference_dual_norm, dtype)
    ours = outputs_and_grads(fused_dual_norm, dtype)
    for index, (o, t, g) in enumerate(zip(ours, torch_way, gold)):
        hair = 4 * torch.finfo(dtype).eps * float(g.abs().max())
        ours_error, torch_error = float((o.double() - g).abs().max()), float((t.double() - g).abs().max())
        assert ours_error <= 2 * torch_error + hair, (index, ours_error, torch_error)


def misaligned(t):
    """A contiguous copy of ``t`` whose data starts 2 bytes past an allocation's alignment."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    view = flat[1:1 + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hybrid", [False, True], ids=["dual_norm", "hybrid"])
def test_unaligned_rows_take_a_correct_path(device, dtype, hybrid):
    """Streams that do not start on 16 bytes, and an odd width: the same results as aligned ones.
    Bitwise, except fp32 rows on CUDA: there an aligned row is loaded 4 elements a thread and an
    unaligned one element by element, so each thread sums other elements and the statistics
    differ in the last bits (4.8e-7 at most on the H200, 2026-12-04): torch's fp32 tolerance.
    16-bit outputs round those bits away (bitwise on the H200, both kernel generations)."""
    reduction_order = dict(rtol=1.3e-6, atol=1e-5) if (device, dtype) == ("cuda", torch.float32) else dict(rtol=0, atol=0)
    for hidden in (256, 250):
        streams, weights = make_inputs(6, hidden, device=device, dtype=dtype, weight_dtype=torch.float32, hybrid=hybrid)
        shifted = misaligned(streams)
        expected = fused_dual_norm(streams, hidden, weights, rms=False)
        got = fused_dual_norm(shifted, hidden, weights, rms=False)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, **reduction_order)
        out = torch.randn(6, hidden, device=device).to(dtype)
        torch.testing.assert_close(fused.dual_residual(misaligned(expected[0]), misaligned(out), None, None, 1.0, 0.5),
                                   fused.dual_residual(expected[0], out, None, None, 1.0, 0.5), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_and_layouts_are_refused_by_name(device):
    streams, weights = make_inputs(4, 16, device=device, dtype=torch.bfloat16)
    half_weight = [weights[0].to(torch.float16)] + weights[1:]
    with pytest.raises(RuntimeError, match=r"x_weight must be in the streams' dtype \(BFloat16\) or float32, got Half"):
        torch.ops.megatron_siamese.dual_norm(streams, 16, *half_weight, EPS, False, False)
    with pytest.raises(RuntimeError, match="streams must be contiguous"):
        torch.ops.megatron_siamese.dual_norm(streams.t().contiguous().t(), 16, *weights, EPS, False, False)
    base, normed, stats = torch.ops.megatron_siamese.dual_norm(streams, 16, *weights, EPS, False, False)
    with pytest.raises(RuntimeError, match="grad_base .* must be in the streams' dtype"):
        torch.ops.megatron_siamese.dual_norm_backward(base.float(), normed, streams, stats, 16, *weights, False, False)
    out = torch.randn(4, 16, device=device, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="base and out dtypes differ"):
        torch.ops.megatron_siamese.dual_residual(base, out, None, None, 1.0, 0.5)
    with pytest.raises(RuntimeError, match="bias must be in out's dtype"):
        torch.ops.megatron_siamese.dual_residual(base, normed, torch.zeros(16, device=device, dtype=torch.float16),
                                                 None, 1.0, 0.5)
    # the entry points take any layout: a transposed view is made contiguous, with the same result
    wide = streams.t().contiguous().t()
    torch.testing.assert_close(fused.dual_norm(wide, 16, *weights, EPS, False, False)[1], normed)


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_refusals_name_the_op_and_argument(device):
    streams, (c1, gamma, beta) = make_inputs(4, 16, device=device, dtype=torch.bfloat16, hybrid=True)
    hybrid = torch.ops.megatron_siamese.hybrid_dual_norm
    with pytest.raises(RuntimeError, match=r"hybrid_dual_norm: x_scale must be in the streams' dtype \(BFloat16\)"):
        hybrid(streams, 16, c1.half(), gamma, beta, EPS, False, False)
    with pytest.raises(RuntimeError, match=r"hybrid_dual_norm: x_scale must have shape \[16\]"):
        hybrid(streams, 16, c1[:8], gamma, beta, EPS, False, False)
    with pytest.raises(RuntimeError, match="hybrid_dual_norm: RMSNorm has no bias"):
        hybrid(streams, 16, c1, gamma, beta, EPS, True, False)
    base, normed, stats = hybrid(streams, 16, c1, gamma, beta, EPS, False, False)
    with pytest.raises(RuntimeError, match="hybrid_dual_norm_backward: stats must be the forward's"):
        torch.ops.megatron_siamese.hybrid_dual_norm_backward(base, normed, streams, stats[:, :3].contiguous(), 16,
                                                             c1, gamma, beta, False, False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [0, 1])
@pytest.mark.parametrize("hybrid", [False, True], ids=["dual_norm", "hybrid"])
def test_zero_and_one_rows(device, rows, hybrid):
    """Both outputs and every gradient equal the reference's, with the right shapes, for no row
    and one row."""
    streams, weights = make_inputs(rows, 9, device=device, hybrid=hybrid)
    present = [t.requires_grad_(True) for t in [streams] + weights if t is not None]
    outs = fused_dual_norm(streams, 9, weights, rms=False)
    expected = reference_dual_norm(streams, 9, weights, rms=False)
    assert outs[0].shape == (rows, 18) and outs[1].shape == (rows, 9)
    upstream = [torch.linspace(-1, 1, rows * 18, device=device).view(rows, 18),
                torch.linspace(1, 2, rows * 9, device=device).view(rows, 9)]
    grads = torch.autograd.grad(outs, present, upstream)
    expected_grads = torch.autograd.grad(expected, present, upstream)
    for got, want in zip(list(outs) + list(grads), list(expected) + list(expected_grads)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_large_mean_offset_is_normalized_stably(device):
    """Two-pass statistics: a row offset of 1e4 with unit spread still normalizes to fp32 accuracy."""
    streams, weights = make_inputs(8, 256, offset=1e4, device=device)
    _, normed = fused_dual_norm(streams, 256, weights, rms=False)
    _, expected = reference_dual_norm(streams.double(), 256, [w.double() for w in weights], rms=False)
    torch.testing.assert_close(normed.double(), expected, rtol=2e-3, atol=2e-3)
    # a one-pass E[x^2] - E[x]^2 in fp32 would have lost the spread entirely at this offset
    assert normed.std() > 0.1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hybrid", [False, True], ids=["dual_norm", "hybrid"])
def test_backward_is_deterministic(device, hybrid):
    streams, weights = make_inputs(64, 100, device=device, hybrid=hybrid)
    for t in [streams] + weights:
        t.requires_grad_(True)

    def grads():
        base, normed = fused_dual_norm(streams, 100, weights, rms=False)
        return torch.autograd.grad((base.sum() + normed.square().sum(),), [streams] + weights)

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("device", DEVICES)
def test_dual_residual_matches_reference(device):
    generator = torch.Generator().manual_seed(3)
    hidden, c = 123, 2.0 ** 0.5
    # [seq, batch, h] as the layers pass them: the bias gradient sums over both leading dims
    u, y, out = (torch.randn(3, 2, hidden, generator=generator).to(device).requires_grad_(True) for _ in range(3))
    bias = torch.randn(hidden, generator=generator).to(device).requires_grad_(True)
    mask = (torch.rand(3, 2, hidden, generator=generator) > 0.2).to(device)
    base = torch.cat([u, y], dim=-1)
    packed = fused.dual_residual(base, out, bias, mask, 1 / 0.8, 1 / c)
    z = (out + bias) * mask / 0.8
    expected = torch.cat([u + z / c, y + z], dim=-1)  # the formula itself
    torch.testing.assert_close(reference.dual_residual(base, out, bias, mask, 1 / 0.8, 1 / c), expected)
    torch.testing.assert_close(packed, expected)
    g = torch.randn_like(packed)
    for got, want in zip(torch.autograd.grad(packed, (u, y, out, bias), g),
                         torch.autograd.grad(expected, (u, y, out, bias), g)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- torch.library contracts ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hybrid", [False, True], ids=["dual_norm", "hybrid"])
def test_opcheck_norm_ops(device, hybrid):
    op = torch.ops.megatron_siamese.hybrid_dual_norm if hybrid else torch.ops.megatron_siamese.dual_norm
    for packed, rms, zero_centered in itertools.product([True, False], [False, True], [False, True]):
        streams, weights = make_inputs(4, 6, packed, rms, device=device, hybrid=hybrid)
        for t in [streams] + weights:
            if t is not None:
                t.requires_grad_(True)
        torch.library.opcheck(op.default, (streams, 6, *weights, EPS, rms, zero_centered))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_dual_residual(device):
    base = torch.randn(4, 10, device=device, requires_grad=True)
    out = torch.randn(4, 5, device=device, requires_grad=True)
    bias = torch.randn(5, device=device, requires_grad=True)
    mask = torch.rand(4, 5, device=device) > 0.5
    torch.library.opcheck(torch.ops.megatron_siamese.dual_residual.default, (base, out, bias, mask, 2.0, 0.5))
    torch.library.opcheck(torch.ops.megatron_siamese.dual_residual.default, (base, out, None, None, 1.0, 0.5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hybrid", [False, True], ids=["dual_norm", "hybrid"])
def test_torch_compile_traces_without_graph_breaks(device, hybrid):
    streams, weights = make_inputs(8, 32, device=device, hybrid=hybrid)
    streams.requires_grad_(True)
    out = torch.randn(8, 32, device=device)

    def sublayer(streams):
        base, normed = fused_dual_norm(streams, 32, weights, rms=False)
        return fused.dual_residual(base, normed * 0.5 + out, None, None, 1.0, 0.5)

    assert_compiles_like_eager(sublayer, streams)


# -- the layer's choice ----------------------------------------------------------------------

def test_layer_uses_fused_ops_by_default_and_refuses_to_fake_them(megatron_single_rank, monkeypatch):
    import dataclasses

    from megatron.core.transformer.spec_utils import build_module

    from megatron_siamese.check.step import ModelCase, case_config
    from megatron_siamese.runtime.layout import Layout
    from megatron_siamese.specs import get_siamese_layer_local_spec
    from megatron_siamese.stream_arithmetic import FusedStreamArithmetic, TorchStreamArithmetic

    config = case_config(ModelCase(), Layout())
    cpu = torch.device("cpu")

    def layer(**changes):
        return build_module(get_siamese_layer_local_spec(), config=dataclasses.replace(config, **changes))

    assert isinstance(layer().stream_arithmetic.on(cpu), FusedStreamArithmetic)
    assert isinstance(layer(siamese_fused_ops=False).stream_arithmetic.on(cpu), TorchStreamArithmetic)
    # what train's line says of each (runtime/pretrain.py)
    assert layer().stream_arithmetic.describe(cpu) == "the fused C++ ops, joined by the boundary ops"
    assert layer(siamese_boundary_ops=False).stream_arithmetic.describe(cpu) == \
        "the fused C++ ops, each sublayer's apart (the boundary ops off)"
    assert layer(siamese_fused_ops=False).stream_arithmetic.describe(cpu) == \
        "PyTorch's ops, the same function unfused (--no-fused-ops given)"
    # the device comes from the tensors: a device without kernels takes the PyTorch path ...
    monkeypatch.setattr(ops, "unavailable_reason", lambda device: "no kernels for this test")
    assert isinstance(layer().stream_arithmetic.on(cpu), TorchStreamArithmetic)
    assert layer().stream_arithmetic.describe(cpu) == "PyTorch's ops, the same function unfused (no kernels for this test)"
    # ... unless the fused ops were insisted on: then it fails with the reason
    forced = layer(siamese_fused_ops=True)
    with pytest.raises(RuntimeError, match="no kernels for this test.*siamese_fused_ops=False"):
        forced.stream_arithmetic.on(cpu)
    # without the extension at all, insisting fails at construction
    monkeypatch.setattr(ops, "load_error", lambda: "no extension for this test")
    with pytest.raises(RuntimeError, match="no extension for this test"):
        layer(siamese_fused_ops=True)


@pytest.mark.skipif(ops.unavailable_reason("cuda") is not None, reason="this build has no CUDA kernels")
def test_cuda_tensors_take_the_fused_and_joined_ops_by_default(megatron_single_rank):
    """Since the H200 run of 2026-12-04 (docs/kernels.md) the hybrid op's and the boundary ops'
    CUDA kernels are picked as on the CPU: by default, for both variants; False still refuses them."""
    from megatron_siamese.config import SiameseTransformerConfig
    from megatron_siamese.norms import ChannelScale, TorchNorm
    from megatron_siamese.stream_arithmetic import StreamArithmetic

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for boundary, joined in ((None, True), (True, True), (False, False)):
        config = SiameseTransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                          siamese_boundary_ops=boundary)
        hybrid = StreamArithmetic(config, [ChannelScale(config, 8), TorchNorm(config, 8)])
        standard = StreamArithmetic(config, [TorchNorm(config, 8), TorchNorm(config, 8)])
        assert (hybrid.on(cuda).name, standard.on(cuda).name, hybrid.on(cpu).name) == ("fused", "fused", "fused")
        assert (hybrid.joins(cuda), standard.joins(cuda), standard.joins(cpu)) == (joined, joined, joined)
