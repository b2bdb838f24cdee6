"""End-to-end efficiency: megatronapp against the PyTorch-native stack.

    python benchmarks/e2e/run.py                      # both topologies (needs root)
    python benchmarks/e2e/run.py --topology two-node --iters 120 --target-loss 2.6

Trains the same GPT (same weights, seeds, data order and learning-rate
schedule) with 4 ranks on each stack and configuration, one after another:

* ours — ``examples/pretrain_gpt.py``'s ``train()`` with its best settings, all
  chosen by flags (see CONFIGS): tensor parallelism inside a node, and across
  nodes either data parallelism with a compressed gradient codec + ZeRO-1, or
  pipeline parallelism with the zero-bubble schedule; memory pool on;
* PyTorch-native (``torch_native.py``): DTensor tensor parallelism inside a
  node, and across nodes torch DDP (plain, and with its PowerSGD hook) or
  ``torch.distributed.pipelining`` (1F1B).

Topologies, each in fresh network namespaces so the interface counters see
only this job's traffic:

* ``loopback`` — one "node": all 4 ranks in one namespace, talking over lo;
* ``two-node`` — two "nodes" of 2 ranks, each its own namespace, joined by a
  veth pair shaped with ``tc tbf`` to --rate (1 Gbit/s): the tensor group stays
  inside a node, the data / pipeline group crosses the link.

Per configuration: step time (median after --warmup), tokens/s, steps and
training wall time (evaluation excluded) to reach --target-loss on the
validation split (evaluated every --eval-interval), peak resident memory per
rank, bytes sent per step over all interfaces and across the node boundary,
and cost to the target relative to the best PyTorch-native configuration
(same rank count: cost ratio = time ratio). The table is printed last and
written with a plot to --out (markdown, JSON, PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
import netns  # noqa: E402  (benchmarks/netns.py)

WORLD = 4
NS = {"loopback": ["mapp_e2e_a"], "two-node": ["mapp_e2e_b0", "mapp_e2e_b1"]}
ADDR = ("10.78.0.1", "10.78.0.2")
VETH = ("mapp_e2e_v0", "mapp_e2e_v1")

# key -> (stack, label, flags). Model / batch flags are shared (MODEL below).
CONFIGS = {
    "torch-ddp": ("torch", "torch: DTensor TP2 x DDP2", ["--tensor-model-parallel-size", "2"]),
    "torch-powersgd": ("torch", "torch: DTensor TP2 x DDP2 + PowerSGD(4)", [
        "--tensor-model-parallel-size", "2", "--ddp-comm-hook", "powersgd",
        "--powersgd-rank", "4"]),
    "torch-pp": ("torch", "torch: DTensor TP2 x pipelining PP2 (1F1B)", [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "1f1b"]),
    "ours-dp": ("ours", "ours: TP2 x DP2, int8 codec, pool", [
        "--tensor-model-parallel-size", "2", "--grad-compression", "int8",
        "--grad-compression-start-iter", "2", "--memory-pool"]),
    "ours-dp-onebit": ("ours", "ours: TP2 x DP2, onebit:32 codec, pool", [
        "--tensor-model-parallel-size", "2", "--grad-compression", "onebit:32",
        "--grad-compression-start-iter", "2", "--memory-pool"]),
    "ours-dp-zero1": ("ours", "ours: TP2 x DP2, int8 codec, ZeRO-1, pool", [
        "--tensor-model-parallel-size", "2", "--grad-compression", "int8",
        "--grad-compression-start-iter", "2", "--use-distributed-optimizer", "--memory-pool"]),
    "ours-pp": ("ours", "ours: TP2 x PP2 zero-bubble, pool", [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "zero-bubble", "--memory-pool"]),
}
MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "10", "--seed", "1234",
         "--untie-embeddings-and-output-weights"]


def setup(topology: str, rate: str) -> None:
    teardown()
    if topology == "two-node":
        netns.create(NS["two-node"], VETH, ADDR, rate)
    else:
        netns.create(NS[topology])


def teardown() -> None:
    for names in NS.values():
        netns.remove(names)


def placement(topology: str):
    """(namespace, master address, socket interface) per rank; Megatron order
    puts the tensor pairs (0, 1) and (2, 3) on one node each."""
    if topology == "loopback":
        return [(NS["loopback"][0], "127.0.0.1", "lo")] * WORLD
    return [(NS["two-node"][r // 2], ADDR[0], VETH[r // 2]) for r in range(WORLD)]


# ---- one rank ---------------------------------------------------------------------------

def _interface_tx() -> dict:
    out = {}
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, rest = line.split(":", 1)
            out[name.strip()] = int(rest.split()[8])  # transmitted bytes
    return out


class Meter:
    """Samples this namespace's interface counters around every training
    iteration (one rank per node does it; the namespace holds only this job)."""

    def __init__(self, sample: bool):
        self.sample, self.rows, self._t0 = sample, [], None

    def begin(self, it):
        if self.sample:
            self._t0 = _interface_tx()

    def end(self, it, record):
        if self.sample:
            t1 = _interface_tx()
            d = {k: t1[k] - self._t0.get(k, 0) for k in t1}
            self.rows.append({"total": sum(d.values()),
                              "cross": sum(v for k, v in d.items() if k != "lo")})


def worker(a, flags) -> None:
    os.environ.update(RANK=str(a.rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(a.rank % 2),
                      MASTER_ADDR=a.master, MASTER_PORT=str(a.port),
                      GLOO_SOCKET_IFNAME=a.ifname, OMP_NUM_THREADS="1")
    from datetime import timedelta

    import torch.distributed as dist

    import torch

    torch.set_num_threads(1)
    meter = Meter(sample=a.sample)
    if a.stack == "ours":
        sys.path.insert(0, os.path.join(ROOT, "python"))
        from megatronapp import memory, pretrain

        args = pretrain.build_parser().parse_args(
            flags + ["--no-progress", "--no-watchdog", "--log-interval", "1000000",
                     "--output-dir", os.path.join(os.path.dirname(a.out), "ours")])
        if args.memory_pool:  # before the process group's first allocation
            memory.use_pool("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
        summary = pretrain.train(args, callbacks=meter)
        history = summary["history"]
    else:
        sys.path.insert(0, HERE)
        import torch_native

        args = torch_native.build_parser().parse_args(flags)
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
        history = torch_native.train(args, callbacks=meter)["history"]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(a.out, "w") as f:
        json.dump({"rank": a.rank, "history": history, "peak_rss": peak_rss,
                   "net": meter.rows}, f)
    dist.destroy_process_group()


# ---- orchestration ----------------------------------------------------------------------

def run_config(topology, name, stack, flags, a, port) -> dict:
    out_dir = tempfile.mkdtemp(prefix="mapp_e2e_out_")
    procs = []
    for r, (ns, master, ifname) in enumerate(placement(topology)):
        cmd = ["ip", "netns", "exec", ns, sys.executable, __file__, "--worker", "--stack", stack,
               "--rank", str(r), "--master", master, "--port", str(port), "--ifname", ifname,
               "--out", os.path.join(out_dir, f"rank{r}.json")]
        if r == 0 or (topology == "two-node" and r == 2):  # one sampler per namespace
            cmd.append("--sample")
        procs.append(subprocess.Popen(cmd + ["--"] + flags, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    bad = [f"--- rank {r} (exit {p.returncode}) ---\n{o[-4000:]}"
           for r, (p, o) in enumerate(zip(procs, outs, strict=True)) if p.returncode != 0]
    if bad:
        raise SystemExit(f"{name} on {topology} failed:\n" + "\n".join(bad))
    ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(WORLD)]
    hist = ranks[0]["history"]
    times = [h["seconds"] for h in hist[a.warmup:]]
    net = [sum(vals) for vals in zip(*[[row["total"] for row in r["net"]]
                                        for r in ranks if r["net"]], strict=True)]
    cross = [sum(vals) for vals in zip(*[[row["cross"] for row in r["net"]]
                                          for r in ranks if r["net"]], strict=True)]
    evals = [(h["iteration"], h["train_seconds"], h["valid_loss"]) for h in hist
             if h.get("valid_loss") is not None]
    hit = next(((i, t) for i, t, v in evals if v <= a.target_loss), None)
    return {"name": name, "stack": stack, "flags": flags,
            "step_s": statistics.median(times),
            "tokens_per_s": a.tokens_per_iter / statistics.median(times),
            "bytes_per_step": statistics.median(net[a.warmup:]),
            "cross_bytes_per_step": statistics.median(cross[a.warmup:]),
            "peak_rss_mb": max(r["peak_rss"] for r in ranks) / 2**20,
            "evals": evals, "losses": [h["loss"] for h in hist],
            "steps_to_target": hit[0] if hit else None,
            "seconds_to_target": hit[1] if hit else None,
            "final_valid": evals[-1][2] if evals else None}


def merge_repeats(runs: list) -> dict:
    """One row from the repeats of a configuration: medians of the step time,
    bytes and time to target (None unless most repeats reached it), the
    largest peak memory; the first repeat's curve for the plot."""
    row = dict(runs[0])
    row["repeats"] = [{k: r[k] for k in ("step_s", "seconds_to_target", "steps_to_target")}
                      for r in runs]
    row["step_s"] = statistics.median(r["step_s"] for r in runs)
    row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
    for k in ("bytes_per_step", "cross_bytes_per_step"):
        row[k] = statistics.median(r[k] for r in runs)
    row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    reached = [r for r in runs if r["seconds_to_target"] is not None]
    if 2 * len(reached) > len(runs):
        row["seconds_to_target"] = statistics.median(r["seconds_to_target"] for r in reached)
        row["steps_to_target"] = statistics.median(r["steps_to_target"] for r in reached)
    else:
        row["seconds_to_target"] = row["steps_to_target"] = None
    return row


