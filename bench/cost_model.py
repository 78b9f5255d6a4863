"""SiameseNorm's extra cost per layer, on paper, checked against measurements.

    python bench/cost_model.py               # all tables (CPU, a few seconds)
    python bench/cost_model.py --gb-s 3300   # the time tables at another measured bandwidth (and 75% of it)

Per layer and micro-batch, T = s * b tokens on a rank (T / t under sequence parallelism,
T / cp with context parallelism), h = hidden size, B = bytes per activation element.

1. Memory and pipeline traffic (bf16). Activation memory kept for backward, beyond stock
  Pre-Norm. PyTorch path (torch's norm kernels keep their input and fp32 statistics): each
  sublayer keeps its packed [T, 2h] input (stock: the [T, h] residual), the InputNorm input
  a = u + PreNorm(y) ([T, h]; stock: none) and the InputNorm output ([T, h], as stock), plus
  two more norms' statistics (S bytes per token: 8 for LayerNorm, 4 for RMSNorm). Extra per
  layer: 4 T h B + 4 T S. Fused ops: dual_norm keeps only the packed input and 6 fp32
  statistics per token (a is recomputed in its backward): 2 T h B + 4 T S. The joined design
  (boundary ops) keeps the layer's packed input once for both of its ops, the first sublayer's
  output z (recomputing x' and y' from them costs less than keeping them) and 14 fp32
  statistics per token: T h B + (56 - 2 S) T. With selective "layernorm" recompute the stream
  norms' outputs are recomputed, and a layer keeps only its packed input per sublayer: 2 T S
  *less* than stock Pre-Norm without recompute, and 2 T h B more than stock with its own
  "layernorm" recompute (which keeps the [T, h] residual and drops the norm output); joined,
  T h B + (56 - 2 S) T - 2 T h B. P2P: stages exchange [T, 2h] instead of [T, h].

2. Time: the bytes the norm and residual work moves, forward + backward, per sublayer, in
  passes over a [T, h] tensor (T h B bytes), as the ops are implemented (docs/kernels.md,
  "Boundary ops"; bench/sublayer_bytes.py counts them from the code path), converted to time at
  a measured bandwidth and at 75% of it, against the layer's GEMM and attention time, for both
  designs: "apart" (a dual_norm and a dual_residual per sublayer, 20 passes; on the earlier TE
  spec, TE's LayerNormLinear normalized their output again, 25) and "joined" (the boundary ops,
  16.5 passes, the InputNorm ours on both specs). Assumptions, each a constant below: RMSNorm;
  no linear biases (as the H200 layer benches); each kernel at the given bandwidth (a floor: the
  2026-12-01 kernels ran at 20-22% of copy bandwidth forward+backward in bf16); GEMMs and
  attention at a fixed FLOP rate; the first layer's [T, h] input not modelled. FP8 rows: GEMMs at
  FP8_GEMM_FLOPS; stock's LayerNormLinear writes its normalized input in FP8 (half a pass instead
  of one); ours writes it in bf16 and TE's linear casts it (one pass read, half a pass written),
  so the joined design moves 1.5 passes more per sublayer and stock half a pass less (the
  opt-in FP8 output of our op, docs/transformer-engine.md, would take back one of them).

3. The model against the layer benches of the H200 run of 2026-12-01.

4. Memory checked at small scale (fp32, one layer, saved_tensors_hooks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "gpu" / "results" / "2026-12-01"

# H200 copy bandwidth, bench/gpu/results/2026-12-01/4-occupancy-plan.json,
# steps["kernel-bench"]["result"]["copy_gb_s"]: the median of the three calls that measured it
# (3762.3 in 1-tier1.json, 3902.2 in 3-fixes.json, 3853.2 in 4-occupancy-plan.json).
COPY_GB_S = 3853.2
GEMM_FLOPS = 700e12  # bf16 GEMM and attention rate a well-tuned run reaches on H100/H200 (H200 peak: 989e12)
BYTES = 2  # bf16 activations

# Passes over [T, h] per sublayer (docs/kernels.md, "Boundary ops"), per design; the joined design's
# ops are averaged over the layer's two sublayers (entry and boundary op once each per layer).
DESIGN_PASSES = {
    "apart": {"dual_norm": 5, "dual_residual": 5, "dual_residual_backward": 3, "dual_norm_backward": 7},
    "joined": {"entry_norm": 1.5, "residual_dual_norm": 3, "dual_residual": 2.5, "dual_residual_backward": 1.5,
               "residual_dual_norm_backward": 4.5, "entry_norm_backward": 3.5},
}
STOCK_PASSES = {"norm": 2, "residual add": 3, "norm backward": 3, "residual-gradient add": 3}
# On the earlier TE spec TE's LayerNormLinear normalized dual_norm's sum u + PreNorm(y) (forward 2,
# backward 3), as it normalizes stock's residual; today's TE spec feeds it our InputNorm's output.
EARLIER_TE_INPUT_NORM_PASSES = 5
# FP8: stock's norm writes its output in FP8 (0.5 pass instead of 1); ours is cast by TE's linear
FP8_STOCK_SAVING, FP8_CAST_PASSES = 0.5, 1.5
# fp32 statistics per row and sublayer, written and read: dual_norm 6 values; the joined design's
# entry op 6 and boundary op 8, averaged; stock (RMSNorm) rstd
DESIGN_STATS = {"apart": 24, "joined": 28}
STOCK_STATS = 4
# The weight-gradient partials [parts, rows, h] fp32, written and read back by a finalize that
# writes [rows, h]. The verified kernels: parts = min(T, 8 x 132 SMs), six rows whichever weights
# exist; the tiled kernels (and the joined design's, on their plan): one part per SM, rows for the
# weights that exist (RMSNorm: dual_norm's 3 gammas; the boundary op's 4 and the entry op's 3, averaged).
BACKWARD_CTAS, PARTIAL_ROWS = 8 * 132, 6
TILED_PARTS, TILED_PARTIAL_ROWS = 132, 3
PARTIALS = {"verified": (BACKWARD_CTAS, PARTIAL_ROWS), "tiled": (TILED_PARTS, TILED_PARTIAL_ROWS),
            "joined": (TILED_PARTS, 3.5)}
FP8_GEMM_FLOPS = 1.6 * GEMM_FLOPS  # what FP8 GEMMs reach on H100/H200 layers (well under 2x: smaller GEMMs, casts)


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


JOINED_STATS = 56  # bytes per token the joined design's two ops keep: 6 + 8 fp32


def memory_costs(shape: Shape, stats=8):
    """Extra activation bytes per layer (LayerNorm statistics) and p2p bytes per boundary, MiB."""
    t, h, mib = shape.tokens, shape.h, 2**20
    return dict(
        pytorch=(4 * t * h * BYTES + 4 * t * stats) / mib,
        fused=(2 * t * h * BYTES + 4 * t * stats) / mib,
        joined=(t * h * BYTES + (JOINED_STATS - 2 * stats) * t) / mib,
        recompute=2 * t * h * BYTES / mib,  # vs stock with its own "layernorm" recompute
        p2p_stock=t * h * BYTES / mib,
    )


def partial_bytes(tokens, h, kernels="verified"):
    """The norm backward's weight-gradient partials per sublayer: written, read back, finalized."""
    parts, rows = PARTIALS[kernels]
    return (2 * min(tokens, parts) + 1) * rows * h * 4


