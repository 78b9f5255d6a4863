"""Tier 2: the Transformer Engine SiameseNorm GPT computes what the local one computes (bf16).

    te-vs-local   one small GPT built twice, with Megatron's local modules and with Transformer
                  Engine's, the same weights under the same names (the TE spec keeps the
                  InputNorms as modules of their own, feeding TE's plain linears; only its
                  checkpoint keys take the fused LayerNorm-Linear's names); logits
                  and every parameter's gradient compared normwise, max |te - local| / max |local|.
                  Passed when each is within Transformer Engine's bf16 tolerance (rtol 1.6e-2)
                  or, where bf16 rounding alone exceeds that, when TE's error against the same
                  model in fp32 is at most twice the local bf16 model's (the rule the kernel
                  tests use): a wrong weight mapping or formula gives errors of order one.
                  Twice: the standard variant (the record's top level) and the hybrid variant
                  (``hybrid``: no attention InputNorm, TE's plain linear_qkv, c1 * x, QK-norm;
                  first run on a GPU here). Passed when both pass.

    python bench/gpu/te_parity.py te-vs-local --result out.json [--rehearse]
"""

from __future__ import annotations

import dataclasses
import sys

from common import NeedsGPU, one_rank, require_gpu, step_main

BF16_RTOL = 1.6e-2  # Transformer Engine's (and torch.testing's) bf16 tolerance


def relative_error(value, reference) -> float:
    if value is None or reference is None:  # a parameter that got no gradient in one model
        return float("inf") if (value is None) != (reference is None) else 0.0
    value, reference = value.float(), reference.float()
    return float((value - reference).abs().max() / reference.abs().max().clamp_min(1e-12))


def compare(case, rehearse: bool) -> dict:
    """Runs in a rank: both models, same weights, logits and gradients side by side."""
    import torch

    from megatron_siamese.check.step import build_seeded_chunks, case_config, microbatches
    from megatron_siamese.models import build_gpt_chunks
    from megatron_siamese.runtime.layout import Layout

    device = "cuda" if torch.cuda.is_available() else "cpu"
    (local,) = build_seeded_chunks(case, case_config(case, Layout()))
    state = local.state_dict()
    te_case = dataclasses.replace(case, transformer_impl="transformer_engine")
    te_config = case_config(te_case, Layout())
    require_gpu(rehearse, "building the Transformer Engine GPT (TE's modules assert CUDA when constructed)")
    (te,) = build_gpt_chunks(te_config, te_case.norm, te_case.vocab_size, te_case.seq_length,
                             te_case.position_embedding_type, te_case.share_embeddings_and_output_weights)
    missing, unexpected = te.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.endswith("_extra_state")]
    if missing or unexpected:
        raise AssertionError(f"local -> TE weights: missing {missing}, unexpected {unexpected}")
    local, te = local.to(device), te.to(device)
    batch = {k: v.to(device) for k, v in microbatches(case)[0].items()}
    inputs = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    fp32_case = dataclasses.replace(case, dtype="fp32")
    (exact,) = build_seeded_chunks(fp32_case, case_config(fp32_case, Layout()))
    exact.load_state_dict(local.state_dict())  # the bf16 weights, held in fp32
    exact = exact.to(device)
    results = {}
    for label, model in (("local", local), ("te", te), ("fp32", exact)):
        model.zero_grad()
        model(*inputs, labels=batch["labels"]).float().mean().backward()
        with torch.no_grad():
            logits = model(*inputs)
        results[label] = (logits, {name: p.grad for name, p in model.named_parameters()})
    def errors_against(reference: str, model: str) -> dict:
        found = {"logits": relative_error(results[model][0], results[reference][0])}
        for name, grad in results[reference][1].items():
            found[f"grad {name}"] = relative_error(results[model][1][name], grad)
        return found

    errors = errors_against("local", "te")
    te_vs_fp32, local_vs_fp32 = errors_against("fp32", "te"), errors_against("fp32", "local")
    over = sorted(k for k, v in errors.items() if v > BF16_RTOL)
    unexplained = [k for k in over if te_vs_fp32[k] > 2 * local_vs_fp32[k]]
    worst = max(errors, key=errors.get)
    return {
        "logits_error": round(errors["logits"], 5),
        "max_grad_error": round(max(v for k, v in errors.items() if k != "logits"), 5),
        "worst": worst,
        "over_tolerance": {k: {"te_vs_local": round(errors[k], 5), "te_vs_fp32": round(te_vs_fp32[k], 5),
                               "local_vs_fp32": round(local_vs_fp32[k], 5)} for k in over},
        "unexplained_by_bf16": unexplained,
        "tolerance": BF16_RTOL,
        "compared": len(errors),
        "passed": not unexplained,
    }


def te_vs_local(rehearse: bool) -> dict:
    from megatron_siamese.check.case import ModelCase

    if not rehearse:
        require_gpu(False, "TE vs local")
    case = ModelCase(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=1024,
                     seq_length=128, vocab_size=256, dtype="bf16", add_bias_linear=False, num_microbatches=1)
    records, stops = {}, []
    for variant, norm in (("standard", "siamese"), ("hybrid", "siamese-hybrid")):
        try:
            records[variant] = one_rank(compare, dataclasses.replace(case, norm=norm), rehearse)
        except NeedsGPU as stop:  # a rehearsal: both variants' local models are built first
            stops.append(f"{variant}: {stop}")
    if stops:
        raise NeedsGPU("; ".join(stops))
    return dict(records["standard"], hybrid=records["hybrid"],
                passed=records["standard"]["passed"] and records["hybrid"]["passed"])


STEPS = {"te-vs-local": te_vs_local}

if __name__ == "__main__":
    sys.exit(step_main(STEPS))
