#!/usr/bin/env bash
# A mixture-of-experts SiameseNorm GPT with Megatron-LM's training loop on one node: every MLP an
# MoE layer of Megatron's (8 experts, top-2, load-balancing aux loss and z-loss), the experts
# split over the node by expert parallelism (EP adds no ranks: it regroups the TP x DP ranks).
#
#   OUT=runs/moe bash examples/pretrain_moe_siamese.sh            # 8 GPUs: TP2 x DP4, EP4 (expert TP 1)
#   CPU=1 OUT=runs/moe bash examples/pretrain_moe_siamese.sh      # CPU: 2 gloo ranks, DP2 x EP2, tiny
#
# GPU (default): torchrun, bf16, Transformer Engine's grouped-GEMM experts and the alltoall
# dispatcher. CPU=1: `megatron-siamese train` starts its own ranks (no torchrun) with SequentialMLP
# experts and the allgather dispatcher. Megatron logs the load-balancing and z-losses each
# iteration; rerunning resumes from "$OUT/checkpoints" (--save and --load name it).
# Extra flags (Megatron-LM's) go to `megatron-siamese train`.
set -euo pipefail
OUT=${OUT:-runs/moe}
PYTHON=${PYTHON:-python}
COMMON=(
  --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 --clip-grad 1.0
  --save-interval 100 --eval-interval 100 --eval-iters 4 --log-interval 10
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --tensorboard-dir "$OUT/tensorboard"
)

if [ "${CPU:-0}" = "1" ]; then
  exec "$PYTHON" -m megatron_siamese.cli train "${COMMON[@]}" \
    --nproc-per-node 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 4 --global-batch-size 8 --train-iters 200 "$@"
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --nproc-per-node 8 -m megatron_siamese.cli train "${COMMON[@]}" \
  --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 \
  --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall \
  --transformer-impl transformer_engine --moe-grouped-gemm --bf16 --use-distributed-optimizer \
  --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --moe-ffn-hidden-size 2816 --seq-length 2048 \
  --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 256 --train-iters 10000 "$@"
