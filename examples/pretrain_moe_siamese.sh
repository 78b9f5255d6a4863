#!/usr/bin/env bash
# A mixture-of-experts SiameseNorm GPT with this package's trainer on one node: every MLP an
# MoE layer of Megatron's (8 experts, top-2, load-balancing aux loss), the experts split over
# the node by expert parallelism (EP adds no ranks: it regroups the TP x DP ranks).
#
#   OUT=runs/moe bash examples/pretrain_moe_siamese.sh            # 8 GPUs: TP2 x DP4, EP4 (etp 1)
#   CPU=1 OUT=runs/moe bash examples/pretrain_moe_siamese.sh      # CPU: 2 gloo ranks, DP2 x EP2, tiny
#
# GPU (default): torchrun, bf16, Transformer Engine's grouped-GEMM experts and the alltoall
# dispatcher. CPU=1: the trainer launches its own ranks (no torchrun) with SequentialMLP experts
# and the allgather dispatcher. Each step's aux loss and busiest expert's load (relative to
# the mean) come in the log lines; rerunning resumes from "$OUT/checkpoints", at any EP/TP/PP.
# Extra flags go to `megatron-siamese train`.
set -euo pipefail
OUT=${OUT:-runs/moe}
PYTHON=${PYTHON:-python}
RESUME=()
[ -f "$OUT/checkpoints/latest_checkpointed_iteration.txt" ] && RESUME=(--load "$OUT/checkpoints")
COMMON=(
  --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3
  --lr 1e-3 --min-lr 1e-4 --save-interval 100 --eval-interval 100 --log-interval 10 --no-progress
  --output-dir "$OUT" "${RESUME[@]}"
)

if [ "${CPU:-0}" = "1" ]; then
  exec "$PYTHON" -m megatron_siamese.cli train "${COMMON[@]}" \
    --tp 1 --dp 2 --ep 2 --moe-token-dispatcher-type allgather \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --micro-batch-size 4 --global-batch-size 8 --train-iters 200 "$@"
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --nproc-per-node 8 -m megatron_siamese.cli train "${COMMON[@]}" \
  --tp 2 --sp --dp 4 --ep 4 --etp 1 --moe-token-dispatcher-type alltoall \
  --transformer-impl transformer_engine --moe-grouped-gemm --bf16 --use-distributed-optimizer \
  --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --moe-ffn-hidden-size 2816 --seq-length 2048 \
  --micro-batch-size 4 --global-batch-size 256 --train-iters 10000 "$@"
