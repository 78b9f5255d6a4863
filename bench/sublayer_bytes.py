"""Bytes per sublayer, counted from the real code path of one layer on CPU, side by side.

    python bench/sublayer_bytes.py                 # h 1024, seq 256, micro-batch 2, bf16 (about a minute)
    python bench/sublayer_bytes.py --hidden 256 --seq 64 --no-time

One layer (global layer 2 of 4, so SiameseNorm gets packed [s, b, 2h] streams) runs forward and
backward under a TorchDispatchMode that adds up the bytes every op reads and writes of the
tokens' h-wide activations ([T, h] or [T, 2h] tensors, T = s * b), outside the attention and
MLP modules: those run inside an opaque region, so their GEMMs and internals (the same for
every variant) are not counted. Each torch norm module (stock's norms, the PyTorch path's, and
the InputNorm that Transformer Engine fuses into the first linear of a sublayer, stood in for
here) is counted as one fused kernel would move it, whatever torch's CPU composition does
inside: forward its input and output, backward the output gradient, the saved input and the
input gradient. Views and GEMMs move no counted bytes. One pass = T * h * 2 bytes (a bf16
[T, h] tensor); fp32 statistics and weight-gradient partials ([h]-wide) are not passes and are
left out.

Variants (``--spec local`` and the TE spec's op structure with TE's modules stood in by
Megatron's local ones, bench/te_stand_ins.py):

  stock           Megatron's Pre-Norm layer (local: TorchNorm + bias-dropout-add;
                  TE: the InputNorm inside the LayerNorm-fused linear)
  siamese-torch   SiameseNorm on torch's norms (the PyTorch path)
  siamese-apart   the fused ops, a dual_norm and a dual_residual per sublayer (--no-boundary-ops)
  siamese-joined  the boundary ops: entry_norm, residual_dual_norm, dual_residual (the default on CPU)
  siamese-te-earlier (TE only) the TE spec before the InputNorm became ours: dual_norm without
                  InputNorm, then TE's LayerNorm-fused linear normalizing that again

LayerNorm throughout (torch's CPU LayerNorm is one kernel that keeps its input and statistics,
as a GPU norm does; its CPU RMSNorm is a composition that keeps fp32 copies). Then the bytes
autograd keeps for backward (saved_tensors_hooks, one storage counted once, parameters
excluded), per layer and SiameseNorm minus stock, in h-wide bf16 vectors per token, and the CPU
time of one layer's forward + backward, SiameseNorm / stock (reported only: a CPU's GEMMs weigh
differently from a GPU's). docs/kernels.md derives the counts op by op.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_attention_math"}
_REGIONS: list = []  # the innermost region's name: None (not counted) or a name the counter records
_COUNTER: list = []  # the counter counting now, if any


@contextlib.contextmanager
def region(name):
    _REGIONS.append(name)
    try:
        yield
    finally:
        _REGIONS.pop()


class _Opaque(torch.autograd.Function):
    """Runs ``function(x)`` in a region, forward and backward. Its ops are not counted one by one
    (region None); with ``kernel_name`` the region counts as one fused kernel of that name: the
    tensors crossing it (forward: x and the outputs; backward: the output gradients, the saved
    x and x's gradient)."""

    @staticmethod
    def forward(ctx, holder, kernel_name, x):
        inner = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad(), region(None):
            outputs = holder.function(inner)
        flat = outputs if isinstance(outputs, tuple) else (outputs,)
        ctx.kernel_name, ctx.inner, ctx.outputs = kernel_name, inner, [o for o in flat if isinstance(o, torch.Tensor)]
        holder.structure = [None if o is None else "tensor" for o in flat]
        if kernel_name and _COUNTER:
            _COUNTER[-1].add(kernel_name, [x, *ctx.outputs])
        return tuple(o.detach() for o in ctx.outputs)

    @staticmethod
    def backward(ctx, *grads):
        pairs = [(o, g) for o, g in zip(ctx.outputs, grads) if o.requires_grad and g is not None]
        with region(None):
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if ctx.kernel_name and _COUNTER:
            _COUNTER[-1].add(ctx.kernel_name, [*(g for _, g in pairs), ctx.inner, ctx.inner.grad])
        return None, None, ctx.inner.grad


def opaque(function, x, kernel_name=None):
    """``function(x)`` (a tensor or a tuple with None) behind an autograd boundary (see _Opaque)."""

    class Holder:
        pass

    holder = Holder()
    holder.function = function
    results = iter(_Opaque.apply(holder, kernel_name, x))
    outputs = tuple(None if kind is None else next(results) for kind in holder.structure)
    return outputs if len(outputs) > 1 else outputs[0]


class ByteCounter(TorchDispatchMode):
    """Bytes of [T, h] / [T, 2h] activations each op reads and writes, per (phase, op), outside
    opaque regions (which add their own, as kernels, by ``add``)."""

    def __init__(self, tokens: int, hidden: int):
        super().__init__()
        self.tokens, self.hidden = tokens, hidden
        self.phase = "forward"
        self.bytes = defaultdict(int)

    def _activation_bytes(self, tensors) -> int:
        return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor) and t.dim() >= 2
                   and t.shape[-1] in (self.hidden, 2 * self.hidden) and t.numel() == self.tokens * t.shape[-1])

    def add(self, name, tensors) -> None:
        self.bytes[(self.phase, name)] += self._activation_bytes(tensors)

    def __enter__(self):
        _COUNTER.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _COUNTER.pop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _REGIONS or func.is_view or func.__name__.split(".")[0] in GEMMS:
            return out
        moved = self._activation_bytes(tree_leaves((args, kwargs))) + self._activation_bytes(tree_leaves(out))
        if moved:
            op = func.__name__.split(".")[0]
            self.bytes[(self.phase, op if func.namespace == "aten" else f"{func.namespace}::{op}")] += moved
        return out


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    norm: str
    fused_ops: bool = None
    boundary_ops: bool = None
    earlier_te: bool = False


