"""Side by side: megatronapp against the systems a user would pick instead.

    make peers                                          # the peers' own venv, once
    python benchmarks/peers/run.py                      # all stacks, both topologies (root)
    python benchmarks/peers/run.py --topology loopback --configs megatron-tp2-pp2,ours-pp
    python benchmarks/peers/run.py --smoke              # a few steps of every stack (no root)

Trains the same GPT (same weights, seeds, data order, global batch and
learning-rate schedule; ``common.py``) with 4 ranks on each stack and
configuration (CONFIGS in peer_configs.py), round-robin, --repeats times:

* ours — ``examples/pretrain_gpt.py``'s ``train()`` with its best settings for
  the topology, all chosen by flags;
* PyTorch at its best (``torch_native.py``): DDP, FSDP2 (``fully_shard``),
  DTensor TP, ``torch.distributed.pipelining`` with 1F1B and zero-bubble;
* DeepSpeed (``deepspeed_gpt.py``, in .venv-peers): ZeRO-1, ZeRO-2, and
  ``PipelineModule`` PP2 x DP2 with its 1F1B;
* Megatron-Core (``megatron_gpt.py``, in .venv-peers): its ``GPTModel`` with
  the local spec, TP2 x DP2 and TP2 x PP2 with its 1F1B and interleaved
  schedules.

Topologies, each in fresh network namespaces so the interface counters see
only this job's traffic:

* ``loopback`` — one "node": all 4 ranks in one namespace, talking over lo;
* ``two-node`` — two "nodes" of 2 ranks, each its own namespace, joined by a
  veth pair shaped with ``tc tbf`` to --rate (1 Gbit/s): the tensor group stays
  inside a node, the data / pipeline group crosses the link.

Per configuration (median and range over the repeats): step time (median after
--warmup), tokens/s, steps and training wall time (evaluation excluded) to
reach --target-loss on the validation split (evaluated every
--eval-interval), peak resident memory per rank, bytes sent per step over all
interfaces and across the node boundary, and cost to the target relative to
the best peer that reaches it (same rank count: cost ratio = time ratio). The
baseline is the best configuration of any other stack. The table is printed
last and written with a plot to --out (markdown, JSON, PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
import netns  # noqa: E402  (benchmarks/netns.py)
from peer_configs import (  # noqa: E402  (the configurations)
    BACKEND_FLAG,
    CONFIGS,
    ENV_FLAG,
    MODEL,
    PAIRS,
    SMOKE_MODEL,
    SUITE_MODEL,
    SUITE_SMOKE_MODEL,
    SUITES,
    backend_of,
    with_model,
)

WORLD = 4
NS = {"loopback": ["mapp_e2e_a"], "two-node": ["mapp_e2e_b0", "mapp_e2e_b1"]}
ADDR = ("10.78.0.1", "10.78.0.2")
VETH = ("mapp_e2e_v0", "mapp_e2e_v1")
PEERS_PYTHON = os.path.join(ROOT, ".venv-peers", "bin", "python")
# stack -> the trainer module in this directory (ours: pretrain_gpt's train()).
TRAINERS = {"torch": "torch_native", "deepspeed": "deepspeed_gpt", "megatron": "megatron_gpt"}
STACK_NAMES = {"ours": "ours", "torch": "PyTorch", "deepspeed": "DeepSpeed",
               "megatron": "Megatron-Core"}


PY_SPY = os.path.join(os.path.dirname(sys.executable), "py-spy")
PROFILE_HZ = 200
#: Megatron-Core's newest release, run from its sources (make peers unpacks its
#: wheel, tagged for Python 3.12, here); without it the pinned package
MEGATRON_SRC = os.path.join(ROOT, ".venv-peers", "megatron-core-src")


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
    """(namespace or None, master address, socket interface) per rank; Megatron
    order puts the tensor pairs (0, 1) and (2, 3) on one node each. ``here``:
    the caller's own namespace (--smoke: no root needed)."""
    if topology == "here":
        return [(None, "127.0.0.1", "lo")] * WORLD
    if topology == "loopback":
        return [(NS["loopback"][0], "127.0.0.1", "lo")] * WORLD
    return [(NS["two-node"][r // 2], ADDR[0], VETH[r // 2]) for r in range(WORLD)]


def megatron_version() -> str:
    """The Megatron-Core the megatron configurations import."""
    interpreter("megatron")
    r = subprocess.run([PEERS_PYTHON, "-c", "import megatron.core as m; print(m.__version__)"],
                       capture_output=True, text=True, env=os.environ)
    return r.stdout.strip() or f"unknown ({r.stderr.strip()[-200:]})"


def interpreter(stack: str) -> str:
    if stack in ("deepspeed", "megatron"):
        if stack == "megatron" and os.path.isdir(MEGATRON_SRC):
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [MEGATRON_SRC] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                  if p and p != MEGATRON_SRC])
        if not os.path.exists(PEERS_PYTHON):
            raise SystemExit(f"{STACK_NAMES[stack]} runs in the peers' environment "
                             f"{PEERS_PYTHON}, which does not exist: run `make peers` first")
        return PEERS_PYTHON
    return sys.executable


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


def _train_one(stack: str, flags: list, out_dir: str, meter) -> list:
    if stack == "ours":
        from megatronapp import pretrain

        args = pretrain.build_parser().parse_args(
            flags + ["--no-progress", "--no-watchdog", "--log-interval", "1000000",
                     "--output-dir", os.path.join(out_dir, "ours")])
        return pretrain.train(args, callbacks=meter)["history"]
    import importlib

    trainer = importlib.import_module(TRAINERS[stack])
    return trainer.train(trainer.build_parser().parse_args(flags), callbacks=meter)["history"]




def worker(a, runs: list) -> None:
    """Trains each (stack, flags) of ``runs`` in turn in this process (one run
    per process when timing; --smoke shares the start-up among a stack's runs)."""
    os.environ.update(RANK=str(a.rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(a.rank % 2),
                      MASTER_ADDR=a.master, MASTER_PORT=str(a.port),
                      GLOO_SOCKET_IFNAME=a.ifname, OMP_NUM_THREADS="1")
    from datetime import timedelta

    import torch.distributed as dist

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    backends = {backend_of(flags) for _, flags in runs}
    if len(backends) != 1:
        raise SystemExit(f"one launch runs on one c10d backend, got {sorted(backends)}")
    backend = backends.pop()
    if any(stack == "ours" and "--memory-pool" in flags for stack, flags in runs):
        from megatronapp import memory

        memory.use_pool("cpu")  # before the process group's first allocation
    if backend == "mapp":  # (the peers' venv sees .venv's packages through a .pth)
        import megatronapp  # noqa: F401  (registers "mapp")
    dist.init_process_group(backend, timeout=timedelta(seconds=600))
    results = []
    for stack, flags in runs:
        env = dict(f[len(ENV_FLAG):].split("=", 1) for f in flags if f.startswith(ENV_FLAG))
        flags = [f for f in flags if not f.startswith((ENV_FLAG, BACKEND_FLAG))]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        meter = Meter(sample=a.sample)
        history = _train_one(stack, flags, os.path.dirname(a.out), meter)
        results.append({"history": history, "net": meter.rows})
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(a.out, "w") as f:
        json.dump({"rank": a.rank, "runs": results, "peak_rss": peak_rss}, f)
    dist.destroy_process_group()


# ---- orchestration ----------------------------------------------------------------------

def launch(topology, stack, runs, a, port, what, profile_dir=None) -> list:
    """Starts the 4 ranks of ``runs`` (all of one stack) and returns each rank's
    results. With `profile_dir`, each rank runs under py-spy, which writes its
    samples to ``profile_dir/rank<r>.txt``."""
    out_dir = tempfile.mkdtemp(prefix="mapp_peers_out_")
    spec = os.path.join(out_dir, "runs.json")
    with open(spec, "w") as f:
        json.dump(runs, f)
    procs = []
    for r, (ns, master, ifname) in enumerate(placement(topology)):
        spy = [] if not profile_dir else [
            PY_SPY, "record", "--format", "raw", "--rate", str(PROFILE_HZ), "--idle",
            "--nonblocking", "--output", os.path.join(profile_dir, f"rank{r}.txt"), "--"]
        cmd = ([] if ns is None else ["ip", "netns", "exec", ns]) + spy + [
            interpreter(stack), __file__, "--worker", "--runs", spec, "--rank", str(r),
            "--master", master, "--port", str(port), "--ifname", ifname,
            "--out", os.path.join(out_dir, f"rank{r}.json")]
        if r == 0 or (topology == "two-node" and r == 2):  # one sampler per namespace
            cmd.append("--sample")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, cwd=ROOT))
    try:
        outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [f"--- rank {r} (exit {p.returncode}) ---\n{o[-4000:]}"
           for r, (p, o) in enumerate(zip(procs, outs, strict=True)) if p.returncode != 0]
    if bad:
        raise SystemExit(f"{what} on {topology} failed:\n" + "\n".join(bad))
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(WORLD)]


