#!/usr/bin/env bash
# The DeepSeek-V3 architecture scaled down to run on a laptop's CPU: 4 ranks as
# PP2 (ZB-V: stage 0 holds the first and last layers) x EP2 over the data
# ranks, MLA with query compression and YaRN, one dense layer then MoE layers
# with 8 routed experts (top-2 over at most 2 of 4 groups, sigmoid scores with
# the expert bias, weights x 2.5) and a shared expert, one MTP depth, ZeRO-1,
# on the bundled corpus with the byte tokenizer. A few minutes on 2 cores:
#   examples/deepseek_v3/train_deepseek_tiny.sh
# Long sequences: split each over two ranks instead of the data ranks (the
# experts then spread over the context pair; MTP and the balance losses work
# under it):
#   examples/deepseek_v3/train_deepseek_tiny.sh --context-parallel-size 2
NPROC="${NPROC:-4}"
source "$(dirname "$0")/../llama/common.sh"
MODEL=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 4
       --multi-latent-attention --q-lora-rank 48 --kv-lora-rank 32 --qk-head-dim 32
       --qk-pos-emb-head-dim 16 --v-head-dim 32 --rotary-interleaved
       --position-embedding-type yarn --yarn-rotary-scaling-factor 4
       --yarn-original-max-position-embeddings 32 --yarn-mscale 1.0 --yarn-mscale-all-dim 1.0
       --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
       --untie-embeddings-and-output-weights --seq-length 128
       --num-experts 8 --moe-layer-freq "([0]*1+[1]*3)" --moe-ffn-hidden-size 64
       --moe-shared-expert-intermediate-size 64 --moe-router-topk 2
       --moe-router-num-groups 4 --moe-router-group-topk 1 --moe-router-score-function sigmoid
       --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5
       --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)
TRAIN=(--pipeline-model-parallel-size 2 --pipeline-schedule zb-v --expert-model-parallel-size 2
       --use-distributed-optimizer --micro-batch-size 4 --global-batch-size 16 --lr 3e-3
       --lr-warmup-iters 10 --train-iters "${ITERS:-60}" --distributed-backend gloo
       --output-dir runs/deepseek_tiny)
exec "${LAUNCH[@]}" "${MODEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${CKPT_FLAGS[@]}" "$@"
