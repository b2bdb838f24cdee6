"""Run a function on N real Gloo ranks (spawned processes) and collect results.

`run_ranks(fn, world_size, *args)` starts `world_size` processes, each calling
`torch.distributed.init_process_group("gloo")` on a fresh loopback port and then
`fn(rank, world_size, *args)`. It returns the per-rank return values, or raises
with every failing rank's traceback. A rank that hangs is killed after
`timeout` seconds and the call fails, so a test can never block CI.

`train_variants` (run on every rank) trains the same model under several
command-line variants; `assert_variants_identical` checks that every variant's
losses, gradients and weights equal the first one's exactly.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue):
    import torch.distributed as dist

    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=world_size, timeout=timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        # Serialize here: a tensor sent through the queue would share memory
        # with this process, which exits right after.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report everything, including assertion failures
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import megatronapp

            megatronapp.destroy_model_parallel()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
            if errors:
                break  # one failure: the others may wait forever on it
    except Exception as e:  # queue.Empty: somebody hung
        errors[-1] = f"timed out after {timeout}s waiting for ranks ({e!r})"
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


def train_variants(rank, world, flags, variants: dict, out_dir, iters: int = 2):
    """`iters` iterations of pretrain_gpt with `flags` + each variant's flags
    (name -> list), from the same start: per variant the losses, the
    gradients of the last iteration and the weights after it."""
    import megatronapp
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, build_run, train_step

    out = {}
    for name, extra in variants.items():
        args = build_parser().parse_args(flags + extra + ["--output-dir", out_dir])
        run = build_run(Config.from_args(args))
        losses = [train_step(run, it).loss for it in range(iters)]
        grads, params = [], []
        for c in run.chunks:
            for p in c.module.parameters():
                g = getattr(p, "main_grad", None)
                grads.append((g if g is not None else p.grad).detach().clone())
                params.append(p.detach().clone())
        out[name] = (losses, grads, params)
        megatronapp.destroy_model_parallel()
    return out


def assert_variants_identical(results, names):
    """Every rank's variants `names[1:]` equal `names[0]` bit for bit."""
    import torch

    for rank, out in enumerate(results):
        ref_losses, ref_grads, ref_params = out[names[0]]
        for name in names[1:]:
            losses, grads, params = out[name]
            assert losses == ref_losses, (rank, name, losses, ref_losses)
            assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)), (
                rank, name, "gradients differ")
            assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)), (
                rank, name, "weights differ")


def error_messages(*makers, exc=ValueError) -> list:
    """The message of the `exc` each callable raises (failing if one does not)."""
    msgs = []
    for make in makers:
        try:
            make()
        except exc as e:
            msgs.append(str(e))
        else:
            raise AssertionError(f"{make} raised no {exc.__name__}")
    return msgs


def assert_same_training(got: list, want: dict, steps: int, tol: float = 1e-5) -> None:
    """Every rank's summary of a layout (``losses``, ``valid``, ``acc``)
    against one rank's: each step's loss and the validation loss within
    `tol`, the accuracy to 1e-6."""
    for r in got:
        assert len(r["losses"]) == steps
        for i, (g, w) in enumerate(zip(r["losses"], want["losses"], strict=True)):
            assert abs(g - w) < tol, f"step {i + 1}: {g} vs one rank's {w}"
        assert abs(r["valid"] - want["valid"]) < tol
        assert abs(r["acc"] - want["acc"]) <= 1e-6, (r["acc"], want["acc"])


#: training-edge layouts every model family is checked under (4 ranks each)
PP2_DP2_ZERO1_ZB = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                    "--pipeline-schedule", "zero-bubble"]
PP2_FBD_RECOMPUTE = ["--pipeline-model-parallel-size", "2", "--forward-backward-disaggregating",
                     "--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1"]
