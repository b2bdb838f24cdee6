#!/usr/bin/env bash
# Llama-3 8B (Megatron-LM's examples/llama flag set): 32 layers, hidden 4096,
# 32 heads in 8 query groups, SwiGLU 14336, RoPE base 500000, vocab 128,256,
# sequence 8192, BF16. One node of 8 GPUs as TP1 x PP1 x DP8 with ZeRO-1;
# add --use-rope-scaling for Llama-3.1 (its long-context RoPE).
source "$(dirname "$0")/common.sh"
MODEL=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
       --group-query-attention --num-query-groups 8 --kv-channels 128
       --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
       --position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0
       --untie-embeddings-and-output-weights --seq-length 8192
       --make-vocab-size-divisible-by 128)
TRAIN=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
       --use-distributed-optimizer --bf16 --micro-batch-size 1 --global-batch-size 128
       --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0
       --train-iters 100000 --recompute-granularity selective)
exec "${LAUNCH[@]}" "${MODEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${CKPT_FLAGS[@]}" "$@"