def summarize(name, key, ranks, i, a) -> dict:
    """The row of run ``i`` of the launch's per-rank results."""
    stack = CONFIGS[key][0]
    hist = ranks[0]["runs"][i]["history"]
    times = [h["seconds"] for h in hist[a.warmup:]]
    nets = [r["runs"][i]["net"] for r in ranks if r["runs"][i]["net"]]
    net = [sum(v) for v in zip(*[[row["total"] for row in n] for n in nets], strict=True)]
    cross = [sum(v) for v in zip(*[[row["cross"] for row in n] for n in nets], strict=True)]
    evals = [(h["iteration"], h["train_seconds"], h["valid_loss"]) for h in hist
             if h.get("valid_loss") is not None]
    hit = next(((it, t) for it, t, v in evals if v <= a.target_loss), None)
    return {"key": key, "name": name, "stack": stack, "flags": CONFIGS[key][2],
            "step_s": statistics.median(times),
            "tokens_per_s": a.tokens_per_iter / statistics.median(times),
            "bytes_per_step": statistics.median(net[a.warmup:]) if net else 0,
            "cross_bytes_per_step": statistics.median(cross[a.warmup:]) if cross else 0,
            "peak_rss_mb": max(r["peak_rss"] for r in ranks) / 2**20,
            "evals": evals, "losses": [h["loss"] for h in hist],
            "steps_to_target": hit[0] if hit else None,
            "seconds_to_target": hit[1] if hit else None,
            "final_valid": evals[-1][2] if evals else None}