VARIANTS = (Variant("stock", "pre"), Variant("siamese-torch", "siamese", fused_ops=False),
            Variant("siamese-apart", "siamese", fused_ops=True, boundary_ops=False),
            Variant("siamese-joined", "siamese", fused_ops=True, boundary_ops=True))
TE_EARLIER = Variant("siamese-te-earlier", "siamese", fused_ops=True, boundary_ops=False, earlier_te=True)


def setup_single_rank():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_siamese.runtime import cpu_shim
    from megatron_siamese.runtime.launch import free_port

    cpu_shim.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


def earlier_te_layer_spec(spec):
    """Today's TE spec as it was before its InputNorms became ours: no input_layernorm /
    pre_mlp_layernorm (dual_norm without InputNorm), LayerNorm-fused linear_qkv and linear_fc1."""
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_siamese.specs import _with_fc1
    from te_stand_ins import LayerNormColumnParallelLinear

    sub = spec.submodules
    attention = dataclasses.replace(sub.self_attention, submodules=dataclasses.replace(
        sub.self_attention.submodules, linear_qkv=LayerNormColumnParallelLinear))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        sub, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp, self_attention=attention,
        mlp=_with_fc1(sub.mlp, LayerNormColumnParallelLinear), sharded_state_dict_keys_map={}))


def build_layer(variant: Variant, spec_kind: str, hidden: int, seq: int, dtype: str = "bf16"):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_siamese.check.step import ModelCase, case_config
    from megatron_siamese.models import scheme
    from megatron_siamese.runtime.layout import Layout

    case = ModelCase(hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=8, num_query_groups=8,
                     seq_length=seq, add_bias_linear=False, num_layers=4, dtype=dtype, normalization="LayerNorm",
                     fused_ops=variant.fused_ops, boundary_ops=variant.boundary_ops,
                     transformer_impl="transformer_engine" if spec_kind == "te" else "local")
    config = case_config(case, Layout())
    if variant.norm == "pre" and spec_kind == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = scheme(variant.norm).block_spec(config, None).layer_specs[0]
    if variant.earlier_te:
        spec = earlier_te_layer_spec(spec)
    return build_module(spec, config=config, layer_number=2).to(config.params_dtype), config


NORM_SLOTS = ("input_layernorm", "pre_mlp_layernorm", "attn_x_norm", "attn_y_norm", "mlp_x_norm", "mlp_y_norm")


def run_layer(layer, config, inputs, output_grad, counted=False):
    """One forward + backward. ``counted``: the attention and MLP modules run opaque (their
    internals are not counted) and the layer's torch norm modules as one kernel each."""
    from megatron_siamese.norms import TorchNorm

    mask = torch.ones(inputs.shape[0], inputs.shape[0], dtype=torch.bool).triu(1)[None, None]
    originals = {}
    if counted:
        def wrapped(forward, kernel_name=None):
            return lambda x, *a, **k: opaque(lambda inner: forward(inner, *a, **k), x, kernel_name)

        for name in ("self_attention", "mlp") + NORM_SLOTS:
            module = getattr(layer, name, None)
            if name in NORM_SLOTS and not isinstance(module, TorchNorm):
                continue
            originals[name] = module.forward
            module.forward = wrapped(module.forward, None if name in ("self_attention", "mlp") else "norm (one kernel)")
    try:
        output, _ = layer(hidden_states=inputs, attention_mask=mask)
        return output, lambda: output.backward(output_grad)
    finally:
        for name, forward in originals.items():
            getattr(layer, name).forward = forward