@dataclasses.dataclass(frozen=True)
class Design:
    """What a SiameseNorm layer moves per sublayer: its ops (``design``), on which spec, in which precision."""

    design: str  # "apart" or "joined"
    te: bool = False
    earlier_te: bool = False  # the TE spec before its InputNorm became ours (apart only)
    fp8: bool = False

    @property
    def kernels(self):
        return "joined" if self.design == "joined" else "verified"

    @property
    def label(self):
        spec = "TE-earlier" if self.earlier_te else ("TE" if self.te else "local")
        return f"{spec} {self.design}{' fp8' if self.fp8 else ''}"

    def passes(self) -> float:
        passes = sum(DESIGN_PASSES[self.design].values()) + (EARLIER_TE_INPUT_NORM_PASSES if self.earlier_te else 0)
        return passes + (FP8_CAST_PASSES if self.fp8 and not self.earlier_te else 0)


def siamese_sublayer_bytes(tokens, h, design: Design):
    stats = 2 * tokens * (DESIGN_STATS[design.design] + (STOCK_STATS if design.earlier_te else 0))
    return design.passes() * tokens * h * BYTES + stats + partial_bytes(tokens, h, design.kernels)


def stock_sublayer_bytes(tokens, h, fp8=False):
    passes = sum(STOCK_PASSES.values()) - (FP8_STOCK_SAVING if fp8 else 0)
    return passes * tokens * h * BYTES + 2 * tokens * STOCK_STATS


