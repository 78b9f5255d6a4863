#!/usr/bin/env bash
# SiameseNorm in Megatron-LM's own pretrain_hybrid.py (HybridModel, megatron-core >= 0.19),
# with no edits to Megatron-LM: every '*' and '-' of the pattern is one SiameseNorm sublayer.
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/pretrain_hybrid_siamese.sh
#
# GPU (default): --spec megatron_siamese.hybrid siamese_hybrid_te_stack_spec (Megatron's
# Transformer Engine hybrid stack with SiameseNorm layers; 'M' and 'G' layers need mamba_ssm /
# FLA), bf16, NCCL. CPU=1: the local stack (siamese_hybrid_stack_spec, '*' and '-') on CPU
# processes with gloo through megatron_siamese.runtime.megatron_lm; what this repository ran
# (Megatron-LM tag core_v0.19.0 with megatron-core 0.19.2, docs/megatron-lm.md).
#
# LOAD=/path/to/gpt/checkpoint loads a SiameseNorm GPT checkpoint (pretrain_gpt.py --spec
# megatron_siamese.specs siamese_layer_spec, or megatron-siamese train) into the hybrid model
# through Megatron's own GPT-to-Hybrid translation: use the pattern '*-' per GPT layer.
set -euo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (the core_v0.19 line matches megatron-core 0.19.x)}"
PP=${PP:-2}
OUT=${OUT:-runs/megatron-lm-hybrid}
PATTERN=${PATTERN:-'*-*-|*-*-'}  # one segment per pipeline stage
LAYERS=$(printf '%s' "$PATTERN" | tr -d '|' | wc -c)

COMMON=(
  --hybrid-layer-pattern "$PATTERN" --num-layers "$LAYERS" --pipeline-model-parallel-size "$PP"
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 10 --lr-decay-style cosine --clip-grad 1.0
  --log-interval 10 --eval-interval 50 --eval-iters 5
  --ckpt-format torch_dist --save "$OUT/checkpoints" --load "${LOAD:-$OUT/checkpoints}" --save-interval 50
  --tokenizer-type NullTokenizer --vocab-size 256 ${DATA:+--data-path "$DATA" --split 98,2,0}
)
[ -n "${DATA:-}" ] || COMMON+=(--mock-data)

if [ "${CPU:-0}" = "1" ]; then
  # as examples/pretrain_gpt_siamese.sh: torch's final norms, no GPU-only fusions, no torch.compile,
  # no data-loader workers; Megatron-LM compiles its data helpers with the python3 on PATH
  export TORCHDYNAMO_DISABLE=1 CUDA_DEVICE_MAX_CONNECTIONS=1
  cd "$MEGATRON_LM"
  exec torchrun --nproc-per-node "$PP" -m megatron_siamese.runtime.megatron_lm pretrain_hybrid.py \
    --spec megatron_siamese.hybrid siamese_hybrid_stack_spec "${COMMON[@]}" \
    --distributed-backend gloo --transformer-impl local --no-persist-layer-norm \
    --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion \
    --no-bias-dropout-fusion --no-rope-fusion --hidden-dropout 0 --attention-dropout 0 --num-workers 0 \
    --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 2 --global-batch-size 8 --train-iters 100
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
cd "$MEGATRON_LM"
exec torchrun --nproc-per-node "$PP" pretrain_hybrid.py --spec megatron_siamese.hybrid siamese_hybrid_te_stack_spec \
  "${COMMON[@]}" --transformer-impl transformer_engine --bf16 --use-distributed-optimizer \
  --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 \
  --micro-batch-size 4 --global-batch-size 256 --train-iters 10000
