#!/usr/bin/env bash
# SiameseNorm in Megatron-LM's own pretrain_gpt.py, with no edits to Megatron-LM.
#
#   MEGATRON_LM=/path/to/Megatron-LM DATA=/path/to/prefix bash examples/pretrain_gpt_siamese.sh
#
# GPU (default): Transformer Engine GEMMs and attention from --transformer-impl, bf16,
# NCCL; SiameseNorm's layer spec is the only change: --spec megatron_siamese.specs siamese_layer_spec
# (use siamese_te_layer_spec for the Transformer Engine variant once installed).
#
# CPU=1: the same run on CPU processes with gloo through megatron_siamese's CPU harness
# (megatron_siamese.runtime.megatron_lm), tiny sizes; what this repository tested with.
set -euo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1 matches megatron-core 0.16.1)}"
: "${DATA:?set DATA to an indexed dataset prefix (.bin/.idx); megatron-siamese train builds one from the KJV corpus under .cache/}"
TP=${TP:-2} PP=${PP:-2} DP=${DP:-1}
NPROC=$((TP * PP * DP))
OUT=${OUT:-runs/megatron-lm}

COMMON=(
  --spec megatron_siamese.specs siamese_layer_spec
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --data-path "$DATA" --split 98,2,0
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 10 --lr-decay-style cosine --clip-grad 1.0
  --log-interval 10 --eval-interval 50 --eval-iters 5
  --ckpt-format torch_dist --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 50
)

if [ "${CPU:-0}" = "1" ]; then
  # The local (non-TE) final norm is torch's LayerNorm/RMSNorm: it refuses persist_layer_norm
  # (on by default in Megatron-LM) and sequence parallelism. The fused-kernel flags are off
  # because those kernels need a GPU; TORCHDYNAMO_DISABLE skips Megatron-LM's torch.compile
  # warm-up of its jit fusions. Megatron-LM's data helpers compile at start (needs pybind11).
  export TORCHDYNAMO_DISABLE=1 CUDA_DEVICE_MAX_CONNECTIONS=1
  cd "$MEGATRON_LM"
  exec torchrun --nproc-per-node "$NPROC" -m megatron_siamese.runtime.megatron_lm pretrain_gpt.py \
    "${COMMON[@]}" --distributed-backend gloo --transformer-impl local --no-persist-layer-norm \
    --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion \
    --no-bias-dropout-fusion --no-rope-fusion --hidden-dropout 0 --attention-dropout 0 \
    --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 100 \
    --tokenizer-type NullTokenizer --vocab-size 256
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
cd "$MEGATRON_LM"
exec torchrun --nproc-per-node "$NPROC" pretrain_gpt.py "${COMMON[@]}" \
  --transformer-impl transformer_engine --bf16 --sequence-parallel --use-distributed-optimizer \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
  --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 256 --train-iters 10000 \
  --tokenizer-type NullTokenizer --vocab-size 256