def matmul_flops(shape: Shape):
    """GEMMs (qkv, proj, SwiGLU fc1/fc2) and causal attention per layer and rank, forward +
    backward counted as 3x forward (flash attention's recompute in backward not counted)."""
    tokens = shape.s * shape.b
    gemm = (2 * 3 * shape.h**2 + 2 * shape.h**2 + 2 * 3 * shape.h * shape.ffn) * tokens
    attention = 4 * shape.s * shape.h * tokens / 2  # QK^T and PV, half of it under the causal mask
    return 3 * (gemm + attention) / shape.tp


def layer_ratio(shape: Shape, gb_s, design: Design):
    """(SiameseNorm's extra ms per layer, layer time ratio to stock) for ``design`` at ``gb_s``."""
    t, h = shape.tokens, shape.h
    stock = stock_sublayer_bytes(t, h, design.fp8)
    ms = lambda nbytes: 2 * nbytes / (gb_s * 1e9) * 1e3  # two sublayers a layer  # noqa: E731
    matmul = matmul_flops(shape) / (FP8_GEMM_FLOPS if design.fp8 else GEMM_FLOPS) * 1e3
    extra = ms(siamese_sublayer_bytes(t, h, design) - stock)
    return extra, 1 + extra / (matmul + ms(stock))


def layer_times_ms(shape: Shape, gb_s, kernels="verified"):
    """Per layer: matmuls, stock's norm work, SiameseNorm's extra on each spec (two sublayers), apart."""
    t, h = shape.tokens, shape.h
    stock = stock_sublayer_bytes(t, h)
    sublayer_bytes = {
        "stock_norm": stock,
        "partials": partial_bytes(t, h, kernels),
        "local": siamese_sublayer_bytes(t, h, Design("apart")) - stock,
        "te": siamese_sublayer_bytes(t, h, Design("apart", te=True, earlier_te=True)) - stock,
    }
    times = {name: 2 * nbytes / (gb_s * 1e9) * 1e3 for name, nbytes in sublayer_bytes.items()}
    return dict(times, matmul=matmul_flops(shape) / GEMM_FLOPS * 1e3)


def print_memory():
    print("1. On paper (bf16 activations, LayerNorm statistics; per layer, per micro-batch, per rank):")
    print(f"{'model':<6} {'layout':<19} {'+act MiB':>9} {'apart':>7} {'joined':>7} {'+act MiB (ln rc)':>16} "
          f"{'p2p MiB stock->siamese':>23}")
    for shape in MEMORY_SHAPES:
        c = memory_costs(shape)
        print(f"{shape.name:<6} {shape.layout():<19} {c['pytorch']:>9.1f} {c['fused']:>7.1f} {c['joined']:>7.1f} "
              f"{c['recompute']:>16.1f} {c['p2p_stock']:>10.1f} -> {2 * c['p2p_stock']:.1f}")


DESIGNS = (Design("apart"), Design("joined"), Design("apart", te=True, earlier_te=True), Design("joined", te=True),
           Design("apart", te=True, earlier_te=True, fp8=True), Design("joined", te=True, fp8=True))


