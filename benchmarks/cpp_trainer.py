"""The C++ trainer against the Python trainer on the same GPT, side by side.

    python benchmarks/cpp_trainer.py [--iters 30] [--repeats 3]

Runs examples/cpp/train_gpt.cc (torchrun --no-python) and
examples/pretrain_gpt.py with the same flags, round-robin, on 4 CPU ranks
(TP2 x DP2 exact and with int8 + ZeRO-1, TP4, and TP2 x PP2 with 1F1B and
zero-bubble), alternating which trainer goes first, and reports the median
step time of iterations 2.. of each run (the loss of both must agree: it is
the same training). ``--layouts`` picks some by name.
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_GPT = os.path.join(ROOT, "build", "py", "examples", "train_gpt")
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--lr", "3e-3", "--lr-warmup-iters", "2"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(_port()), *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")


def _read(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [float(r["seconds"]) for r in rows[1:]], float(rows[-1]["loss"])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layouts", default=None,
                   help="comma-separated subset: tp2-dp2, tp2-dp2-int8-zero1, tp4, "
                        "tp2-pp2-1f1b, tp2-pp2-zero-bubble")
    a = p.parse_args()
    from megatronapp.data import default_corpus

    layouts = {"TP2 x DP2": ["--tensor-model-parallel-size", "2"],
               "TP2 x DP2, int8, ZeRO-1": ["--tensor-model-parallel-size", "2",
                                           "--grad-compression", "int8",
                                           "--use-distributed-optimizer"],
               "TP4": ["--tensor-model-parallel-size", "4"],
               "TP2 x PP2, 1F1B": ["--tensor-model-parallel-size", "2",
                                   "--pipeline-model-parallel-size", "2"],
               "TP2 x PP2, zero-bubble": ["--tensor-model-parallel-size", "2",
                                          "--pipeline-model-parallel-size", "2",
                                          "--pipeline-schedule", "zero-bubble"]}
    keys = dict(zip(["tp2-dp2", "tp2-dp2-int8-zero1", "tp4", "tp2-pp2-1f1b",
                     "tp2-pp2-zero-bubble"], layouts, strict=True))
    if a.layouts:
        unknown = [k for k in a.layouts.split(",") if k not in keys]
        if unknown:
            raise SystemExit(f"--layouts: unknown {unknown}; choose from {', '.join(keys)}")
        layouts = {keys[k]: layouts[keys[k]] for k in a.layouts.split(",")}
    print(f"GPT 4 layers, hidden 256, 8 heads, sequence 128, global batch 16, 4 CPU ranks, "
          f"{a.iters} iterations, {a.repeats} repeats (median step of iterations 2..):")
    print(f"{'layout':<24} {'python s/step':>14} {'c++ s/step':>11} {'c++ vs python':>14} "
          f"{'final loss py / c++':>22}")
    for name, flags in layouts.items():
        common = MODEL + flags + ["--train-iters", str(a.iters), "--data-path", default_corpus()]
        py, cc, losses = [], [], None
        for r in range(a.repeats):
            d = tempfile.mkdtemp()
            runs = [[os.path.join(ROOT, "examples", "pretrain_gpt.py"), *common, "--no-progress",
                     "--eval-iters", "0", "--log-interval", "1000", "--output-dir", d + "/py"],
                    ["--no-python", TRAIN_GPT, *common, "--log-interval", "1000",
                     "--loss-csv", d + "/cpp.csv"]]
            for argv in (runs if r % 2 == 0 else runs[::-1]):  # alternate who goes first
                _run(argv)
            (s_py, l_py), (s_cc, l_cc) = _read(d + "/py/loss.csv"), _read(d + "/cpp.csv")
            py.append(statistics.median(s_py))
            cc.append(statistics.median(s_cc))
            losses = (l_py, l_cc)
        mp, mc = statistics.median(py), statistics.median(cc)
        print(f"{name:<24} {mp:>14.4f} {mc:>11.4f} {mp / mc:>13.2f}x "
              f"{losses[0]:>10.5f} / {losses[1]:.5f}")


if __name__ == "__main__":
    main()
