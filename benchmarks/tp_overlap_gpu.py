"""What --tp-comm-overlap's decomposition costs on one GPU.

    python benchmarks/tp_overlap_gpu.py     (or: make gpu-check)

One GPU has no tensor-parallel peer (NCCL refuses two ranks on one device),
so the collectives here are a group of one (a device copy on the
communication thread's stream); what this measures is the price of the
pipelining itself: the GEMMs cut into `splits` pieces, the stream hand-offs
and the copies into place, against one unsplit F.linear. On TP ranks the
overlap pays when the hidden communication exceeds this price. Llama-8B-like
MLP shapes at TP8 (sequence 8192, hidden 4096, ffn 14336 / 8), bf16, forward
+ backward of the column and row linears; mean ms (gpu_timing.timed_ms)."""


import torch.distributed as dist
import torch.nn.functional as F
from gpu_timing import single_rank_nccl, timed_ms

import megatronapp  # noqa: F401  (torch.ops.mapp)
import torch
from megatronapp.tensor_parallel import TPCommOverlap, overlap

S, H, F_TP = 8192, 4096, 14336 // 8


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    single_rank_nccl()
    group = dist.group.WORLD
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(S, 1, H, **kw).requires_grad_()
    w1 = (torch.randn(F_TP, H, **kw) * 0.02).requires_grad_()
    w2 = (torch.randn(H, F_TP, **kw) * 0.02).requires_grad_()
    gy = torch.randn(S, 1, H, **kw)

    def plain():
        (F.linear(F.gelu(F.linear(x, w1)), w2) * gy).sum().backward()

    def overlapped(ov):
        def step():
            h = F.gelu(overlap.column_linear(x, w1, None, group, ov))
            (overlap.row_linear(h, w2, group, ov) * gy).sum().backward()
        return step

    base = timed_ms(plain)
    print(f"{'unsplit F.linear':34s} {base:8.2f} ms  1.00x")
    for splits in (1, 2, 4, 8):
        ms = timed_ms(overlapped(TPCommOverlap(splits=splits)))
        print(f"{f'overlapped, {splits} pieces':34s} {ms:8.2f} ms  {base / ms:5.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
