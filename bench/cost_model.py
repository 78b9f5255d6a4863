"""SiameseNorm's extra cost per layer, on paper, checked against measurements.

    python bench/cost_model.py               # all four tables (CPU, a few seconds)
    python bench/cost_model.py --gb-s 3300   # the time tables at another measured bandwidth

Per layer and micro-batch, T = s * b tokens on a rank (T / t under sequence parallelism,
T / cp with context parallelism), h = hidden size, B = bytes per activation element.

1. Memory and pipeline traffic (bf16). Activation memory kept for backward, beyond stock
  Pre-Norm. PyTorch path (torch's norm kernels keep their input and fp32 statistics): each
  sublayer keeps its packed [T, 2h] input (stock: the [T, h] residual), the InputNorm input
  a = u + PreNorm(y) ([T, h]; stock: none) and the InputNorm output ([T, h], as stock), plus
  two more norms' statistics (S bytes per token: 8 for LayerNorm, 4 for RMSNorm). Extra per
  layer: 4 T h B + 4 T S. Fused ops: dual_norm keeps only the packed input and 6 fp32
  statistics per token (a is recomputed in its backward): 2 T h B + 4 T S. With selective
  "layernorm" recompute the stream norms' outputs are recomputed, and a layer keeps only its
  packed input per sublayer: 2 T S *less* than stock Pre-Norm without recompute, and 2 T h B
  more than stock with its own "layernorm" recompute (which keeps the [T, h] residual and drops
  the norm output). P2P: stages exchange [T, 2h] instead of [T, h].

2. Time: the bytes the norm and residual work moves, forward + backward, per sublayer, in
  passes over a [T, h] tensor (T h B bytes), as the ops are implemented (docs/kernels.md,
  "Byte floor"), converted to time at a measured bandwidth, against the layer's GEMM and
  attention time. Assumptions, each a constant below: bf16 activations (FP8 GEMMs change the
  denominator, not these bytes); RMSNorm; no linear biases (as the H200 layer benches; with a
  bias, dual_residual_backward also makes an fp32 copy of grad out); each kernel at the given
  bandwidth (a floor: the 2026-12-01 kernels ran at 20-22% of copy bandwidth forward+backward
  in bf16); GEMMs and attention at a fixed FLOP rate; the first layer's [T, h] input not
  modelled.

3. The model against the layer benches of the H200 run of 2026-12-01.

4. Memory checked at small scale (fp32, one layer, saved_tensors_hooks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "gpu" / "results" / "2026-12-01"

# H200 copy bandwidth, bench/gpu/results/2026-12-01/4-occupancy-plan.json,
# steps["kernel-bench"]["result"]["copy_gb_s"]: the median of the three calls that measured it
# (3762.3 in 1-tier1.json, 3902.2 in 3-fixes.json, 3853.2 in 4-occupancy-plan.json).
COPY_GB_S = 3853.2
GEMM_FLOPS = 700e12  # bf16 GEMM and attention rate a well-tuned run reaches on H100/H200 (H200 peak: 989e12)
BYTES = 2  # bf16 activations

# Passes over [T, h] per sublayer (docs/kernels.md, "Byte floor").
SIAMESE_PASSES = {"dual_norm": 5, "dual_residual": 5, "dual_residual_backward": 3, "dual_norm_backward": 7}
STOCK_PASSES = {"norm": 2, "residual add": 3, "norm backward": 3, "residual-gradient add": 3}
# On the TE spec TE's LayerNormLinear normalizes dual_norm's sum u + PreNorm(y) (forward 2,
# backward 3), as it normalizes stock's residual; on the local spec dual_norm does it inside.
TE_INPUT_NORM_PASSES = 5
SIAMESE_STATS, STOCK_STATS = 24, 4  # fp32 statistics per row (dual_norm: 6; RMSNorm: rstd), written and read
# dual_norm_backward's fp32 weight-gradient partials [CTAs, 6, h] (six rows whichever weights
# exist), written and read back by the finalize, which writes [6, h]: CTAs = min(T, 8 x 132 SMs).
BACKWARD_CTAS, PARTIAL_ROWS = 8 * 132, 6
# The tiled kernels (MEGATRON_SIAMESE_CUDA_KERNELS=tiled): one partial per row group of the
# persistent grid (one per SM at these widths: the backward's plan, tests/test_launch_plan.py),
# rows only for the weights that exist (RMSNorm with an input norm: 3).
TILED_PARTS, TILED_PARTIAL_ROWS = 132, 3
PARTIALS = {"verified": (BACKWARD_CTAS, PARTIAL_ROWS), "tiled": (TILED_PARTS, TILED_PARTIAL_ROWS)}


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    h: int
    ffn: int
    s: int
    b: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False

    @property
    def tokens(self):  # per rank: SP splits the sequence, otherwise the norms run replicated
        return self.s * self.b // (self.tp if self.sp else 1)

    def layout(self):
        return f"s{self.s} b{self.b} tp{self.tp}{' pp' + str(self.pp) if self.pp > 1 else ''}{' sp' if self.sp else ''}"


MEMORY_SHAPES = (
    Shape("1.3B", 2048, 5632, 2048, b=4),
    Shape("7B", 4096, 11008, 4096, tp=2, sp=True),
    Shape("70B", 8192, 28672, 4096, tp=8, pp=4, sp=True),
)
TIME_SHAPES = (
    Shape("1.3B", 2048, 5632, 2048),
    Shape("1.3B", 2048, 5632, 2048, b=4),
    Shape("1.3B", 2048, 5632, 4096),  # the H200 layer benches' h 2048 shape
    Shape("7B", 4096, 11008, 4096),  # the H200 local layer bench's h 4096 shape
    Shape("7B", 4096, 11008, 4096, tp=2, sp=True),
    Shape("70B", 8192, 28672, 4096, tp=8, sp=True),
)


def memory_costs(shape: Shape, stats=8):
    """Extra activation bytes per layer (LayerNorm statistics) and p2p bytes per boundary, MiB."""
    t, h, mib = shape.tokens, shape.h, 2**20
    return dict(
        pytorch=(4 * t * h * BYTES + 4 * t * stats) / mib,
        fused=(2 * t * h * BYTES + 4 * t * stats) / mib,
        recompute=2 * t * h * BYTES / mib,  # vs stock with its own "layernorm" recompute
        p2p_stock=t * h * BYTES / mib,
    )


def partial_bytes(tokens, h, kernels="verified"):
    """dual_norm_backward's weight-gradient partials: written, read back, finalized."""
    parts, rows = PARTIALS[kernels]
    return (2 * min(tokens, parts) + 1) * rows * h * 4


