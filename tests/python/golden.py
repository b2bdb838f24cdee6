"""Golden runs: today's training, recorded bit for bit, so that moving an
engine algorithm (the reducer, ZeRO-1, gradient finishing, the pipeline
executor, the checkpoint engine) from one implementation to another can be
checked to change nothing at all (issue 44).

Each configuration trains a small GPT for 3 steps on warm Gloo ranks and
records, exactly (``float.hex``), every step's loss and global gradient norm,
and per rank the CRC-32 of its parameters and of its optimizer state (the
fp32 main values and moments of ZeRO-1 pieces, or a plain optimizer's state)
after the last step. The C++ trainer's configuration records its losses and
gradient norms (17 significant digits: a double read back exactly).

    python tests/python/golden.py            # records every configuration
    python tests/python/golden.py tp2-dp2    # records one

writes tests/python/data/golden_runs.json; ``test_golden.py`` reproduces
each entry and compares with ``==``. Every run uses the CPU kernels of
``CPU_NUMERICS`` (the test suite's conftest sets them for every test), so the
records hold on any x86 machine with AVX2. Re-record only for a change that is
meant to change numerics (a new seed stream, another reduction order), and
say so in the commit: the point of the file is that engine moves do not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PATH = os.path.join(HERE, "data", "golden_runs.json")
TRAIN_GPT = os.path.join(ROOT, "build", "py", "examples", "train_gpt")
STEPS = 3

#: the run, as both trainers take it
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", str(STEPS), "--seed", "3"]
#: pretrain_gpt.py only: no evaluation, progress bar, logging or watchdog
PYTHON_ONLY = ["--eval-iters", "0", "--no-progress", "--log-interval", "1000", "--no-watchdog"]
PP4 = ["--num-layers", "4"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]

#: name -> (world, flags after BASE); "cpp-" names run examples/cpp/train_gpt
CONFIGS = {
    "tp2-dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2-sp-dp2-int8-zero1": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--grad-compression", "int8", "--bucket-size-mb", "0.02",
                                  "--use-distributed-optimizer"]),
    "dp4-powersgd": (4, ["--grad-compression", "powersgd:2", "--bucket-size-mb", "0.05"]),
    "dp2-onebit-zero1-overlap-gather": (2, ["--grad-compression", "onebit",
                                            "--use-distributed-optimizer",
                                            "--overlap-param-gather"]),
    "tp2-dp2-bf16-zero1": (4, ["--tensor-model-parallel-size", "2", "--bf16",
                               "--use-distributed-optimizer"]),
    "dp2-fp16-scaler": (2, ["--fp16", "--initial-loss-scale", "65536"]),
    "ep2-dp2-moe": (4, ["--num-experts", "4", "--moe-router-topk", "2",
                        "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "1e-2"]),
    "tp2-cp2": (4, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]),
    "pp2-dp2-1f1b": (4, ["--pipeline-model-parallel-size", "2"]),
    "pp2-vp2-interleaved-zero1": (4, PP4 + ["--pipeline-model-parallel-size", "2",
                                            "--virtual-pipeline-model-parallel-size", "2",
                                            "--use-distributed-optimizer"]),
    "tp2-sp-pp2-gpipe": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                             "gpipe"]),
    "tp2-pp2-zero-bubble-recompute": (4, ["--tensor-model-parallel-size", "2",
                                          "--pipeline-model-parallel-size", "2",
                                          "--pipeline-schedule", "zero-bubble", *RECOMPUTE]),
    "pp2-zb-v": (2, PP4 + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                           "zb-v"]),
    "pp4-dynamic": (4, PP4 + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                              "dynamic", "--pipeline-dynamic-policy", "dfc"]),
    "tp2-selective-recompute": (2, ["--tensor-model-parallel-size", "2",
                                    "--recompute-granularity", "selective"]),
    "fbd-1to1": (4, PP4 + ["--pipeline-model-parallel-size", "2", *RECOMPUTE,
                           "--forward-backward-disaggregating", "--fbd-ratio", "1:1"]),
    "cpp-tp2-dp2": (4, ["--tensor-model-parallel-size", "2"]),
}


#: the CPU kernels every golden run uses, whatever the machine: ATen's AVX2
#: kernels, MKL's AVX2 code branch in strict mode (conditional numerical
#: reproducibility; strict also keeps a GEMM split into row pieces bit-identical
#: to the whole, which the TP-overlap tests need),
#: oneDNN capped at AVX2. Without them a machine with AVX-512 or AMX computes
#: other roundings (measured: every configuration differs).
CPU_NUMERICS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT",
                "ONEDNN_MAX_CPU_ISA": "AVX2"}


def pin_cpu_numerics() -> None:
    """Sets CPU_NUMERICS in this process's environment (rank processes and
    torchrun launches started afterwards inherit it); a value already set
    is kept."""
    for k, v in CPU_NUMERICS.items():
        os.environ.setdefault(k, v)


def _crc(tensors) -> str:
    import torch

    crc = 0
    for t in tensors:
        t = t.detach().contiguous().cpu()
        if t.numel():
            crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def _optimizer_tensors(optimizer) -> list:
    import torch

    if optimizer is None:  # an FBD forward rank holds weights only
        return []
    inner = optimizer
    shards = getattr(inner, "shards", None)
    out = []
    if callable(shards):  # MixedPrecisionOptimizer: fp32 main values and their state
        for sh in shards():
            out.append(sh.main)
            out += [t for _, t in sorted(sh.state.items()) if torch.is_tensor(t)]
        return out
    for group in inner.param_groups:
        for p in group["params"]:
            st = inner.state.get(p, {})
            out += [t for _, t in sorted(st.items()) if torch.is_tensor(t)]
    return out


def _python_body(rank, world, flags, out_dir):
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Hook, train

    seen = {}

    class Capture(Hook):
        def on_train_end(self, run):
            params = [p for c in run.chunks for _, p in getattr(c, "module", c).named_parameters()]
            seen["params"] = _crc(params)
            seen["optimizer"] = _crc(_optimizer_tensors(run.optimizer))

    s = train(build_parser().parse_args(BASE + PYTHON_ONLY + flags + ["--output-dir", out_dir]),
              hooks=[Capture()])
    return {"loss": [float(x).hex() for x in s["losses"]],
            "grad_norm": [float(h["grad_norm"]).hex() for h in s["history"]],
            "params": seen["params"], "optimizer": seen["optimizer"]}


def _cpp_run(world, flags, out_dir) -> dict:
    import csv

    from dist_harness import free_port
    from megatronapp.data import default_corpus

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "loss.csv")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                        str(world), "--master-addr", "127.0.0.1", "--master-port",
                        str(free_port()), "--no-python", TRAIN_GPT, *BASE, *flags,
                        "--data-path", default_corpus(), "--loss-csv", path],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise AssertionError(f"train_gpt failed:\n{p.stderr[-3000:]}")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {"loss": [float(r["loss"]).hex() for r in rows],
            "grad_norm": [float(r["grad_norm"]).hex() for r in rows]}


def run(name: str, out_dir: str) -> dict:
    """One configuration's record (every rank's, merged)."""
    from dist_harness import run_ranks

    world, flags = CONFIGS[name]
    if name.startswith("cpp-"):
        return _cpp_run(world, flags, out_dir)
    ranks = run_ranks(_python_body, world, flags, out_dir, timeout=300)
    first = ranks[0]
    return {"loss": first["loss"], "grad_norm": first["grad_norm"],
            "params": [r["params"] for r in ranks], "optimizer": [r["optimizer"] for r in ranks]}


def load() -> dict:
    with open(PATH) as f:
        return json.load(f)


def main(names) -> None:
    import tempfile

    import torch

    pin_cpu_numerics()
    data = load() if os.path.exists(PATH) else {}
    data["torch"] = torch.__version__
    data["cpu_numerics"] = {k: os.environ[k] for k in CPU_NUMERICS}
    runs = data.setdefault("runs", {})
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or list(CONFIGS):
            runs[name] = run(name, os.path.join(tmp, name))
            print(name, runs[name]["loss"], flush=True)
    with open(PATH, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main(sys.argv[1:])
