"""Helper process for the crash-safety test and benchmark: saves checkpoints of
a small GPT in a loop (one Gloo rank) until killed."""

import os
import sys
from datetime import timedelta

import torch.distributed as dist

import torch


def main(directory: str, port: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    import megatronapp as mapp
    from megatronapp import checkpoint
    from megatronapp.models import GPTConfig, GPTModel

    state = mapp.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=256, hidden_size=256, num_layers=4,
                               num_attention_heads=4, seq_length=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 64))
    it = 0
    print("ready", flush=True)
    while True:
        it += 1
        model(x, x).mean().backward()
        opt.step()
        opt.zero_grad()
        checkpoint.save(directory, it, [model], opt, config={"hidden_size": 256},
                        parallel_state=state)
        if it == 1:  # committed: a reader may now kill this process at any point
            print("saved", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    os._exit(0)
