"""Times the fused vocab-parallel cross-entropy against torch on one GPU.

    python benchmarks/kernels_gpu.py     (or: make gpu-check)

Compares, at GPT vocabulary sizes in bfloat16, (a) our statistics kernel alone
and (b) our whole loss forward+backward (world size 1) against
F.cross_entropy forward+backward; prints milliseconds and the ratio.
"""


import torch.distributed as dist
import torch.nn.functional as F
from gpu_timing import single_rank_nccl, timed_ms

import megatronapp as mapp
import torch
from megatronapp.tensor_parallel import vocab_parallel_cross_entropy


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    single_rank_nccl()
    mapp.initialize_model_parallel()
    print(f"{'tokens':>8} {'vocab':>7} {'stats ms':>9} {'ours f+b ms':>12} {'torch f+b ms':>13} {'ratio':>6}")
    for tokens, vocab in [(8192, 50304), (16384, 32000), (4096, 128256)]:
        logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocab, (tokens,), device="cuda")
        stats_ms = timed_ms(lambda: torch.ops.mapp.vocab_ce_local_stats(logits, target, 0))

        def ours():
            vocab_parallel_cross_entropy(logits, target).sum().backward()

        def theirs():
            F.cross_entropy(logits.float(), target, reduction="none").sum().backward()

        a, b = timed_ms(ours, 20, 5), timed_ms(theirs, 20, 5)
        print(f"{tokens:>8} {vocab:>7} {stats_ms:>9.3f} {a:>12.3f} {b:>13.3f} {b / a:>6.2f}x")
    mapp.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
