"""Checkpoint throughput against torch.distributed.checkpoint, asynchronous
save blocking time, and crash safety under repeated SIGKILL.

    python benchmarks/checkpoint_bench.py [--kills 20]

1. The same state (a GPT of ~30M parameters + AdamW moments, one Gloo rank)
   saved and loaded by megatronapp.checkpoint and by torch.distributed.checkpoint
   (DCP) side by side, 3 repeats, median; MB/s of the bytes each writes. Our
   load with its CRC-32 checks (default) and without (verify=False).
2. The blocking time of save(async_save=True) (host snapshot) against the
   synchronous save.
3. `--kills` times: start a process saving checkpoints in a loop, SIGKILL it at
   a random moment, then load `latest` (checksums verified): it must always
   load.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))


def du(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from dist_harness import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=120))
    import torch.distributed.checkpoint as dcp

    import megatronapp as mapp
    from megatronapp import checkpoint
    from megatronapp.models import GPTConfig, GPTModel

    state = mapp.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=1024, hidden_size=512, num_layers=8, num_attention_heads=8,
                    seq_length=128)
    model = GPTModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 1024, (2, 128))
    model(x, x).mean().backward()
    opt.step()
    nparams = sum(p.numel() for p in model.parameters())
    tmp = tempfile.mkdtemp(prefix="mapp_ckpt_bench_")
    rows = {"ours": {"save": [], "load": []}, "dcp": {"save": [], "load": []}}
    no_crc = []  # our load without CRC verification
    sizes = {}
    try:
        for rep in range(args.repeats):
            d = os.path.join(tmp, f"ours{rep}")
            t0 = time.perf_counter()
            checkpoint.save(d, 1, [model], opt, parallel_state=state)
            rows["ours"]["save"].append(time.perf_counter() - t0)
            sizes["ours"] = du(d)
            t0 = time.perf_counter()
            checkpoint.load(d, [model], opt, parallel_state=state)
            rows["ours"]["load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            checkpoint.load(d, [model], opt, parallel_state=state, verify=False)
            no_crc.append(time.perf_counter() - t0)
            d = os.path.join(tmp, f"dcp{rep}")
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            t0 = time.perf_counter()
            dcp.save(sd, checkpoint_id=d)
            rows["dcp"]["save"].append(time.perf_counter() - t0)
            sizes["dcp"] = du(d)
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            t0 = time.perf_counter()
            dcp.load(sd, checkpoint_id=d)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            rows["dcp"]["load"].append(time.perf_counter() - t0)
        print(f"state: {nparams / 1e6:.1f}M parameters + AdamW moments; bytes written: ours "
              f"{sizes['ours'] / 1e6:.1f} MB, DCP {sizes['dcp'] / 1e6:.1f} MB")
        print(f"{'':6} {'save s':>8} {'save MB/s':>10} {'load s':>8} {'load MB/s':>10}")
        med = {}
        for k, r in rows.items():
            s, lo = statistics.median(r["save"]), statistics.median(r["load"])
            med[k] = (s, lo)
            print(f"{k:6} {s:8.3f} {sizes[k] / 1e6 / s:10.0f} {lo:8.3f} {sizes[k] / 1e6 / lo:10.0f}")
        print(f"DCP / ours time: save {med['dcp'][0] / med['ours'][0]:.2f}x, "
              f"load {med['dcp'][1] / med['ours'][1]:.2f}x (CRC-32 of every piece verified); "
              f"without verification: load {statistics.median(no_crc):.3f} s, "
              f"{med['dcp'][1] / statistics.median(no_crc):.2f}x")
        # 2. asynchronous save blocking time
        blocks, totals = [], []
        for rep in range(args.repeats):
            d = os.path.join(tmp, f"async{rep}")
            t0 = time.perf_counter()
            h = checkpoint.save(d, 1, [model], opt, parallel_state=state, async_save=True)
            blocks.append(time.perf_counter() - t0)
            h.wait()
            checkpoint.wait_pending()
            totals.append(time.perf_counter() - t0)
        print(f"async save: blocks {statistics.median(blocks) * 1e3:.0f} ms of "
              f"{statistics.median(totals) * 1e3:.0f} ms total (synchronous save "
              f"{med['ours'][0] * 1e3:.0f} ms)")
        # 3. crash safety
        rng = random.Random(0)
        ck = os.path.join(tmp, "crash")
        helper = os.path.join(ROOT, "tests", "python", "ckpt_writer.py")
        ok = committed = 0
        for _ in range(args.kills):
            p = subprocess.Popen([sys.executable, helper, ck, str(free_port())],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            p.stdout.readline()
            time.sleep(rng.uniform(0.2, 2.5))
            p.send_signal(signal.SIGKILL)
            p.wait()
            m2 = GPTModel(GPTConfig(vocab_size=256, hidden_size=256, num_layers=4,
                                    num_attention_heads=4, seq_length=64))
            o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
            info = checkpoint.load(ck, [m2], o2, parallel_state=state)  # raises if broken
            ok += 1
            committed += info is not None
        print(f"crash safety: {args.kills} SIGKILLs at random points; latest loaded and "
              f"verified {ok}/{args.kills} times ({committed} with a checkpoint present)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        mapp.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