def report(topology, rows, a) -> str:
    torch_rows = [r for r in rows if r["stack"] == "torch"]
    best_tps = max(torch_rows, key=lambda r: r["tokens_per_s"])
    reached = [r for r in torch_rows if r["seconds_to_target"] is not None]
    best_cost = min(reached, key=lambda r: r["seconds_to_target"]) if reached else None
    lines = [f"### {topology}" + (f" ({a.rate} between nodes)" if topology == "two-node" else ""),
             "",
             f"Baseline = the best PyTorch-native configuration: `{best_tps['name']}` for "
             f"tokens/s" + (f", `{best_cost['name']}` for cost to validation loss "
                            f"{a.target_loss}" if best_cost else "") + ".",
             "",
             "| configuration | step s | tokens/s | vs baseline | steps to target | "
             "train s to target | cost vs baseline | peak RSS MB/rank | MB sent/step | "
             "MB across nodes/step | final valid loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cost = "-"
        if r["seconds_to_target"] is not None and best_cost:
            cost = f"{r['seconds_to_target'] / best_cost['seconds_to_target']:.2f}"
        secs = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
        lines.append(
            f"| {r['name']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / best_tps['tokens_per_s']:.2f}x | "
            f"{r['steps_to_target'] or 'not reached'} | {secs} | "
            f"{cost} | {r['peak_rss_mb']:.0f} | {r['bytes_per_step'] / 1e6:.2f} | "
            f"{r['cross_bytes_per_step'] / 1e6:.2f} | {r['final_valid']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, (topology, rows) in zip(axes[0], results.items(), strict=True):
        for r in rows:
            ax.plot([t for _, t, _ in r["evals"]], [v for _, _, v in r["evals"]], "o-" if
                    r["stack"] == "ours" else "s--", label=r["name"], markersize=3)
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("validation loss")
        ax.set_title(topology)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="loopback,two-node")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--iters", type=int, default=150)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every configuration N times, round-robin; report medians")
    p.add_argument("--target-loss", type=float, default=2.25)
    p.add_argument("--configs", default="torch-ddp,torch-powersgd,torch-pp,ours-dp,ours-dp-onebit,ours-pp",
                   help=f"comma-separated keys of {list(CONFIGS)}")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "e2e"))
    p.add_argument("--port", type=int, default=29810)
    p.add_argument("--timeout", type=float, default=3600)
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stack", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--ifname", help=argparse.SUPPRESS)
    p.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    flags = []
    if "--" in argv:
        i = argv.index("--")
        argv, flags = argv[:i], argv[i + 1:]
    a = p.parse_args(argv)
    if a.worker:
        worker(a, flags)
        return
    if os.geteuid() != 0:
        raise SystemExit("needs root: each topology runs in its own network namespaces (ip netns, "
                         "tc); run as root or in a container with CAP_NET_ADMIN")
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; choose from {list(CONFIGS)}")
    if a.iters <= a.warmup:
        raise SystemExit(f"--iters {a.iters} leaves no timed step after --warmup {a.warmup}")
    if a.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {a.repeats}")
    if not any(CONFIGS[n][0] == "torch" for n in names):
        raise SystemExit("--configs needs at least one PyTorch-native configuration (the baseline)")
    common = MODEL + ["--train-iters", str(a.iters), "--eval-interval", str(a.eval_interval),
                      "--eval-iters", str(a.eval_iters)]
    gbs = int(MODEL[MODEL.index("--global-batch-size") + 1])
    a.tokens_per_iter = gbs * int(MODEL[MODEL.index("--seq-length") + 1])
    os.makedirs(a.out, exist_ok=True)
    results = {}
    port = a.port
    for topology in [t.strip() for t in a.topology.split(",")]:
        if topology not in NS:
            raise SystemExit(f"unknown --topology {topology!r}; choose loopback or two-node")
        setup(topology, a.rate)
        runs = {name: [] for name in names}
        try:
            # Round-robin over the configurations, so that a drift of the
            # machine's speed during the benchmark hits every one alike.
            for _ in range(a.repeats):
                for name in names:
                    stack, label, flags = CONFIGS[name]
                    t0 = time.time()
                    runs[name].append(run_config(topology, label, stack, flags + common, a, port))
                    port += 1
                    r = runs[name][-1]
                    print(f"[e2e] {topology:9s} {label:44s} step {r['step_s']:.3f}s  "
                          f"{r['tokens_per_s']:.0f} tok/s  final valid {r['final_valid']:.3f}  "
                          f"({time.time() - t0:.0f}s)", flush=True)
        finally:
            teardown()
        results[topology] = [merge_repeats(runs[name]) for name in names]
    with open(os.path.join(a.out, "e2e.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(a).items() if not k.startswith("_")},
                   "model_flags": MODEL, "results": results}, f, indent=1)
    md = "".join(report(t, rows, a) + "\n" for t, rows in results.items())
    with open(os.path.join(a.out, "e2e.md"), "w") as f:
        f.write(md)
    plot(results, os.path.join(a.out, "e2e.png"))
    print(f"\nGPT {' '.join(MODEL)}; {a.iters} iterations, 4 ranks, validation every "
          f"{a.eval_interval}, target loss {a.target_loss}, {a.repeats} repeat(s): medians\n")
    print(md, end="")


if __name__ == "__main__":
    main()
