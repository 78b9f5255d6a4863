"""Tier 2: a whole 1.3B-class GPT, SiameseNorm against stock Pre-Norm, one training step on one GPU.

    model-bench   24 layers, h 2048, 16 heads, SwiGLU ffn 5632, RoPE, seq 2048, micro-batch 4,
                  vocab 50304, on Transformer Engine; the step of Megatron's schedule
                  (runtime.gpt.MegatronGPT: forward_backward_func + the optimizer's step) in
                  bf16, FP8 delayed and FP8 current (tensorwise) scaling, and with selective
                  recompute of the layernorm modules; target: step time <= 1.03x stock; peak
                  memory (torch.cuda.max_memory_allocated) reported as a ratio

A row is one (precision, recompute): the stock model is built, warmed up and timed REPEATS
times; then the SiameseNorm model (fused ops, a dual_norm and a dual_residual per sublayer),
timed with the verified and the tiled CUDA kernels in turn, REPEATS times over; then the
SiameseNorm model with its sublayers joined by the boundary ops (``siamese_joined``,
``siamese_boundary_ops=True``); each time the median of ITERS CUDA-event-timed steps.
Peak memory per variant is the largest of its timed steps' peaks (weights, gradients and
optimizer state included: they are allocated by then). The bf16 rows also carry
``megatron-siamese plan``'s prediction for the same shape (``plan``: per variant its weights,
gradients, optimizer state, activations and total, MiB; stock, joined and apart as the plan names
them) and each variant's ``peak_over_plan``: the plan's GPU rows beside a measured peak (the plan
does not model FP8, so the FP8 rows have none). Rows are shaped like the layer benches':
{precision, recompute, stock: {ms, ms_repeats, peak_mib}, siamese_fused: {..., ratio_to_stock,
memory_ratio_to_stock, kernels}, siamese_fused_tiled: {...}, siamese_joined: {...}}.

The stock baseline is Megatron's own TE GPT block (get_gpt_decoder_block_spec): the package's
"pre" scheme is the local-module baseline, so this step registers it as scheme "pre-te" in
its own rank. Megatron refuses FP8 delayed scaling with layernorm recompute, so recompute
rows are bf16 and FP8 tensorwise.

The rehearsal runs the same code at a tiny size with the local modules on CPU (bf16, both
recompute settings), then validates the TE / FP8 configs and stops where TE modules are built.

    python bench/gpu/model_bench.py model-bench --result out.json [--rehearse]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from common import (PRECISIONS, NeedsGPU, cuda_kernels, one_rank, repeated, require_gpu, seconds_left, step_main,
                    time_ms)

ITERS, WARMUP, REPEATS = 20, 4, 2
ROW_MARGIN_S = 60  # one row: three 1.3B builds and ~200 steps
SEED = 1234
OPTIMIZER = dict(lr=1e-4, min_lr=1e-5, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0)
RECOMPUTE = {"none": {}, "layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"])}
# (precision, recompute), most important first (the deadline cuts from the end)
ROWS = (("bf16", "none"), ("fp8-delayed", "none"), ("fp8-tensorwise", "none"), ("bf16", "layernorm"),
        ("fp8-tensorwise", "layernorm"))
REHEARSAL_ROWS = (("bf16", "none"), ("bf16", "layernorm"))
STOCK_TE = "pre-te"
# the plan's name for the variant each label times (apart: the sublayers' own dual_norm / dual_residual)
PLAN_VARIANT = {"stock": "stock", "siamese_fused": "apart", "siamese_fused_tiled": "apart", "siamese_joined": "joined"}
# what the runtime these rows build on (runtime/gpt.py) leaves off that Megatron-LM, and so the plan, has on
RUNTIME_AS_PLAN_FLAGS = ("--hidden-dropout", 0, "--attention-dropout", 0, "--no-bias-swiglu-fusion",
                         "--no-masked-softmax-fusion", "--no-rope-fusion")
PLAN_RECOMPUTE = {"none": [], "layernorm": ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"]}
PLAN_TERMS = ("weights", "grads", "optimizer", "activations", "memory")


@dataclass(frozen=True)
class Size:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    micro_batch: int
    vocab: int


MODEL = Size(24, 2048, 16, 5632, 2048, micro_batch=4, vocab=50304)  # ~1.34B weights, tied embedding
REHEARSAL_MODEL = Size(2, 64, 4, 128, 32, micro_batch=2, vocab=256)


@dataclass(frozen=True)
class Variant:
    norm: str
    kernels: tuple = (None,)  # the CUDA kernel generations it is timed with, and their labels
    labels: tuple = ("stock",)
    boundary_ops: bool = False  # the boundary ops join each layer's sublayers (opt-in on CUDA)


STOCK_VARIANT = Variant("pre")
SIAMESE_VARIANT = Variant("siamese", ("verified", "tiled"), ("siamese_fused", "siamese_fused_tiled"))
SIAMESE_JOINED_VARIANT = Variant("siamese", ("verified",), ("siamese_joined",), boundary_ops=True)
SIAMESE_VARIANTS = (SIAMESE_VARIANT, SIAMESE_JOINED_VARIANT)


def settings(size: Size, norm: str, impl: str, precision: str, boundary_ops: bool = False):
    from megatron_siamese.runtime.settings import ModelSettings

    siamese = norm == "siamese"
    return ModelSettings(norm=norm, num_layers=size.num_layers, hidden_size=size.hidden_size,
                         num_attention_heads=size.num_attention_heads, ffn_hidden_size=size.ffn_hidden_size,
                         seq_length=size.seq_length, normalization="RMSNorm", gated_linear_unit=True,
                         position_embedding_type="rope", add_bias_linear=False, dtype="bf16",
                         fused_ops=True if siamese else None, boundary_ops=boundary_ops if siamese else None,
                         transformer_impl=impl, **PRECISIONS[precision])


def register_stock_te_scheme() -> None:
    """Megatron's stock Pre-Norm GPT block on Transformer Engine, as scheme "pre-te" of
    megatron_siamese.models (this process only)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_siamese import models

    models.SCHEMES.setdefault(STOCK_TE, models.Scheme(
        lambda config, vp_stage=None: get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                                                 vp_stage=vp_stage)))