def merge_repeats(runs: list) -> dict:
    """One row from the repeats of a configuration: medians (and ranges) of the
    step time, bytes and time to target (None unless most repeats reached it),
    the largest peak memory; the first repeat's curve for the plot."""
    row = dict(runs[0])
    row["repeats"] = [{k: r[k] for k in ("step_s", "seconds_to_target", "steps_to_target")}
                      for r in runs]
    steps = [r["step_s"] for r in runs]
    row["step_s"] = statistics.median(steps)
    row["step_range"] = (min(steps), max(steps))
    row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
    for k in ("bytes_per_step", "cross_bytes_per_step"):
        row[k] = statistics.median(r[k] for r in runs)
    row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    reached = [r for r in runs if r["seconds_to_target"] is not None]
    if 2 * len(reached) > len(runs):
        row["seconds_to_target"] = statistics.median(r["seconds_to_target"] for r in reached)
        row["steps_to_target"] = statistics.median(r["steps_to_target"] for r in reached)
        secs = [r["seconds_to_target"] for r in reached]
        row["target_range"] = (min(secs), max(secs))
    else:
        row["seconds_to_target"] = row["steps_to_target"] = None
    return row


def estimate_targets(rows, convergence: dict) -> None:
    """Runs too short to reach the target: time to target = the steps to target
    of a longer run (``convergence``: key -> steps; the numerics depend neither
    on the topology nor on the repeat) x this run's median step time. An exact
    configuration without a longer run of its own takes the exact ones' steps:
    they train the same function step by step (tests/python/test_peers.py)."""
    exact = [s for k, s in convergence.items() if CONFIGS[k][3]]
    for r in rows:
        steps = convergence.get(r["key"]) or (max(exact) if exact and CONFIGS[r["key"]][3]
                                              else None)
        if r["seconds_to_target"] is None and steps:
            r["steps_to_target"] = steps
            r["seconds_to_target"] = steps * r["step_s"]
            r["target_range"] = (steps * r["step_range"][0], steps * r["step_range"][1])
            r["target_estimated"] = True


