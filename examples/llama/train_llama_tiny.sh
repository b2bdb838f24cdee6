#!/usr/bin/env bash
# The Llama block scaled down to run on a laptop's CPU: 4 ranks as TP2 x PP2,
# RMSNorm, SwiGLU, RoPE (Llama-3.1 scaling), 2 query groups, no biases, on the
# bundled corpus with the byte tokenizer. About a minute on 2 cores:
#   examples/llama/train_llama_tiny.sh
NPROC="${NPROC:-4}"
source "$(dirname "$0")/common.sh"
MODEL=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4
       --group-query-attention --num-query-groups 2 --normalization RMSNorm --swiglu
       --disable-bias-linear --position-embedding-type rope --rotary-base 500000
       --use-rope-scaling --rope-scaling-original-max-position 64
       --untie-embeddings-and-output-weights --seq-length 128)
TRAIN=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
       --micro-batch-size 4 --global-batch-size 16 --lr 3e-3 --lr-warmup-iters 10
       --train-iters "${ITERS:-60}" --distributed-backend gloo --output-dir runs/llama_tiny)
exec "${LAUNCH[@]}" "${MODEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${CKPT_FLAGS[@]}" "$@"
