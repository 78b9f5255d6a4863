"""SiameseNorm's extra cost at scale, on paper, checked against measurements at small scale.

    python bench/cost_model.py            # prints both tables (CPU, a few seconds)

Per layer and micro-batch, T = s * b tokens on a rank (T / t under sequence parallelism,
T / cp with context parallelism), h = hidden size, B = bytes per activation element.

Activation memory kept for backward, beyond stock Pre-Norm. PyTorch path (torch's norm
  kernels keep their input and fp32 statistics): each sublayer keeps its packed [T, 2h]
  input (stock: the [T, h] residual), the InputNorm input a = u + PreNorm(y) ([T, h];
  stock: none) and the InputNorm output ([T, h], as stock), plus two more norms'
  statistics (S bytes per token: 8 for LayerNorm, 4 for RMSNorm). Extra per layer:
  4 T h B + 4 T S. Fused ops: dual_norm keeps only the packed input and 6 fp32 statistics
  per token (a is recomputed in its backward): 2 T h B + 4 T S. With selective "layernorm" recompute the stream norms' outputs are
  recomputed, and a layer keeps only its packed input per sublayer: 2 T S *less* than stock
  Pre-Norm without recompute, and 2 T h B more than stock with its own "layernorm" recompute
  (which keeps the [T, h] residual and drops the norm output).
P2P: stages exchange [T, 2h] instead of [T, h]: twice the bytes forward and backward.
Norm work: 3 norms per sublayer instead of 1, plus the merge at the end; memory-bound
  element-wise passes over [T, h] per sublayer: stock ~5 (norm read/write, residual add),
  SiameseNorm ~17 unfused, ~8 fused (docs/kernels.md). Compared with the GEMMs'
  24 T h^2 (+ 4 T s h attention) FLOPs per layer.
"""

from __future__ import annotations

import dataclasses
import os

import torch

H100_BF16_FLOPS = 700e12  # dense bf16 GEMM throughput a well-tuned run reaches on H100/H200
HBM_BYTES_PER_S = 3.0e12  # achievable HBM bandwidth for element-wise kernels

CONFIGS = {  # name: (layers, hidden, ffn, seq, micro_batch, tp, pp, sp)
    "1.3B": (24, 2048, 8192, 2048, 4, 1, 1, False),
    "7B": (32, 4096, 11008, 4096, 1, 2, 1, True),
    "70B": (80, 8192, 28672, 4096, 1, 8, 4, True),
}


def paper_costs(layers, h, ffn, s, b, tp, pp, sp, bytes_per_element=2):
    tokens = s * b / (tp if sp else 1)
    extra_memory = 4 * tokens * h * bytes_per_element + 4 * tokens * 8
    extra_memory_fused = 2 * tokens * h * bytes_per_element + 4 * tokens * 8
    extra_memory_recompute = 2 * tokens * h * bytes_per_element  # vs stock with its recompute
    p2p_stock = s * b * h * bytes_per_element / (tp if sp else 1)
    gemm_flops = (2 * 3 * h * h + 2 * h * h + 2 * 3 * h * ffn) * s * b / tp  # qkv, proj, swiglu fc1/fc2
    gemm_seconds = gemm_flops / H100_BF16_FLOPS
    passes = {"stock": 5, "unfused": 17, "fused": 8}
    elementwise = {k: 2 * v * tokens * h * bytes_per_element / HBM_BYTES_PER_S for k, v in passes.items()}
    return dict(
        extra_memory_mib=extra_memory / 2**20,
        extra_memory_fused_mib=extra_memory_fused / 2**20,
        extra_memory_recompute_mib=extra_memory_recompute / 2**20,
        p2p_stock_mib=p2p_stock / 2**20,
        p2p_siamese_mib=2 * p2p_stock / 2**20,
        overhead_unfused=(elementwise["unfused"] - elementwise["stock"]) / (gemm_seconds + elementwise["stock"]),
        overhead_fused=(elementwise["fused"] - elementwise["stock"]) / (gemm_seconds + elementwise["stock"]),
    )


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


def main():
    print("On paper (bf16 activations; per layer, per micro-batch, per rank):")
    print(f"{'model':<6} {'layout':<14} {'+act MiB':>9} {'fused':>7} {'+act MiB (ln rc)':>16} "
          f"{'p2p MiB stock->siamese':>23} {'norm overhead unfused':>22} {'fused':>7}")
    for name, (layers, h, ffn, s, b, tp, pp, sp) in CONFIGS.items():
        c = paper_costs(layers, h, ffn, s, b, tp, pp, sp)
        layout = f"tp{tp} pp{pp}{' sp' if sp else ''} s{s}"
        print(f"{name:<6} {layout:<14} {c['extra_memory_mib']:>9.1f} {c['extra_memory_fused_mib']:>7.1f} "
              f"{c['extra_memory_recompute_mib']:>16.1f} "
              f"{c['p2p_stock_mib']:>10.1f} -> {c['p2p_siamese_mib']:<9.1f} "
              f"{100 * c['overhead_unfused']:>21.1f}% {100 * c['overhead_fused']:>6.1f}%")

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_siamese.runtime import cpu_shim
    from megatron_siamese.runtime.launch import free_port

    cpu_shim.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    print("\nChecked at small scale (fp32, one layer, measured with saved_tensors_hooks):")
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


if __name__ == "__main__":
    main()