def trace_phases(topology, key, a, port) -> dict:
    """One extra, traced run of our configuration ``key`` (not timed: tracing
    costs a little): where each rank's step goes, by our tracer's phases."""
    from megatronapp.trace.phases import breakdown_dir

    trace_dir = tempfile.mkdtemp(prefix="mapp_peers_trace_")
    stack, label, flags, _ = CONFIGS[key]
    launch(topology, stack, [(stack, with_model(flags, a.model + a.run_flags + [
        "--train-iters", str(a.phase_iters), "--eval-interval", "0", "--trace",
        "--trace-dir", trace_dir]))], a, port, f"{label} (traced)")
    rows = breakdown_dir(trace_dir, skip=2)
    return {str(r): row for r, row in rows.items()}


def profile_phases(topology, key, a, port) -> dict:
    """One extra run of configuration ``key`` (any stack) under py-spy: the
    step split into spy_phases.PHASES the same way for every stack (rank ->
    ms per iteration, and the mean over ranks)."""
    import spy_phases

    spy_dir = tempfile.mkdtemp(prefix="mapp_peers_spy_")
    stack, label, flags, _ = CONFIGS[key]
    ranks = launch(topology, stack, [(stack, with_model(flags, a.model + a.run_flags + [
        "--train-iters", str(a.profile_iters), "--eval-interval", "0"]))], a, port,
        f"{label} (profiled)", profile_dir=spy_dir)
    hist = ranks[0]["runs"][0]["history"]
    step_ms = 1e3 * statistics.fmean(h["seconds"] for h in hist)
    return spy_phases.breakdown_dir(spy_dir, step_ms)


def format_profiles(topology, profiles: dict) -> str:
    """The mean-over-ranks profile of every configuration, then ours minus
    theirs for each like-for-like pair (PAIRS) that ran."""
    from spy_phases import PHASES

    if not profiles:
        return ""
    head = "| " + " | ".join(PHASES) + " |"
    lines = [f"#### Where each stack's step goes ({topology}; py-spy at {PROFILE_HZ} Hz on "
             "every rank, ms per iteration, mean over the ranks, a separate profiled run)", "",
             "| configuration | step ms " + head, "|---" * (len(PHASES) + 2) + "|"]
    for key, rows in profiles.items():
        m = rows["mean"]
        lines.append(f"| {CONFIGS[key][1]} | {m['step']:.0f} | "
                     + " | ".join(f"{m[p]:.0f}" for p in PHASES) + " |")
    pairs = [(o, t) for o, t in PAIRS if o in profiles and t in profiles]
    if pairs:
        lines += ["", "Ours minus the peer, per phase (ms per iteration; negative = "
                  "ours faster):", "", "| pair | step " + head,
                  "|---" * (len(PHASES) + 2) + "|"]
        for o, t in pairs:
            mo, mt = profiles[o]["mean"], profiles[t]["mean"]
            lines.append(f"| {o} - {t} | {mo['step'] - mt['step']:+.0f} | "
                         + " | ".join(f"{mo[p] - mt[p]:+.0f}" for p in PHASES) + " |")
    return "\n".join(lines) + "\n"


def format_phases(topology, phases: dict) -> str:
    from megatronapp.trace.phases import PHASES

    if not phases:
        return ""
    lines = [f"#### Where our step goes ({topology}; our tracer, mean ms per iteration, "
             "iterations 3+ of a separate traced run; compute share = compute / iteration)", "",
             "| configuration | rank | iteration | " + " | ".join(PHASES) + " | compute share |",
             "|---" * (len(PHASES) + 4) + "|"]
    for key, ranks in phases.items():
        for rank, row in ranks.items():
            lines.append(f"| {CONFIGS[key][1]} | {rank} | {row['iteration']:.0f} | "
                         + " | ".join(f"{row[p]:.0f}" for p in PHASES)
                         + f" | {100 * _compute_share(row):.0f}% |")
    return "\n".join(lines) + "\n"