def synthetic_batch(size: Size, device: str) -> dict:
    """One microbatch of random tokens in Megatron's forward-step format, on ``device``."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, size.vocab, (size.micro_batch, size.seq_length + 1), generator=generator)
    batch = dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                 position_ids=torch.arange(size.seq_length).expand(size.micro_batch, -1).contiguous(),
                 attention_mask=torch.ones(size.seq_length, size.seq_length, dtype=torch.bool).triu(1)[None, None],
                 loss_mask=torch.ones(size.micro_batch, size.seq_length))
    return {k: v.to(device) for k, v in batch.items()}


def peak_mib() -> Optional[float]:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None


def measure_model(model, variant: Variant, size: Size, recompute: str, rehearse: bool) -> dict:
    """{label: {ms_repeats, peak_mib}} of one model: built, warmed up, timed per generation."""
    import gc

    import torch

    from megatron_siamese.runtime.gpt import MegatronGPT
    from megatron_siamese.runtime.layout import Layout

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if model.transformer_impl == "transformer_engine":
        require_gpu(rehearse, f"building the Transformer Engine GPT ({model.norm})")
    gpt = MegatronGPT(model, Layout(), size.vocab, OPTIMIZER, SEED, **RECOMPUTE[recompute])
    batch = synthetic_batch(size, device)

    def step():
        gpt.train()
        gpt.zero_grad()
        gpt.forward_backward([batch])
        gpt.optimizer.step()

    iters, warmup = (2, 1) if rehearse else (ITERS, WARMUP)
    results = {label: {"ms": [], "peak_mib": None} for label in variant.labels}
    try:
        for _ in range(warmup):  # FP8 scales, optimizer state, autotuning: all in place before timing
            step()
        for _ in range(REPEATS):
            for generation, label in zip(variant.kernels, variant.labels):
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                with cuda_kernels(generation):
                    results[label]["ms"].append(time_ms(step, iters, warmup=1))
                peak = peak_mib()
                if peak is not None:
                    results[label]["peak_mib"] = max(peak, results[label]["peak_mib"] or 0.0)
    finally:  # the next model builds its own process groups, on a GPU with this one's memory returned
        gpt.close()
        del gpt, step, batch
        reset_fp8_state()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def reset_fp8_state() -> None:
    """Forget Transformer Engine's global FP8 state (amax buffers keyed by the process groups the
    last model's close() destroyed), so that the next model starts as a fresh process would."""
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except ImportError:
        return
    getattr(FP8GlobalStateManager, "reset", lambda: None)()


def planned(size: Size, impl: str, recompute: str) -> dict:
    """``megatron-siamese plan``'s costs for this shape on one GPU, bf16, flash attention (what the
    TE rows run): {variant: {term: MiB}}, run as a user runs it (the CLI, its JSON)."""
    flags = ["--num-layers", size.num_layers, "--hidden-size", size.hidden_size, "--num-attention-heads",
             size.num_attention_heads, "--ffn-hidden-size", size.ffn_hidden_size, "--seq-length", size.seq_length,
             "--vocab-size", size.vocab, "--micro-batch-size", size.micro_batch, "--global-batch-size",
             size.micro_batch, "--tensor-model-parallel-size", 1, "--bf16", "--normalization", "RMSNorm", "--swiglu",
             "--position-embedding-type", "rope", "--disable-bias-linear", "--transformer-impl", impl,
             "--attention-backend", "flash" if impl == "transformer_engine" else "local", *PLAN_RECOMPUTE[recompute],
             *RUNTIME_AS_PLAN_FLAGS]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        done = subprocess.run([sys.executable, "-m", "megatron_siamese.cli", "plan", *map(str, flags), "--json",
                               str(path)], capture_output=True, text=True, timeout=120)
        if done.returncode:
            return {"error": (done.stderr or done.stdout)[-800:]}
        stages = json.loads(path.read_text())["stages"]
    return {variant: {term: round(stages[variant][0][term] / 2**20, 1) for term in PLAN_TERMS}
            for variant in stages}