def siamese_sublayer_bytes(tokens, h, te, kernels="verified"):
    passes = sum(SIAMESE_PASSES.values()) + (TE_INPUT_NORM_PASSES if te else 0)
    stats = 2 * tokens * (SIAMESE_STATS + (STOCK_STATS if te else 0))
    return passes * tokens * h * BYTES + stats + partial_bytes(tokens, h, kernels)


def stock_sublayer_bytes(tokens, h):
    return sum(STOCK_PASSES.values()) * tokens * h * BYTES + 2 * tokens * STOCK_STATS


def matmul_flops(shape: Shape):
    """GEMMs (qkv, proj, SwiGLU fc1/fc2) and causal attention per layer and rank, forward +
    backward counted as 3x forward (flash attention's recompute in backward not counted)."""
    tokens = shape.s * shape.b
    gemm = (2 * 3 * shape.h**2 + 2 * shape.h**2 + 2 * 3 * shape.h * shape.ffn) * tokens
    attention = 4 * shape.s * shape.h * tokens / 2  # QK^T and PV, half of it under the causal mask
    return 3 * (gemm + attention) / shape.tp


def layer_times_ms(shape: Shape, gb_s, kernels="verified"):
    """Per layer: matmuls, stock's norm work, SiameseNorm's extra on each spec (two sublayers)."""
    t, h = shape.tokens, shape.h
    stock = stock_sublayer_bytes(t, h)
    sublayer_bytes = {
        "stock_norm": stock,
        "partials": partial_bytes(t, h, kernels),
        "local": siamese_sublayer_bytes(t, h, te=False, kernels=kernels) - stock,
        "te": siamese_sublayer_bytes(t, h, te=True, kernels=kernels) - stock,
    }
    times = {name: 2 * nbytes / (gb_s * 1e9) * 1e3 for name, nbytes in sublayer_bytes.items()}
    return dict(times, matmul=matmul_flops(shape) / GEMM_FLOPS * 1e3)