def _fmt_range(v, rng, digits):
    if rng is None or rng[0] == rng[1]:
        return f"{v:.{digits}f}"
    return f"{v:.{digits}f} ({rng[0]:.{digits}f}–{rng[1]:.{digits}f})"


def transport(key: str) -> str:
    """How configuration ``key`` moves its collectives: "mapp" (every group on the
    mapp c10d backend), "shm" (ours on its own groups: the same shared-memory
    collectives as mapp, send/recv on Gloo as mapp does) or "gloo"."""
    stack, _, flags, _ = CONFIGS[key]
    if backend_of(flags) == "mapp":
        return "mapp"
    if stack == "ours" and ENV_FLAG + "MAPP_SHM_COLLECTIVES=0" not in flags:
        return "shm"
    return "gloo"


# (title, our transports, the peers' transports) of the report's comparisons.
COMPARISONS = [
    ("same transport (shared memory: the peers on the mapp backend)", ("mapp", "shm"), ("mapp",)),
    ("same transport (Gloo for every stack)", ("gloo",), ("gloo",)),
    ("each at its best (any transport)", ("mapp", "shm", "gloo"), ("mapp", "gloo")),
]
# Like for like on the same transport: ours, Megatron-Core's.
LIKE_FOR_LIKE = [("ours-pp-1f1b-mapp", "megatron-tp2-pp2-mapp"),
                 ("ours-pp-1f1b-gloo", "megatron-tp2-pp2"), ("ours-pp4", "megatron-pp4-mapp")]


def comparisons(rows) -> list:
    """The report's headline ratios: (title, our best row, the best peer row,
    ratio of tokens/s) for each of COMPARISONS whose sides both ran, then the
    like-for-like pairs."""
    out = []
    for title, ours_t, peers_t in COMPARISONS:
        o = [r for r in rows if r["stack"] == "ours" and transport(r["key"]) in ours_t]
        t = [r for r in rows if r["stack"] != "ours" and transport(r["key"]) in peers_t]
        if o and t:
            bo = max(o, key=lambda r: r["tokens_per_s"])
            bt = max(t, key=lambda r: r["tokens_per_s"])
            out.append((title, bo, bt, bo["tokens_per_s"] / bt["tokens_per_s"]))
    by_key = {r["key"]: r for r in rows}
    for o, t in LIKE_FOR_LIKE:
        if o in by_key and t in by_key:
            out.append((f"like for like, {transport(t)}", by_key[o], by_key[t],
                        by_key[o]["tokens_per_s"] / by_key[t]["tokens_per_s"]))
    return out


def compute_shares(phases: dict, profiles: dict) -> dict:
    """key -> compute as a share of the step: our tracer's (mean over ranks of
    compute / iteration) for ours, else py-spy's (compute / step)."""
    out = {}
    for key, prof in profiles.items():
        out[key] = prof["mean"]["compute"] / prof["mean"]["step"]
    for key, ranks in phases.items():
        out[key] = statistics.fmean(_compute_share(r) for r in ranks.values())
    return out


def _compute_share(row: dict) -> float:
    """Compute / iteration of one rank's row of our tracer's phases."""
    return row["compute"] / row["iteration"]