def measure_row(size: Size, impl: str, precision: str, recompute: str, rehearse: bool) -> dict:
    row = {"precision": precision, "recompute": recompute, "impl": impl, "layers": size.num_layers,
           "hidden": size.hidden_size, "seq": size.seq_length, "micro_batch": size.micro_batch}
    if precision == "bf16":
        row["plan"] = planned(size, impl, recompute)
    stock_norm = STOCK_TE if impl == "transformer_engine" else "pre"
    measured = {}
    for variant in (replace(STOCK_VARIANT, norm=stock_norm), *SIAMESE_VARIANTS):
        try:
            measured.update(measure_model(settings(size, variant.norm, impl, precision, variant.boundary_ops), variant,
                                          size, recompute, rehearse))
        except NeedsGPU:
            raise
        except Exception as error:  # noqa: BLE001 - the error's text is the result
            measured.update({label: {"error": f"{type(error).__name__}: {error}"[:800]} for label in variant.labels})
    stock = measured["stock"]
    for label, timing in measured.items():
        if "error" in timing:
            row[label] = timing
            continue
        record = repeated(timing["ms"], stock.get("ms") if label != "stock" else None)
        record["peak_mib"] = timing["peak_mib"]
        plan = row.get("plan", {}).get(PLAN_VARIANT[label])
        if plan and timing["peak_mib"]:
            record.update(plan_variant=PLAN_VARIANT[label],
                          peak_over_plan=round(timing["peak_mib"] / plan["memory"], 4))
        if label != "stock":
            variant = next(v for v in SIAMESE_VARIANTS if label in v.labels)
            record["kernels"] = variant.kernels[variant.labels.index(label)]
            if timing["peak_mib"] and stock.get("peak_mib"):
                record["memory_ratio_to_stock"] = round(timing["peak_mib"] / stock["peak_mib"], 4)
        row[label] = record
    return row


def compare(size: Size, impl: str, rows, rehearse: bool) -> dict:
    """Runs in a rank (MegatronGPT creates the process groups of each model it builds)."""
    if impl == "transformer_engine":
        register_stock_te_scheme()
    measured, cut = [], []
    for precision, recompute in rows:
        if seconds_left() < ROW_MARGIN_S:
            cut.append(f"{precision} recompute={recompute}")
            continue
        measured.append(measure_row(size, impl, precision, recompute, rehearse))
    return {"rows": measured, "cut_for_time": cut}


def validate_te_configs(size: Size) -> None:
    """Megatron's validation of every TE row's config (FP8 recipes, recompute) and both block
    specs resolved for it, before any rank starts."""
    from megatron_siamese.models import scheme
    from megatron_siamese.runtime.gpt import transformer_config
    from megatron_siamese.runtime.layout import Layout

    from megatron.core import parallel_state

    register_stock_te_scheme()
    # the block specs ask Megatron's parallel state for this rank's pipeline stage: the bench's
    # only one, set by Megatron's own override while no process group exists yet
    parallel_state.set_pipeline_model_parallel_rank(0)
    try:
        for precision, recompute in ROWS:
            for norm in (STOCK_TE, "siamese"):
                config = transformer_config(settings(size, norm, "transformer_engine", precision), Layout(),
                                            **RECOMPUTE[recompute])
                scheme(norm).block_spec(config, None)
    finally:
        parallel_state.set_pipeline_model_parallel_rank(None)


def model_bench(rehearse: bool) -> dict:
    from megatron_siamese import te

    header = {"model": asdict(MODEL), "iters": ITERS, "warmup": WARMUP, "repeats": REPEATS,
              "tokens_per_step": MODEL.micro_batch * MODEL.seq_length}
    if not rehearse:
        require_gpu(False, "the model bench")
        validate_te_configs(MODEL)
        return {**header, **one_rank(compare, MODEL, "transformer_engine", ROWS, rehearse, model_parallel=False)}
    record = {**header, "rehearsal_model": asdict(REHEARSAL_MODEL),
              **one_rank(compare, REHEARSAL_MODEL, "local", REHEARSAL_ROWS, rehearse, model_parallel=False)}
    reason = te.unavailable_reason()
    if reason:
        record["stopped_at_gpu"] = f"validating the Transformer Engine configs: {reason}"
        return record
    validate_te_configs(MODEL)
    try:
        require_gpu(rehearse, "building the Transformer Engine GPTs (TE's modules assert CUDA when constructed)")
    except NeedsGPU as stop:
        record["stopped_at_gpu"] = str(stop)
    return record


STEPS = {"model-bench": model_bench}

if __name__ == "__main__":
    sys.exit(step_main(STEPS))
