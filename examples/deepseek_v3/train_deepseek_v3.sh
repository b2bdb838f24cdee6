#!/usr/bin/env bash
# DeepSeek-V3 (671B total, 37B active): 61 layers (3 dense, then 58 MoE), hidden
# 7168, 128 heads of multi-latent attention (query rank 1536, key/value rank
# 512, 128 + 64 rotary channels per query/key head, 128 per value head), YaRN
# (factor 40 over 4096), 256 routed experts of 2048 + 1 shared, top-8 over at
# most 4 of 8 groups (node-limited), sigmoid scores with the aux-loss-free bias,
# routed weights x 2.5, one MTP depth (weight 0.1), sequence 4096, BF16.
# As the paper ran it: 2048 GPUs as PP16 x EP64 x DP (ZeRO-1), no TP;
# run it with NNODES=256 NPROC=8 (and NODE_RANK / MASTER_ADDR per node).
# DualPipe is not implemented: ZB-H1 (zero-bubble) stands in for it, as in the
# scale model's reproduction of the report's cost (tests/python/test_scale_model.py
# parses this file). zb-v would be the closer schedule, but our planner loses
# to ZB-H1 at 16 stages once a pipeline message costs 5% of a chunk's forward
# (docs/pipeline.md). Megatron-LM's own DeepSeek-V3 recipe splits attention over
# TP 2 and keeps experts whole: add --tensor-model-parallel-size 2
# --expert-tensor-parallel-size 1 (docs/moe.md). Not yet here: FP8.
source "$(dirname "$0")/../llama/common.sh"
MODEL=(--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
       --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
       --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-interleaved
       --position-embedding-type yarn --rotary-base 10000 --yarn-rotary-scaling-factor 40
       --yarn-original-max-position-embeddings 4096 --yarn-beta-fast 32 --yarn-beta-slow 1
       --yarn-mscale 1.0 --yarn-mscale-all-dim 1.0
       --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
       --untie-embeddings-and-output-weights --seq-length 4096 --make-vocab-size-divisible-by 128
       --num-experts 256 --moe-layer-freq "([0]*3+[1]*58)" --moe-ffn-hidden-size 2048
       --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8
       --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-score-function sigmoid
       --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
       --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss
       --moe-aux-loss-coeff 1e-4
       --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)
TRAIN=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 16
       --expert-model-parallel-size 64 --use-distributed-optimizer --bf16
       --micro-batch-size 1 --global-batch-size 15360 --lr 2.2e-4 --min-lr 2.2e-5
       --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --train-iters 1000000
       --pipeline-schedule zero-bubble)
exec "${LAUNCH[@]}" "${MODEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${CKPT_FLAGS[@]}" "$@"