def count_passes(variant, spec_kind, hidden, seq, batch):
    from te_stand_ins import LayerNormColumnParallelLinear

    layer, config = build_layer(variant, spec_kind, hidden, seq)
    width = hidden if variant.norm == "pre" else 2 * hidden
    inputs = torch.randn(seq, batch, width, dtype=torch.bfloat16, requires_grad=True)
    output_grad = torch.randn(seq, batch, width, dtype=torch.bfloat16)
    tokens = seq * batch
    counter = ByteCounter(tokens, hidden)
    LayerNormColumnParallelLinear.norm_region = staticmethod(
        lambda function, x: opaque(function, x, "TE LayerNorm-fused linear's norm"))
    try:
        with counter:
            _, backward = run_layer(layer, config, inputs, output_grad, counted=True)
            counter.phase = "backward"
            backward()
    finally:
        LayerNormColumnParallelLinear.norm_region = staticmethod(lambda function, x: function(x))
    per_pass = tokens * hidden * 2
    return {key: value / per_pass / 2 for key, value in counter.bytes.items()}  # per sublayer: a layer holds two


def saved_vectors(variant, spec_kind, hidden, seq, batch):
    """h-wide bf16 vectors per token a layer keeps for backward (saved tensors' storages, once each)."""
    layer, config = build_layer(variant, spec_kind, hidden, seq)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    width = hidden if variant.norm == "pre" else 2 * hidden
    inputs = torch.randn(seq, batch, width, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        output, backward = run_layer(layer, config, inputs, torch.ones_like(inputs[..., :1]).expand(
            seq, batch, width).contiguous())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    kept = sum(n for ptr, n in storages.items() if ptr not in params)
    backward()
    return kept / (seq * batch * hidden * 2)


def cpu_ms(variant, hidden, seq, batch, repeats=5):
    layer, config = build_layer(variant, "local", hidden, seq)
    width = hidden if variant.norm == "pre" else 2 * hidden
    inputs = torch.randn(seq, batch, width, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(seq, batch, width, dtype=torch.bfloat16)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        _, backward = run_layer(layer, config, inputs, grad)
        backward()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times[1:])[len(times[1:]) // 2]


def print_passes(spec_kind, variants, hidden, seq, batch):
    from te_stand_ins import stood_in

    with (stood_in() if spec_kind == "te" else contextlib.nullcontext()):
        counts = {v.name: count_passes(v, spec_kind, hidden, seq, batch) for v in variants}
    title = "local spec" if spec_kind == "local" else "TE spec's op structure (TE stood in)"
    print(f"\nPasses per sublayer over [T, h] (bf16, T = {seq * batch}, h = {hidden}), {title}:")
    names = [v.name for v in variants]
    print(f"{'op':<48} {'phase':<9}" + "".join(f"{n:>19}" for n in names))
    keys = sorted({key for c in counts.values() for key in c}, key=lambda k: (k[0] != "forward", k[1]))
    for phase, op in keys:
        print(f"{op:<48} {phase:<9}" + "".join(f"{counts[n].get((phase, op), 0):>19.2f}" for n in names))
    for phase in ("forward", "backward"):
        print(f"{'total':<48} {phase:<9}" + "".join(
            f"{sum(v for (p, _), v in counts[n].items() if p == phase):>19.2f}" for n in names))
    print(f"{'total':<48} {'both':<9}" + "".join(f"{sum(counts[n].values()):>19.2f}" for n in names))
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size h (default 1024)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size (default 2)")
    parser.add_argument("--no-time", action="store_true", help="skip the CPU time table")
    args = parser.parse_args()
    setup_single_rank()
    torch.manual_seed(0)
    h, s, b = args.hidden, args.seq, args.batch
    print_passes("local", VARIANTS, h, s, b)
    print_passes("te", VARIANTS + (TE_EARLIER,), h, s, b)
    print("\nKept for backward per layer (local spec), in h-wide bf16 vectors per token (saved_tensors_hooks; "
          "statistics included, parameters not; the attention and MLP internals are in every row):")
    stock = saved_vectors(VARIANTS[0], "local", h, s, b)
    print(f"  {'stock':<16} {stock:>6.2f}")
    for variant in VARIANTS[1:]:
        kept = saved_vectors(variant, "local", h, s, b)
        print(f"  {variant.name:<16} {kept:>6.2f}   {kept - stock:+.2f} over stock")
    if not args.no_time:
        print(f"\nCPU time of one local layer, forward + backward (median of 5, {torch.get_num_threads()} threads), "
              "SiameseNorm / stock (reported, no target):")
        stock_ms = cpu_ms(VARIANTS[0], h, s, b)
        print(f"  {'stock':<16} {stock_ms:>8.1f} ms")
        for variant in VARIANTS[1:]:
            ms = cpu_ms(variant, h, s, b)
            print(f"  {variant.name:<16} {ms:>8.1f} ms  {ms / stock_ms:.3f}x")


if __name__ == "__main__":
    main()
