"""Single-GPU model FLOPs utilization: megatronapp's GPT vs the same model in plain PyTorch.

    make bench-mfu            # on the lent GPU machine: builds, then runs this
    python benchmarks/e2e/mfu_gpu.py [--hidden-size 2048 --num-layers 24 ...]

Trains a GPT of about 1.4B parameters (default: 24 layers, hidden 2048, 16
heads, sequence 2048, vocabulary 50,304, untied output layer) for --steps
steps in bf16 on one GPU, once with megatronapp's modules (GPTModel at TP=1,
PP=1: our tensor-parallel layers, fused cross-entropy, memory pool optional)
and once as the plain-PyTorch model of the end-to-end baseline
(benchmarks/e2e/torch_native.py), same weights and data. Prints tokens/s and
MFU, table last.

Model FLOPs per step (Megatron-LM's formula, Narayanan et al. 2021, eq. 3;
no activation recomputation, so no extra forward):

    F = 72 * B * s * L * h^2 * (1 + s / (6 h) + V / (16 L h))

with B the batch (sequences per step), s the sequence length, L layers, h the
hidden size and V the vocabulary. MFU = F / step time / peak, peak = the dense
bf16 rate of the GPU (--peak-tflops; 989 for H100/H200 SXM).

Parameters, gradients and AdamW state are bf16 (no fp32 master copy), the
optimizer is torch's fused AdamW for both; attention is
``scaled_dot_product_attention`` (flash) for both. Nothing here has run yet on
a GPU from this repository's sessions: results are recorded in
benchmarks/RESULTS.md with their date when one is lent.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch.distributed as dist
import torch.nn.functional as F

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "peers"))  # torch_native, common


def model_flops(b, s, layers, h, vocab) -> float:
    return 72.0 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def run(stack, args, cfg, state, weights):
    torch.manual_seed(0)
    if stack == "ours":
        from megatronapp.models import GPTModel

        model = GPTModel(cfg, parallel_state=state, seed=args.seed)

        def loss_of(net, x, y):
            return net(x, y).mean()
    else:
        from torch_native import TorchGPT

        model = TorchGPT(cfg)
        model.load_state_dict(weights)

        def loss_of(net, x, y):
            return F.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())
    cuda = args.device == "cuda"
    model = model.to(device=args.device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=cuda)
    g = torch.Generator(device=args.device).manual_seed(1)
    shape = (args.micro_batch_size, args.seq_length)
    x = torch.randint(0, cfg.vocab_size, shape, device=args.device, generator=g)
    y = torch.randint(0, cfg.vocab_size, shape, device=args.device, generator=g)
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))  # synchronizes
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times.sort()
    return {"step_s": times[len(times) // 2], "first_loss": losses[0], "last_loss": losses[-1],
            "peak_gib": peak}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--stacks", default="ours,torch")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the script on CPU with a tiny model (no MFU meaning)")
    args = p.parse_args()
    args.device = "cpu" if args.cpu_smoke else "cuda"
    if args.cpu_smoke:
        args.num_layers, args.hidden_size, args.num_attention_heads = 2, 64, 4
        args.seq_length, args.vocab_size, args.micro_batch_size = 32, 256, 2
        args.steps, args.warmup = 3, 1
    elif not torch.cuda.is_available():
        raise SystemExit("mfu_gpu.py needs a CUDA GPU (run it on the lent GPU machine); "
                         "--cpu-smoke checks the script on CPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo" if args.cpu_smoke else "nccl", rank=0, world_size=1)
    if not args.cpu_smoke:
        torch.cuda.set_device(0)
    import megatronapp as mapp
    from common import reference_weights
    from megatronapp.models import GPTConfig

    state = mapp.initialize_model_parallel()
    cfg = GPTConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                    num_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
                    seq_length=args.seq_length, share_embeddings_and_output_weights=False)
    weights = reference_weights(cfg, args.seed) if "torch" in args.stacks else None
    flops = model_flops(args.micro_batch_size, args.seq_length, args.num_layers,
                        args.hidden_size, args.vocab_size)
    rows = {}
    for stack in args.stacks.split(","):
        t0 = time.time()
        rows[stack] = run(stack, args, cfg, state, weights)
        print(f"[mfu] {stack}: {rows[stack]} ({time.time() - t0:.0f}s)", flush=True)
    tokens = args.micro_batch_size * args.seq_length
    device = torch.cuda.get_device_name() if not args.cpu_smoke else "CPU smoke test"
    print(f"\n{device}, GPT {cfg.num_parameters() / 1e9:.2f}B params "
          f"(L={args.num_layers}, h={args.hidden_size}, s={args.seq_length}, V={args.vocab_size}), "
          f"batch {args.micro_batch_size}, bf16, {flops / 1e12:.1f} TFLOP per step, "
          f"peak {args.peak_tflops:.0f} TFLOP/s")
    print(f"{'stack':<8} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9} "
          f"{'loss first->last':>18}")
    for stack, r in rows.items():
        tf = flops / r["step_s"] / 1e12
        print(f"{stack:<8} {r['step_s']:>8.3f} {tokens / r['step_s']:>10.0f} {tf:>9.1f} "
              f"{100 * tf / args.peak_tflops:>6.1f}% {r['peak_gib']:>9.1f} "
              f"{r['first_loss']:>8.3f}->{r['last_loss']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
