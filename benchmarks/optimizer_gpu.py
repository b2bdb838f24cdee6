"""Times megatronapp's FusedAdamW against torch.optim.AdamW (default,
foreach, fused=True) on one GPU.

    python benchmarks/optimizer_gpu.py     (or: make gpu-check)

A 1.3B-parameter-shaped set of float32 tensors (24 layers of hidden 2048),
mean step in ms after warm-up (gpu_timing.timed_ms: CUDA events)."""

from gpu_timing import timed_ms

import megatronapp  # noqa: F401  (torch.ops.mapp.fused_adamw_)
import torch
from megatronapp.optimizer import FusedAdamW

H, LAYERS = 2048, 24
SHAPES = [(3 * H, H), (H, H), (4 * H, H), (H, 4 * H), (H,), (H,), (3 * H,), (4 * H,)] * LAYERS


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    impls = {"torch default": (torch.optim.AdamW, {}),
             "torch foreach": (torch.optim.AdamW, {"foreach": True}),
             "torch fused=True": (torch.optim.AdamW, {"fused": True}),
             "megatronapp FusedAdamW": (FusedAdamW, {})}
    n = sum(torch.Size(s).numel() for s in SHAPES)
    print(f"{n / 1e9:.2f}B parameters, float32")
    base = None
    for name, (cls, kw) in impls.items():
        ps = [torch.nn.Parameter(torch.randn(*s, device="cuda")) for s in SHAPES]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = cls(ps, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **kw)
        ms = timed_ms(opt.step)
        base = base or ms
        print(f"{name:24s} {ms:8.2f} ms  {base / ms:5.2f}x torch default")
        del ps, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
