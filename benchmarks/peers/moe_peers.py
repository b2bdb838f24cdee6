"""The same MoE GPT on 4 CPU ranks: ours against DeepSpeed-MoE, tokens/s and
time to an equal loss.

    .venv-peers/bin/python benchmarks/peers/moe_peers.py [--iters 80] [--repeats 2]

Both stacks: 4 layers, hidden 128, 4 heads, sequence 128, micro-batch 4,
global batch 16, every layer MoE with 8 experts of hidden 256, top-2,
dropless, load-balancing loss 1e-2, experts sharded over 4 ranks (ep = dp = 4),
ZeRO-1, AdamW (0.9, 0.95), clipping 1.0, pretrain's learning-rate schedule and
batches (benchmarks/peers/common.py). DeepSpeed is configured as its MoE
tutorial recommends for an equal comparison: ``deepspeed.moe.layer.MoE`` with
``k=2``, ``drop_tokens=False`` (dropless), no noisy gate, no random token
selection, no sampled second expert; its experts are the same bias-free GeLU
MLP as ours; its parameter groups split by
``split_params_into_different_moe_groups_for_optimizer``; ZeRO stage 1. The
dense weights start from the same values (megatronapp's reference model for
the seed); the experts and routers from each stack's own initialization, so
the two loss curves differ a little: compared by time to the loss both reach.

Runs the stacks round-robin ``--repeats`` times (``torchrun``-style spawn of 4
processes each), prints median step time (iterations 6+), tokens/s, the
smoothed final loss, and for the target loss (the higher of the two final
smoothed losses) the first iteration reaching it and the time to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "10"]
E, TOPK, FFN, AUX = 8, 2, 256, 1e-2


def run_ours(args):
    from megatronapp.pretrain import build_parser, train

    a = build_parser().parse_args(MODEL + [
        "--train-iters", str(args.iters), "--num-experts", str(E), "--moe-router-topk",
        str(TOPK), "--moe-ffn-hidden-size", str(FFN), "--moe-aux-loss-coeff", str(AUX),
        "--expert-model-parallel-size", "4", "--use-distributed-optimizer",
        "--untie-embeddings-and-output-weights", "--eval-iters", "0", "--no-progress",
        "--log-interval", "100000", "--no-watchdog", "--output-dir", "runs/moe_peers_ours"])
    res = train(a)
    return [h["loss"] for h in res["history"]], [h["seconds"] for h in res["history"]]


def run_deepspeed(args):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import torch
    from torch import nn

    sys.path.insert(0, HERE)
    from torch_native import TorchGPT

    import common

    deepspeed.init_distributed(dist_backend="gloo")
    p = common.add_workload_flags(argparse.ArgumentParser())
    wargs = p.parse_args(MODEL + ["--train-iters", str(args.iters),
                                  "--untie-embeddings-and-output-weights"])
    work = common.Workload(wargs, 1)
    model = TorchGPT(work.cfg)
    model.load_state_dict(work.weights)
    aux = []

    class Expert(nn.Module):  # ours: no biases, tanh GeLU
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(wargs.hidden_size, FFN, bias=False)
            self.fc2 = nn.Linear(FFN, wargs.hidden_size, bias=False)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))

    class MoEMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE(wargs.hidden_size, Expert(), num_experts=E, ep_size=4, k=TOPK,
                           drop_tokens=False, use_rts=False, noisy_gate_policy=None,
                           top2_2nd_expert_sampling=False)

        def forward(self, x):
            out, l_aux, _ = self.moe(x)
            aux.append(l_aux)
            return out

    torch.manual_seed(wargs.seed + dist.get_rank())
    for block in model.layers.values():
        block.mlp = MoEMLP()
    groups = common.decay_groups(model.named_parameters(), wargs.weight_decay)
    for i, g in enumerate(groups):
        g["name"] = f"decay{i}"  # DeepSpeed keys the expert groups by name
    groups = split_params_into_different_moe_groups_for_optimizer(groups)
    dp = dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": wargs.micro_batch_size,
              "gradient_accumulation_steps": wargs.global_batch_size
              // (wargs.micro_batch_size * dp),
              "train_batch_size": wargs.global_batch_size,
              "gradient_clipping": wargs.clip_grad,
              "optimizer": {"type": "AdamW", "params": {
                  "lr": wargs.lr, "betas": list(common.ADAM_BETAS), "eps": 1e-8,
                  "weight_decay": wargs.weight_decay, "torch_adam": True}},
              "zero_optimization": {"stage": 1, "contiguous_gradients": True,
                                    "overlap_comm": True},
              "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    m = config["gradient_accumulation_steps"]

    def step(it, lr):
        for g in engine.optimizer.param_groups:
            g["lr"] = lr
        total = torch.zeros(1, dtype=torch.float64)
        for x, y in work.microbatches("train", it, dist.get_rank(), dp):
            aux.clear()
            logits = engine(x)
            lm = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            engine.backward(lm + AUX * sum(aux))  # DeepSpeed returns l_aux; the user adds it
            engine.step()
            total += lm.detach().double() / m
        dist.all_reduce(total)
        return float(total) / dp, float(engine.get_global_grad_norm() or 0.0)

    hist = common.train_loop(wargs, step, lambda i: 0.0)
    return [h["loss"] for h in hist], [h["seconds"] for h in hist]


def rank_main(args):
    import torch

    torch.set_num_threads(1)
    losses, secs = (run_ours if args.stack == "ours" else run_deepspeed)(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps({"losses": losses, "seconds": secs}), flush=True)


def launch(stack, args, port):
    env_base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    WORLD_SIZE="4", OMP_NUM_THREADS="1")
    procs = []
    for r in range(4):
        env = dict(env_base, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--stack", stack, "--iters", str(args.iters),
             "--out", args.out, "--rank-process"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=3600) for p in procs]
    bad = [f"--- {stack} rank {r} ---\n{e[-4000:]}" for r, (p, (_o, e)) in
           enumerate(zip(procs, outs, strict=True)) if p.returncode]
    if bad:
        raise SystemExit("\n".join(bad))
    line = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def smooth(xs, k=10):
    return [statistics.mean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=80)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="runs/moe_peers")
    p.add_argument("--stack", choices=("ours", "deepspeed"))
    p.add_argument("--rank-process", action="store_true")
    args = p.parse_args()
    if args.rank_process:
        if args.stack == "ours":
            import torch.distributed as dist
            dist.init_process_group("gloo")
        rank_main(args)
        return
    runs = {"ours": [], "deepspeed": []}
    port = 29800
    for _ in range(args.repeats):
        for stack in runs:
            port += 1
            runs[stack].append(launch(stack, args, port))
    tokens = 16 * 128
    summary = {}
    for stack, rs in runs.items():
        step = statistics.median(statistics.median(r["seconds"][5:]) for r in rs)
        curve = smooth([statistics.mean(x) for x in zip(*(r["losses"] for r in rs), strict=True)])
        summary[stack] = {"step_s": step, "final": curve[-1], "curve": curve,
                          "ranges": [min(statistics.median(r["seconds"][5:]) for r in rs),
                                     max(statistics.median(r["seconds"][5:]) for r in rs)]}
    target = max(s["final"] for s in summary.values())
    print(f"\nMoE GPT (8 experts, top-2, ep 4, ZeRO-1) on 4 CPU ranks, {args.iters} iterations, "
          f"{args.repeats} round-robin repeats; loss smoothed over 10 iterations; target "
          f"{target:.3f}")
    print(f"{'stack':<12} {'step s':>8} {'(range)':>15} {'tokens/s':>9} {'final loss':>11} "
          f"{'iter to target':>15} {'time to target s':>17}")
    for stack, s in summary.items():
        it = next(i for i, v in enumerate(s["curve"]) if v <= target + 1e-12) + 1
        s["iter_to_target"], s["time_to_target"] = it, it * s["step_s"]
        print(f"{stack:<12} {s['step_s']:>8.3f} {s['ranges'][0]:>7.3f}-{s['ranges'][1]:<7.3f} "
              f"{tokens / s['step_s']:>9.0f} {s['final']:>11.3f} {it:>15} "
              f"{s['time_to_target']:>17.1f}")
    o, d = summary["ours"], summary["deepspeed"]
    print(f"ours vs DeepSpeed-MoE: {d['step_s'] / o['step_s']:.2f}x tokens/s, "
          f"{d['time_to_target'] / o['time_to_target']:.2f}x faster to the target loss")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_peers.json"), "w") as f:
        json.dump({k: {kk: vv for kk, vv in v.items() if kk != "curve"} | {"curve": v["curve"]}
                   for k, v in summary.items()}, f)


if __name__ == "__main__":
    main()
