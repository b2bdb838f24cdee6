"""AdamW step time: torch.optim.AdamW (its default per-tensor loop, foreach,
fused=True) against megatronapp's FusedAdamW, on the parameter shapes of the
peers' GPT (4 layers, hidden 512, FFN 2048; 11.8M parameters), one thread.

    python benchmarks/optimizer_bench.py [--iters 20] [--repeats 3]

Prints the median step in ms per implementation (round-robin repeats) and
checks first that the implementations agree (max difference after 5 steps)."""

import argparse
import statistics
import time

import megatronapp  # noqa: F401  (torch.ops.mapp.fused_adamw_)
import torch
from megatronapp.optimizer import FusedAdamW

SHAPES = [(512, 512)] * 12 + [(512, 2048)] * 8 + [(512,)] * 40 + [(256, 512)] * 2
IMPLS = {"torch (default loop)": (torch.optim.AdamW, {"foreach": False}),
         "torch foreach": (torch.optim.AdamW, {"foreach": True}),
         "torch fused=True": (torch.optim.AdamW, {"fused": True}),
         "megatronapp FusedAdamW": (FusedAdamW, {})}


def make(cls, kw):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps, cls(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, **kw)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    finals = {}
    for name, (cls, kw) in IMPLS.items():
        ps, opt = make(cls, kw)
        for _ in range(5):
            opt.step()
        finals[name] = ps
    ref = finals["torch (default loop)"]
    for name, ps in finals.items():
        diff = max((x - y).abs().max().item() for x, y in zip(ps, ref, strict=True))
        print(f"{name:24s} max |difference| to torch's loop after 5 steps: {diff:.2e}")
    times = {name: [] for name in IMPLS}
    for _ in range(a.repeats):
        for name, (cls, kw) in IMPLS.items():
            _, opt = make(cls, kw)
            for _ in range(3):
                opt.step()
            t = time.perf_counter()
            for _ in range(a.iters):
                opt.step()
            times[name].append((time.perf_counter() - t) / a.iters * 1e3)
    n = sum(torch.Size(s).numel() for s in SHAPES)
    base = statistics.median(times["torch (default loop)"])
    print(f"\n{n / 1e6:.1f}M parameters, {a.iters} steps x {a.repeats} repeats, 1 thread")
    print("| implementation | ms per step (range) | vs torch's default |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} ({min(ts):.2f}–{max(ts):.2f}) | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