def report(topology, rows, a, shares=None) -> str:
    peers = [r for r in rows if r["stack"] != "ours"]
    best_tps = max(peers, key=lambda r: r["tokens_per_s"])
    reached = [r for r in peers if r["seconds_to_target"] is not None]
    best_cost = min(reached, key=lambda r: r["seconds_to_target"]) if reached else None
    ours = [r for r in rows if r["stack"] == "ours"]
    lines = [f"### {topology}" + (f" ({a.rate} between nodes)" if topology == "two-node" else ""),
             "",
             f"Baseline = the best peer: `{best_tps['name']}` for tokens/s"
             + (f", `{best_cost['name']}` for cost to validation loss {a.target_loss}"
                if best_cost else "") + ".",
             "",
             "| configuration | step s (range) | tokens/s | vs baseline | steps to target | "
             "train s to target (range) | cost vs baseline | peak RSS MB/rank | MB sent/step | "
             "MB across nodes/step | final valid loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cost = "-"
        if r["seconds_to_target"] is not None and best_cost:
            cost = f"{r['seconds_to_target'] / best_cost['seconds_to_target']:.2f}"
        secs = "-" if r["seconds_to_target"] is None else (
            _fmt_range(r["seconds_to_target"], r.get("target_range"), 1)
            + (" est." if r.get("target_estimated") else ""))
        final = "-" if r["final_valid"] is None else f"{r['final_valid']:.3f}"
        lines.append(
            f"| {r['name']} | {_fmt_range(r['step_s'], r.get('step_range'), 3)} | "
            f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / best_tps['tokens_per_s']:.2f}x | "
            f"{r['steps_to_target'] or 'not reached'} | {secs} | "
            f"{cost} | {r['peak_rss_mb']:.0f} | {r['bytes_per_step'] / 1e6:.2f} | "
            f"{r['cross_bytes_per_step'] / 1e6:.2f} | {final} |")
    if ours:
        best = max(ours, key=lambda r: r["tokens_per_s"])
        lines += ["", f"Ours at best (`{best['name']}`): "
                  f"{best['tokens_per_s'] / best_tps['tokens_per_s']:.2f}x the best peer's "
                  f"tokens/s"]
        fastest = [r for r in ours if r["seconds_to_target"] is not None]
        if fastest and best_cost:
            f = min(fastest, key=lambda r: r["seconds_to_target"])
            lines[-1] += (f"; cost to target {f['seconds_to_target'] / best_cost['seconds_to_target']:.2f}"
                          f" (`{f['name']}`)")
        lines[-1] += "."
    table = comparisons(rows)
    if table:
        shares = shares or {}

        def share(r):
            return f"{100 * shares[r['key']]:.0f}%" if r["key"] in shares else "-"
        lines += ["", "| comparison | ours | step s | compute share | peer | step s | "
                  "compute share | ours vs peer |", "|---|---|---|---|---|---|---|---|"]
        for title, o, t, ratio in table:
            lines.append(f"| {title} | {o['name']} | {o['step_s']:.3f} | {share(o)} | "
                         f"{t['name']} | {t['step_s']:.3f} | {share(t)} | **{ratio:.2f}x** |")
    return "\n".join(lines) + "\n"


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(8 * len(results), 5), squeeze=False)
    for ax, (topology, rows) in zip(axes[0], results.items(), strict=True):
        for r in rows:
            ax.plot([t for _, t, _ in r["evals"]], [v for _, _, v in r["evals"]], "o-" if
                    r["stack"] == "ours" else "s--", label=r["name"], markersize=3)
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("validation loss")
        ax.set_title(topology)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def smoke(names, a) -> int:
    """A few steps of every configuration, one launch per stack, in this
    namespace; checks that the stacks compute the same function: every exact
    configuration's losses equal the first exact one's, step by step (1e-3),
    and every first loss agrees (lossy codecs start later). Prints JSON."""
    common = SUITE_SMOKE_MODEL.get(a.suite, SMOKE_MODEL) + [
        "--train-iters", str(a.iters), "--eval-interval", str(a.iters), "--eval-iters", "1",
        "--optimizer-impl", a.optimizer_impl]
    by_stack = {}
    for n in names:  # one launch per stack and c10d backend
        by_stack.setdefault((CONFIGS[n][0], backend_of(CONFIGS[n][2])), []).append(n)
    losses, port, t0 = {}, a.port, time.time()
    for (stack, _), keys in by_stack.items():
        t = time.time()
        if a.port == 0:  # a fixed port may be taken on a busy machine (CI)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        ranks = launch("here", stack, [(stack, with_model(CONFIGS[k][2], common)) for k in keys],
                       a, port,
                       f"smoke {stack}")
        port += 1
        for i, k in enumerate(keys):
            hist = ranks[0]["runs"][i]["history"]
            losses[k] = [h["loss"] for h in hist] + [hist[-1]["valid_loss"]]
        print(f"[smoke] {STACK_NAMES[stack]:14s} {len(keys)} configuration(s) "
              f"{time.time() - t:.0f}s", flush=True)
    exact = [k for k in names if CONFIGS[k][3]]
    ref = exact[0] if exact else names[0]
    bad = []
    for k in names:
        for s, (x, y) in enumerate(zip(losses[ref], losses[k], strict=True)):
            if (CONFIGS[k][3] or s == 0) and abs(x - y) > 1e-3:
                bad.append(f"{k} step {s + 1}: {y:.6f} vs {ref} {x:.6f}")
    print(json.dumps({"losses": losses, "reference": ref, "mismatches": bad,
                      "seconds": time.time() - t0}))
    return 1 if bad else 0


