#!/usr/bin/env bash
# Mixtral 8x7B: 32 layers, hidden 4096, 32 heads in 8 query groups, 8 SwiGLU
# experts of 14336 per layer, top-2, RoPE base 1000000, sequence 4096, BF16.
# 8 nodes x 8 GPUs as TP1 x PP4 x DP16 with the experts over EP8 and ZeRO-1.
source "$(dirname "$0")/common.sh"
MODEL=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
       --group-query-attention --num-query-groups 8 --kv-channels 128
       --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
       --position-embedding-type rope --rotary-base 1000000
       --untie-embeddings-and-output-weights --seq-length 4096
       --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2
       --moe-token-dispatcher-type alltoall)
TRAIN=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
       --expert-model-parallel-size 8 --use-distributed-optimizer --bf16
       --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --min-lr 1e-5
       --lr-warmup-iters 500 --weight-decay 0.1 --clip-grad 1.0 --train-iters 100000
       --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
exec "${LAUNCH[@]}" "${MODEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${CKPT_FLAGS[@]}" "$@"