def print_memory():
    print("1. On paper (bf16 activations, LayerNorm statistics; per layer, per micro-batch, per rank):")
    print(f"{'model':<6} {'layout':<19} {'+act MiB':>9} {'fused':>7} {'+act MiB (ln rc)':>16} "
          f"{'p2p MiB stock->siamese':>23}")
    for shape in MEMORY_SHAPES:
        c = memory_costs(shape)
        print(f"{shape.name:<6} {shape.layout():<19} {c['pytorch']:>9.1f} {c['fused']:>7.1f} "
              f"{c['recompute']:>16.1f} {c['p2p_stock']:>10.1f} -> {2 * c['p2p_stock']:.1f}")


def print_times(gb_s, kernels="verified"):
    print(f"\n2. Norm + residual work, forward + backward, bf16, bytes at {gb_s:.1f} GB/s; GEMMs and causal "
          f"attention at {GEMM_FLOPS / 1e12:.0f} TFLOP/s (per layer and rank).")
    print(f"   Per sublayer, passes over [T, h]: SiameseNorm {sum(SIAMESE_PASSES.values())} "
          f"(+{TE_INPUT_NORM_PASSES} on the TE spec), stock {sum(STOCK_PASSES.values())}; statistics "
          f"{SIAMESE_STATS} vs {STOCK_STATS} bytes a row;\n   SiameseNorm's fp32 partials "
          f"[min(T, {PARTIALS[kernels][0]}), {PARTIALS[kernels][1]}, h] ({kernels} kernels). "
          f"Ratio: (matmul + stock norm + extra) / (matmul + stock norm).")
    print(f"{'model':<6} {'layout':<17} {'T/rank':>6} {'h':>5} {'ffn':>6} {'matmul ms':>9} {'stock norm ms':>13} "
          f"{'extra ms local':>14} {'of it partials':>14} {'ratio':>6} {'extra ms TE':>11} {'ratio':>6}")
    for shape in TIME_SHAPES:
        c = layer_times_ms(shape, gb_s, kernels)
        base = c["matmul"] + c["stock_norm"]
        print(f"{shape.name:<6} {shape.layout():<17} {shape.tokens:>6} {shape.h:>5} {shape.ffn:>6} "
              f"{c['matmul']:>9.3f} {c['stock_norm']:>13.3f} {c['local']:>14.3f} {c['partials']:>14.3f} "
              f"{1 + c['local'] / base:>5.3f}x {c['te']:>11.3f} {1 + c['te'] / base:>5.3f}x")


def measured_layer_rows():
    """(call, spec, precision, shape, stock ms, SiameseNorm fused ms) of the 2026-12-01 layer benches."""
    for path in sorted(RESULTS.glob("*.json")):
        steps = json.loads(path.read_text())["steps"]
        for step in ("layer-bench", "te-layer-bench"):
            for row in steps.get(step, {}).get("result", {}).get("rows", []):
                shape = Shape("", row["hidden"], row["ffn"], row["seq"])
                spec = "TE" if row["impl"] == "transformer_engine" else "local"
                yield path.stem, spec, row["precision"], shape, row["stock"]["ms"], row["siamese_fused"]["ms"]