def run_repeats(topology, names, common, a, port):
    """``a.repeats`` timed runs of every configuration, round-robin (so that a
    drift of the machine's speed hits every one alike). Returns (name -> the
    rows of its repeats, the next free port)."""
    runs = {name: [] for name in names}
    for rep in range(a.repeats):
        for name in names:
            stack, label, flags, _ = CONFIGS[name]
            t0 = time.time()
            ranks = launch(topology, stack, [(stack, with_model(flags, common))], a, port, label)
            port += 1
            r = summarize(label, name, ranks, 0, a)
            runs[name].append(r)
            final = "-" if r["final_valid"] is None else f"{r['final_valid']:.3f}"
            print(f"[peers] {topology:9s} #{rep + 1} {label:52s} step {r['step_s']:.3f}s"
                  f"  {r['tokens_per_s']:.0f} tok/s  final valid {final}  "
                  f"({time.time() - t0:.0f}s)", flush=True)
    return runs, port


def main(argv=None, suite="peers", out=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default=suite, choices=list(SUITES),
                   help="the default --configs and the name of the outputs (step: ours "
                        "against Megatron-Core, make bench-step)")
    p.add_argument("--topology", default="loopback,two-node")
    p.add_argument("--optimizer-impl", default="torch", choices=("torch", "fused"),
                   help="every stack's AdamW: torch's default loop, or fused (torch's "
                        "fused=True for the peers, megatronapp's FusedAdamW for ours)")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--iters", type=int, default=150)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3,
                   help="run every configuration N times, round-robin; report medians and ranges")
    p.add_argument("--target-loss", type=float, default=2.25)
    p.add_argument("--configs", default=None,
                   help=f"comma-separated keys of {list(CONFIGS)} (default: the suite's)")
    p.add_argument("--convergence", default=None, metavar="JSON",
                   help="a longer run's results (peers.json): configurations that do not reach "
                        "the target in --iters take its steps to target x their step time")
    p.add_argument("--smoke", action="store_true",
                   help="a few steps (--iters, default 3) of every configuration on a tiny "
                        "model, in this namespace; checks that the stacks agree")
    p.add_argument("--phase-iters", type=int, default=12,
                   help="iterations of the traced run of each of our configurations per "
                        "topology (0: none)")
    p.add_argument("--profile-iters", type=int, default=0,
                   help="iterations of one more run of every configuration per topology under "
                        "py-spy, whose step is split into phases the same way for every stack "
                        "(spy_phases.py; 0: none)")
    p.add_argument("--out", default=out, help="results directory (default "
                   "benchmarks/results/<suite>)")
    p.add_argument("--port", type=int, default=29810,
                   help="first rendezvous port (one more per launch); --smoke with 0: a free "
                        "loopback port for every launch")
    p.add_argument("--timeout", type=float, default=3600)
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--runs", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--ifname", help=argparse.SUPPRESS)
    p.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a, json.load(open(a.runs)))
        return
    suite = a.suite
    a.model = SUITE_MODEL.get(suite, MODEL)
    a.out = a.out or os.path.join(ROOT, "benchmarks", "results", suite)
    a.configs = a.configs or ",".join(SUITES[suite])
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; choose from {list(CONFIGS)}")
    if a.smoke:
        if "--iters" not in (argv or sys.argv[1:]):
            a.iters = 3
        raise SystemExit(smoke(names, a))
    if os.geteuid() != 0:
        raise SystemExit("needs root: each topology runs in its own network namespaces (ip netns, "
                         "tc); run as root or in a container with CAP_NET_ADMIN")
    if a.iters <= a.warmup:
        raise SystemExit(f"--iters {a.iters} leaves no timed step after --warmup {a.warmup}")
    if a.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {a.repeats}")
    if not any(CONFIGS[n][0] != "ours" for n in names):
        raise SystemExit("--configs needs at least one peer configuration (the baseline)")
    for n in names:
        interpreter(CONFIGS[n][0])  # a missing peers' environment fails now, not an hour in
    if a.profile_iters and not os.path.exists(PY_SPY):
        raise SystemExit(f"--profile-iters needs py-spy ({PY_SPY}): pip install py-spy "
                         "(make build installs it)")
    convergence = {}
    if a.convergence:
        prior = json.load(open(a.convergence))["results"]
        for rows in prior.values():
            for r in rows:
                if r.get("steps_to_target") and not r.get("target_estimated"):
                    convergence.setdefault(r["key"], r["steps_to_target"])
    model = a.model
    # What every run of a configuration gets besides the model: the timed, the traced
    # and the profiled ones alike.
    a.run_flags = ["--optimizer-impl", a.optimizer_impl]
    common = model + a.run_flags + ["--train-iters", str(a.iters), "--eval-interval",
                                    str(a.eval_interval), "--eval-iters", str(a.eval_iters)]
    gbs = int(model[model.index("--global-batch-size") + 1])
    a.tokens_per_iter = gbs * int(model[model.index("--seq-length") + 1])
    os.makedirs(a.out, exist_ok=True)
    results, phases, profiles = {}, {}, {}
    port = a.port
    for topology in [t.strip() for t in a.topology.split(",")]:
        if topology not in NS:
            raise SystemExit(f"unknown --topology {topology!r}; choose loopback or two-node")
        setup(topology, a.rate)
        try:
            runs, port = run_repeats(topology, names, common, a, port)
            if a.phase_iters:
                for name in names:
                    if CONFIGS[name][0] == "ours":
                        phases.setdefault(topology, {})[name] = trace_phases(topology, name, a,
                                                                              port)
                        port += 1
            if a.profile_iters:
                for name in names:
                    profiles.setdefault(topology, {})[name] = profile_phases(topology, name, a,
                                                                             port)
                    port += 1
        finally:
            teardown()
        results[topology] = [merge_repeats(runs[name]) for name in names]
        estimate_targets(results[topology], convergence)
        # Written after every topology: a failure in the next one keeps this one's.
        md = write_outputs(os.path.join(a.out, suite), a, model, results, phases, profiles)
    print(f"\nMegatron-Core {megatron_version()}")
    print(f"\nGPT {' '.join(model)}; {a.iters} iterations, 4 ranks, validation every "
          f"{a.eval_interval}, target loss {a.target_loss}, {a.repeats} repeat(s): medians\n")
    print(md, end="")


def write_outputs(stem, a, model, results, phases, profiles) -> str:
    """<stem>.json, .md and .png of the topologies run so far; returns the markdown."""
    with open(stem + ".json", "w") as f:
        json.dump({"args": {k: v for k, v in vars(a).items() if not k.startswith("_")},
                   "model_flags": model, "date": time.strftime("%Y-%m-%d %H:%M"),
                   "megatron_core": megatron_version(),
                   "results": results, "phases": phases, "profiles": profiles}, f, indent=1)
    md = "".join(report(t, rows, a, compute_shares(phases.get(t, {}), profiles.get(t, {})))
                 + "\n" + format_phases(t, phases.get(t, {})) + "\n"
                 + format_profiles(t, profiles.get(t, {})) + "\n"
                 for t, rows in results.items())
    with open(stem + ".md", "w") as f:
        f.write(md)
    plot(results, stem + ".png")
    return md


if __name__ == "__main__":
    main()
