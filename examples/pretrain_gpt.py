"""Pretrain a GPT with MegatronApp (Megatron-LM flags).

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --num-layers 4 --hidden-size 128 \
        --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 \
        --global-batch-size 16 --lr 3e-3 --train-iters 100

The loop itself lives in megatronapp.pretrain so tests and benchmarks share it.
"""

from megatronapp.pretrain import main

if __name__ == "__main__":
    main()
