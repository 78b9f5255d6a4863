"""GPU validation of the Transformer Engine path (one GPU; run by bench/gpu/validate.sh).

1. TE spec vs local spec, bf16: the same weights (the local InputNorms copied into TE's fused
   LayerNorm-Linear), logits and every gradient compared with Transformer Engine's own bf16
   tolerance (rtol 1.6e-2, atol 1e-5), normwise.
2. FP8 tracks bf16: ~50 training steps of a small model on the embedded corpus with the TE
   spec, bf16 and FP8 (delayed, then tensorwise-current scaling); final losses compared.
3. Overhead at a 1.3B-like shape (h=2048, ffn 5632, 16 heads, seq 4096, mbs 1): forward +
   backward of one SiameseNorm TE layer vs one stock Pre-Norm TE layer, bf16 and FP8, side by
   side; the ratio (target <= 1.05x), plus the fused op's bandwidth at that shape.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import torch


def setup():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def relative_error(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def te_vs_local() -> bool:
    from megatron_siamese.gpt import build_gpt_chunks
    from megatron_siamese.testing.gpt_run import ModelCase, microbatches, transformer_config
    from megatron_siamese.testing.layouts import Layout
    from megatron_siamese.testing.sharding import seed_parameters

    case = ModelCase(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=8,
                     ffn_hidden_size=1024, seq_length=128, dtype="bf16", add_bias_linear=False)
    local_config = transformer_config(case, Layout())
    te_config = dataclasses.replace(local_config, transformer_impl="transformer_engine")
    (local,) = build_gpt_chunks(local_config, "siamese", case.vocab_size, case.seq_length)
    (te,) = build_gpt_chunks(te_config, "siamese", case.vocab_size, case.seq_length)
    local, te = local.cuda(), te.cuda()
    seed_parameters([local], case.seed, 0, 1, False)
    renames = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    state = {}
    for name, tensor in local.state_dict().items():
        for old, new in renames.items():
            name = name.replace(old, new)
        state[name] = tensor
    missing, unexpected = te.load_state_dict(state, strict=False)
    assert not [m for m in missing if not m.endswith("_extra_state")], missing
    batch = {k: v.cuda() for k, v in microbatches(case)[0].items()}
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    ok = True
    outputs = {}
    for label, model in (("local", local), ("te", te)):
        model.zero_grad()
        loss = model(*args, labels=batch["labels"]).float().mean()
        loss.backward()
        outputs[label] = (model(*args).detach(), {n: p.grad for n, p in model.named_parameters()})
    print(f"logits: relative error {relative_error(outputs['te'][0], outputs['local'][0]):.2e}")
    for name, grad in outputs["local"][1].items():
        te_name = name
        for old, new in renames.items():
            te_name = te_name.replace(old, new)
        error = relative_error(outputs["te"][1][te_name], grad)
        ok &= error <= 1.6e-2
        if error > 1.6e-2:
            print(f"  FAIL {name}: {error:.2e}")
    print(f"TE vs local (bf16, TE tolerance rtol 1.6e-2): {'PASS' if ok else 'FAIL'}")
    return ok


def fp8_tracks_bf16() -> bool:
    from megatron_siamese.training.trainer import TrainArgs, train

    base = TrainArgs(tp=1, transformer_impl="transformer_engine", dtype="bf16", num_layers=4, hidden_size=256,
                     num_attention_heads=8, seq_length=256, micro_batch_size=8, global_batch_size=32, steps=50,
                     warmup_steps=5, eval_interval=25, eval_iters=4, progress=False, output_dir="/tmp/fp8check")
    runs = {"bf16": train(base),
            "fp8 delayed": train(dataclasses.replace(base, fp8="hybrid", fp8_recipe="delayed")),
            "fp8 tensorwise": train(dataclasses.replace(base, fp8="hybrid", fp8_recipe="tensorwise"))}
    reference = runs["bf16"].val_losses[50]
    ok = True
    for label, summary in runs.items():
        gap = abs(summary.val_losses[50] - reference) / reference
        ok &= gap < 0.03
        print(f"{label:>15}: val loss {summary.val_losses[50]:.4f} ({100 * gap:.1f}% from bf16)")
    print(f"FP8 tracks bf16 within 3%: {'PASS' if ok else 'FAIL'}")
    return ok


def time_layer(layer, hidden_states, fp8_recipe=None, iters=20):
    from megatron.core.fp8_utils import get_fp8_context

    mask = None
    context = get_fp8_context(layer.config, layer.layer_number - 1) if fp8_recipe else torch.enable_grad()
    times = []
    grad = None
    for i in range(iters + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with context:
            out, _ = layer(hidden_states=hidden_states, attention_mask=mask)
        grad = torch.ones_like(out) if grad is None else grad
        out.backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def overhead() -> bool:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from megatron_siamese.config import SiameseTransformerConfig
    from megatron_siamese.specs import get_siamese_layer_te_spec

    ok = True
    for fp8 in (None, "hybrid"):
        config = SiameseTransformerConfig(
            num_layers=2, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
            normalization="RMSNorm", bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0,
            attention_dropout=0.0, fp8=fp8, fp8_recipe="delayed", transformer_impl="transformer_engine")
        stock_spec = get_gpt_layer_with_transformer_engine_spec()
        stock_spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.causal
        stock = build_module(stock_spec, config=config, layer_number=2).cuda()
        siamese = build_module(get_siamese_layer_te_spec(), config=config, layer_number=2).cuda()
        s, h = 4096, 2048
        x_stock = torch.randn(s, 1, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        x_siamese = torch.randn(s, 1, 2 * h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        t_stock = time_layer(stock, x_stock, fp8)
        t_siamese = time_layer(siamese, x_siamese, fp8)
        ratio = t_siamese / t_stock
        ok &= ratio <= 1.05
        print(f"{'FP8' if fp8 else 'bf16'} layer fwd+bwd: stock {t_stock:.2f} ms, SiameseNorm {t_siamese:.2f} ms, "
              f"ratio {ratio:.3f} (target <= 1.05) sublayer path {type(siamese.sublayer).__name__}")
    return ok


def main() -> int:
    from megatron_siamese.specs import transformer_engine_error

    if not torch.cuda.is_available():
        print("needs a GPU")
        return 2
    if transformer_engine_error():
        print(f"Transformer Engine checks skipped: {transformer_engine_error()}")
        return 2
    setup()
    results = {"te_vs_local": te_vs_local(), "overhead": overhead()}
    results["fp8_tracks_bf16"] = fp8_tracks_bf16()
    print({k: "PASS" if v else "FAIL" for k, v in results.items()})
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