def print_times(gb_s):
    print(f"\n2. Norm + residual work, forward + backward, at {gb_s:.1f} GB/s and 75% of it; GEMMs and causal "
          f"attention at {GEMM_FLOPS / 1e12:.0f} TFLOP/s bf16, {FP8_GEMM_FLOPS / 1e12:.0f} FP8 (per layer and rank).")
    print("   Passes per sublayer over [T, h]: " + ", ".join(f"{d.label} {d.passes():g}" for d in DESIGNS)
          + f"; stock {sum(STOCK_PASSES.values())} ({sum(STOCK_PASSES.values()) - FP8_STOCK_SAVING:g} in FP8).")
    print("   Ratio: (matmul + stock norm + SiameseNorm's extra) / (matmul + stock norm); statistics and "
          "weight-gradient partials included.")
    for bandwidth in (gb_s, 0.75 * gb_s):
        print(f"\n   at {bandwidth:.0f} GB/s:")
        print(f"   {'model':<6} {'layout':<17} {'h':>5}" + "".join(f"{d.label:>22}" for d in DESIGNS))
        for shape in TIME_SHAPES:
            cells = "".join(f"{layer_ratio(shape, bandwidth, d)[1]:>21.4f}x" for d in DESIGNS)
            print(f"   {shape.name:<6} {shape.layout():<17} {shape.h:>5}{cells}")


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


PATHS = {"pytorch": dict(fused_ops=False), "apart": dict(fused_ops=True, boundary_ops=False),
         "joined": dict(fused_ops=True, boundary_ops=True)}


def measured_extra_bytes(hidden, seq, batch, recompute, path):
    """Activation bytes one layer keeps for backward: SiameseNorm (``path``: the PyTorch path, the
    fused ops apart or joined; optionally with "layernorm" recompute) minus stock Pre-Norm without
    recompute (stock's own "layernorm" recompute needs Transformer Engine in megatron-core 0.16.1)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_siamese.check.step import ModelCase, case_config
    from megatron_siamese.models import scheme
    from megatron_siamese.runtime.layout import Layout

    case = ModelCase(hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=4,
                     num_query_groups=4, seq_length=seq, micro_batch_size=batch, add_bias_linear=False,
                     **PATHS[path])
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
    from sublayer_bytes import setup_single_rank  # bench/, beside this script

    setup_single_rank()
    print("\n4. Memory checked at small scale (fp32, one layer, measured with saved_tensors_hooks):")
    print(f"{'h':>5} {'s':>5} {'b':>3} {'path':>7} {'siamese rc':>10} {'measured':>10} {'predicted':>10}"
          "  (bytes, SiameseNorm minus stock without recompute)")
    for hidden, seq, batch in ((64, 32, 2), (128, 64, 2), (256, 64, 4)):
        for path in PATHS:
            for recompute in (False, True):
                measured = measured_extra_bytes(hidden, seq, batch, recompute, path)
                tokens, element, stats = seq * batch, 4, 8  # fp32 activations, LayerNorm statistics
                vector = tokens * hidden * element  # one h-wide activation
                if path == "joined":
                    predicted = vector + (JOINED_STATS - 2 * stats) * tokens - (2 * vector if recompute else 0)
                else:
                    predicted = -2 * tokens * stats if recompute else (2 if path == "apart" else 4) * vector + 4 * tokens * stats
                print(f"{hidden:>5} {seq:>5} {batch:>3} {path:>7} "
                      f"{('layernorm' if recompute else 'none'):>10} {measured:>10d} {predicted:>10d}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb-s", type=float, default=COPY_GB_S,
                        help=f"measured bandwidth for the time tables, GB/s (default {COPY_GB_S}: the H200's "
                             "copy bandwidth of 2026-12-01)")
    parser.add_argument("--no-check", action="store_true", help="skip table 4 (needs megatron-core)")
    args = parser.parse_args()
    print_memory()
    print_times(args.gb_s)
    print_measured(args.gb_s)
    if not args.no_check:
        print_memory_check()


if __name__ == "__main__":
    main()