def print_measured(gb_s):
    print(f"\n3. Against the H200 layer benches (bench/gpu/results/2026-12-01/*.json: one layer forward + backward,\n"
          f"   seq 4096, micro-batch 1, RMSNorm, no biases, SiameseNorm with the fused ops); model at {gb_s:.1f} GB/s:")
    print(f"{'call':<18} {'spec':<5} {'precision':<11} {'h':>5} {'stock ms':>8} {'siamese ms':>10} {'ratio':>6} "
          f"{'extra ms':>8} {'model extra ms':>14} {'measured/model':>14}")
    for call, spec, precision, shape, stock, siamese in measured_layer_rows():
        model = layer_times_ms(shape, gb_s)["te" if spec == "TE" else "local"]
        print(f"{call:<18} {spec:<5} {precision:<11} {shape.h:>5} {stock:>8.3f} {siamese:>10.3f} "
              f"{siamese / stock:>5.3f}x {siamese - stock:>8.3f} {model:>14.3f} {(siamese - stock) / model:>14.1f}")


def measured_extra_bytes(hidden, seq, batch, recompute, fused):
    """Activation bytes one layer keeps for backward: SiameseNorm (fused ops or PyTorch path,
    optionally with "layernorm" recompute) minus stock Pre-Norm without recompute (stock's own
    "layernorm" recompute needs Transformer Engine in megatron-core 0.16.1)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_siamese.check.step import ModelCase, case_config
    from megatron_siamese.models import scheme
    from megatron_siamese.runtime.layout import Layout

    case = ModelCase(hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=4,
                     num_query_groups=4, seq_length=seq, micro_batch_size=batch, add_bias_linear=False,
                     fused_ops=fused)
    plain = case_config(case, Layout())
    configs = {
        "siamese": dataclasses.replace(
            plain, recompute_granularity="selective", recompute_modules=["layernorm"]
        ) if recompute else plain,
        "pre": plain,
    }
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    kept = {}
    for norm, width in (("siamese", 2 * hidden), ("pre", hidden)):
        config = configs[norm]
        spec = scheme(norm).block_spec(config).layer_specs[0]
        layer = build_module(spec, config=config, layer_number=2)
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        saved = []
        hidden_states = torch.randn(seq, batch, width, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            output, _ = layer(hidden_states=hidden_states, attention_mask=mask)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        kept[norm] = sum(n for ptr, n in storages.items() if ptr not in params)
        output.sum().backward()
    return kept["siamese"] - kept["pre"]


def print_memory_check():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_siamese.runtime import cpu_shim
    from megatron_siamese.runtime.launch import free_port

    cpu_shim.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    print("\n4. Memory checked at small scale (fp32, one layer, measured with saved_tensors_hooks):")
    print(f"{'h':>5} {'s':>5} {'b':>3} {'path':>7} {'siamese rc':>10} {'measured':>10} {'predicted':>10}"
          "  (bytes, SiameseNorm minus stock without recompute)")
    for hidden, seq, batch in ((64, 32, 2), (128, 64, 2), (256, 64, 4)):
        for fused in (False, True):
            for recompute in (False, True):
                measured = measured_extra_bytes(hidden, seq, batch, recompute, fused)
                tokens, element, stats = seq * batch, 4, 8  # fp32 activations, LayerNorm statistics
                kept_streams = (2 if fused else 4) * tokens * hidden * element
                predicted = -2 * tokens * stats if recompute else kept_streams + 4 * tokens * stats
                print(f"{hidden:>5} {seq:>5} {batch:>3} {('fused' if fused else 'pytorch'):>7} "
                      f"{('layernorm' if recompute else 'none'):>10} {measured:>10d} {predicted:>10d}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb-s", type=float, default=COPY_GB_S,
                        help=f"measured bandwidth for the time tables, GB/s (default {COPY_GB_S}: the H200's "
                             "copy bandwidth of 2026-12-01)")
    parser.add_argument("--kernels", choices=sorted(PARTIALS), default="verified",
                        help="whose weight-gradient partials table 2 counts (default verified: today's CUDA default)")
    parser.add_argument("--no-check", action="store_true", help="skip table 4 (needs megatron-core)")
    args = parser.parse_args()
    print_memory()
    print_times(args.gb_s, args.kernels)
    print_measured(args.gb_s)
    if not args.no_check:
        print_memory_check()


if __name__ == "__main__":
    main()
