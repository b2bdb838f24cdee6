#!/usr/bin/env bash
# Llama-3 70B: 80 layers, hidden 8192, 64 heads in 8 query groups, SwiGLU
# 28672, RoPE base 500000, sequence 8192, BF16. 8 nodes x 8 GPUs as TP8 x PP4
# (interleaved, 5 layers per virtual stage) x DP2 with ZeRO-1 and sequence
# parallelism (NNODES=8, NODE_RANK, MASTER_ADDR per node).
source "$(dirname "$0")/common.sh"
MODEL=(--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
       --group-query-attention --num-query-groups 8 --kv-channels 128
       --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
       --position-embedding-type rope --rotary-base 500000
       --untie-embeddings-and-output-weights --seq-length 8192)
TRAIN=(--tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 4
       --virtual-pipeline-model-parallel-size 4 --use-distributed-optimizer --bf16
       --micro-batch-size 1 --global-batch-size 512 --lr 1.5e-4 --min-lr 1.5e-5
       --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --train-iters 100000
       --recompute-granularity selective)
exec "${LAUNCH[@]}" "${MODEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${CKPT_FLAGS[@]}" "$@"
