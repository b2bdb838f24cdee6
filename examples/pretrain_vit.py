"""Pretrain a ViT image classifier with MegatronApp (Megatron-LM flags).

    torchrun --nproc-per-node 4 examples/pretrain_vit.py \
        --tensor-model-parallel-size 2 --num-layers 4 --hidden-size 128 \
        --num-attention-heads 4 --img-h 16 --img-w 16 --patch-dim 4 \
        --micro-batch-size 8 --global-batch-size 32 --lr 1e-3 --train-iters 300

The loop itself lives in megatronapp.pretrain_vit so tests and benchmarks share it.
"""

from megatronapp.pretrain_vit import main

if __name__ == "__main__":
    main()
