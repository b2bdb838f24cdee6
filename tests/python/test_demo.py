"""`make demo` as a newcomer runs it (the Makefile's own command line, a few
iterations): it trains on 4 ranks under torchrun and ends cleanly, without a
stack trace after the summary (c10d used to print a TCPStore 'Broken pipe'
when a rank's watchdog beat on a store whose host had already exited)."""

import os
import shlex
import subprocess

from dist_harness import assert_no_stack_trace, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_demo_trains_and_ends_without_a_stack_trace(tmp_path):
    out = tmp_path / "demo"
    cmd = subprocess.run(["make", "-s", "--no-print-directory", "demo-command", "DEMO_ITERS=6",
                          f"DEMO_PORT={free_port()}", f"DEMO_OUT={out}"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    p = subprocess.run(shlex.split(cmd), cwd=ROOT, capture_output=True, text=True, timeout=240)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    assert "done: 6 iterations" in text, text[-4000:]
    assert (out / "summary.json").exists()
    # what the README serves next (python -m megatronapp.serve --load runs/demo/ckpt)
    from megatronapp.inference import checkpoint_model_config

    cfg, path = checkpoint_model_config(str(out / "ckpt"))
    assert path.endswith("iter_0000006") and cfg.num_layers == 4
    assert_no_stack_trace(text, "make demo")
