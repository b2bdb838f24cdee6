"""Pretrain a LLaVA-style vision-language model with MegatronApp (Megatron-LM flags).

    torchrun --nproc-per-node 4 examples/pretrain_vlm.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --num-layers 4 --encoder-num-layers 2 --hidden-size 128 --num-attention-heads 4 \
        --img-h 32 --img-w 32 --patch-dim 4 --seq-length 74 \
        --micro-batch-size 8 --global-batch-size 32 --lr 1e-3 --train-iters 300

Add --text-only for the baseline: the same decoder on the captions without the image.
The loop itself lives in megatronapp.pretrain_vlm so tests and benchmarks share it.
"""

from megatronapp.pretrain_vlm import main

if __name__ == "__main__":
    main()
