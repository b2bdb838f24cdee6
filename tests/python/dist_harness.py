"""Run a function on N real Gloo ranks and collect results.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` on
`world_size` processes joined by a fresh default Gloo process group, and
returns the per-rank return values, or raises AssertionError with every
failing rank's traceback.

The processes are warm: a pool per world size imports torch and megatronapp
once and then runs many test bodies (a cold spawn costs 10-20 s of a 2-core
machine per call; a warm body starts in well under a second). Each body gets
what a fresh process would have: a new rendezvous store (hosted by the test
process, so no rank's exit can take it away) and a new default process group,
the test process's environment variables, working directory and sys.path,
torch's start-up seed, default dtype and grad mode. Afterwards every rank
tears down what the body left (model-parallel state and its groups,
shared-memory attachments, the tracer, the scope, signal handlers, torch's
CPU allocator) before the next body starts. State that cannot be undone
in-process (a CPU memory pool with other options than use_pool("cpu")'s
defaults: the pool is built once per process) retires the pool: the next body
gets new processes. A body that installs a pool with non-default options must
therefore run with fresh=True or first in its processes.

A body that fails on some ranks while others still wait in a collective, or
that runs past `timeout`, is reported with each rank's traceback (for a hang,
every thread's stack, dumped by faulthandler) and the body's name; its
processes are killed and the next call starts a new pool, so a hang never
blocks the suite.

`fresh=True` (or MAPP_TEST_WARM_RANKS=0 for every call) runs the body in
newly spawned processes that exit afterwards (a pool used for one body).

`train_variants` (run on every rank) trains the same model under several
command-line variants; `assert_variants_identical` checks that every variant's
losses, gradients and weights equal the first one's exactly.
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as _wait_any

import torch.multiprocessing as mp

#: seconds the other ranks get to report after one rank failed, before the
#: pool is presumed stuck in a collective and killed
_GRACE_S = 5.0
#: seconds a rank may take to tear a body down
_TEARDOWN_S = 60.0
#: a warm rank with more threads than this after a teardown retires: threads
#: that outlive their body (a process group something still holds: Gloo's
#: loop and worker threads) would otherwise pile up over hundreds of bodies
_MAX_THREADS = int(os.environ.get("MAPP_TEST_WARM_RANK_THREADS_MAX", "64"))
#: at most this many warm ranks are kept (least recently used pools retire)
_MAX_WARM_RANKS = int(os.environ.get("MAPP_TEST_WARM_RANKS_MAX", "20"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _body_name(fn) -> str:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return f"{where} (test {test})" if test else where


# ---- the rank side ------------------------------------------------------------

def _die_with_parent() -> None:
    """SIGKILL this process when the test process dies (Linux), so a killed
    pytest leaves no warm ranks behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


class _Baseline:
    """What a body may change in a rank and teardown puts back."""

    def __init__(self):
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.seed = torch.initial_seed()
        self.dtype = torch.get_default_dtype()
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT,
                                                         signal.SIGUSR2, signal.SIGALRM)}
        self.functions: dict = {}  # module name -> {attribute: function or class}
        self._snapshot()

    def _snapshot(self) -> None:
        """The functions and classes of every megatronapp module not seen yet
        (a body that monkeypatches one gets it put back)."""
        import inspect

        for name, mod in list(sys.modules.items()):
            if (name == "megatronapp" or name.startswith("megatronapp.")) and \
                    name not in self.functions and mod is not None:
                self.functions[name] = {k: v for k, v in vars(mod).items()
                                        if inspect.isfunction(v) or inspect.isclass(v)
                                        or inspect.isbuiltin(v)}

    def enter(self, environ, cwd, path) -> None:
        """A fresh process's view for the next body."""
        import random

        import torch

        self._snapshot()
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.path[:] = path
        torch.manual_seed(self.seed)
        random.seed()
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)

    def restore(self) -> None:
        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        for s, h in self.signals.items():
            signal.signal(s, h)
        for name, attrs in self.functions.items():
            mod = sys.modules.get(name)
            for k, v in attrs.items():
                if mod is not None and getattr(mod, k, None) is not v:
                    setattr(mod, k, v)


def _teardown() -> bool:
    """Undoes a body's process-wide state; False if this process cannot be
    reused (state that is set once per process)."""
    import torch.distributed as dist

    import megatronapp
    from megatronapp import memory, trace
    from megatronapp import parallel_state as S
    from megatronapp.models import scope_taps

    reusable = True
    try:
        if trace.active():
            trace.stop()
    except Exception:  # noqa: BLE001
        reusable = False
    try:
        megatronapp.destroy_model_parallel()
    except Exception:  # noqa: BLE001
        reusable = False
    if getattr(scope_taps, "ACTIVE", None) is not None:
        scope_taps.ACTIVE = None
    if dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        for group in list(c10d._world.pg_names):  # noqa: SLF001
            try:
                S.disable_shared_memory(group)  # groups the body made itself
            except Exception:  # noqa: BLE001
                reusable = False
        dist.destroy_process_group()
    if memory.is_installed("cpu"):
        # The CPU pool is built once per process. torch's allocator goes back
        # (a fresh process's), and a later body's use_pool("cpu") swaps the
        # same pool in again; only a pool with other options than
        # use_pool("cpu")'s own retires the process (a body asking for the
        # default one would be refused there).
        st = memory.stats("cpu")
        memory.restore_default("cpu")
        memory.release_cached("cpu")
        if (st["name"], st["expandable_segments"], st["gc_threshold"],
                st["thread_cache_bytes"]) != ("ours", True, 0, 1 << 20):
            reusable = False
    return reusable


def thread_count() -> int:
    """This process's threads (native ones included)."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:  # no procfs: nothing to go by
        return 0


def _serve(rank: int, world: int, conn, dump_path: str) -> None:
    """A warm rank: runs bodies from `conn` until told to stop."""
    import faulthandler
    import gc

    _die_with_parent()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    import megatronapp  # noqa: F401  (the point of the pool: imported once)
    import torch

    torch.set_num_threads(1)
    # What lives now (torch, megatronapp: ~300k objects) lives for the rank's
    # life: out of the collector's sight, each full collection (the one after
    # every body, and the automatic ones that stall one rank mid-run while its
    # peers wait) costs ~5 ms instead of ~300 ms.
    gc.collect()
    gc.freeze()
    dump = open(dump_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    base = _Baseline()
    while True:
        kind, payload = conn.recv()
        if kind == "stop":
            return
        environ, cwd, path, port, body = payload
        base.enter(environ, cwd, path)
        try:
            fn, args = pickle.loads(body)  # here: a test module that fails to import is reported
            store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=60))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60))
            del store
            result = fn(rank, world, *args)
            # Serialize here: the parent reads it after this body's teardown.
            buf = io.BytesIO()
            torch.save(result, buf)
            reply = ("ok", buf.getvalue())
        except BaseException:  # report everything, including assertion failures
            reply = ("error", traceback.format_exc())
        conn.send(reply)
        if conn.recv()[0] != "teardown":
            return
        try:
            reusable = _teardown()
        except BaseException:  # noqa: BLE001
            conn.send(("dirty", traceback.format_exc()))
            return
        base.restore()
        gc.collect()
        gc.freeze()  # what a body imported (transformers, matplotlib) stays too
        reusable = reusable and thread_count() <= _MAX_THREADS
        conn.send(("clean" if reusable else "retire", ""))
        if not reusable:
            return


# ---- the test side ------------------------------------------------------------

class _Pool:
    def __init__(self, world: int):
        self.world = world
        ctx = mp.get_context("spawn")
        self.dumps = [tempfile.NamedTemporaryFile(prefix=f"mapp-rank{r}-", suffix=".stacks",
                                                  delete=False).name for r in range(world)]
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(r, world, child, self.dumps[r]),
                            name=f"mapp-test-rank{r}of{world}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def stacks(self) -> dict:
        """Every live rank's thread stacks (faulthandler, on SIGUSR1)."""
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)
        out = {}
        for r, path in enumerate(self.dumps):
            try:
                with open(path) as f:
                    out[r] = f.read().strip() or "(no stack dumped)"
            except OSError:
                out[r] = "(no stack dumped)"
        return out

    def close(self, kill: bool = False) -> None:
        for c, p in zip(self.conns, self.procs, strict=True):
            if not kill and p.is_alive():
                try:
                    c.send(("stop", None))
                except OSError:
                    pass
        for p in self.procs:
            p.join(timeout=0 if kill else 5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        for path in self.dumps:
            try:
                os.unlink(path)
            except OSError:
                pass

    def run(self, fn, args, timeout: float):
        """Runs one body; returns (results, errors, keep) where `keep` says
        whether the processes may run another."""
        import torch.distributed as dist

        import torch

        store = dist.TCPStore("127.0.0.1", 0, self.world + 1, True, timedelta(seconds=60),
                              wait_for_workers=False)
        msg = ("run", (dict(os.environ), os.getcwd(), list(sys.path), store.port,
                       pickle.dumps((fn, args))))
        for c in self.conns:
            c.send(msg)
        results, errors, pending = {}, {}, set(range(self.world))
        deadline = time.monotonic() + timeout
        while pending:
            if errors:  # the rest may wait forever on the failed rank
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            ready = _wait_any([self.conns[r] for r in pending],
                                       timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for c in ready:
                r = self.conns.index(c)
                pending.discard(r)
                try:
                    status, payload = c.recv()
                except EOFError:
                    errors[r] = f"rank {r} died (exit code {self.procs[r].exitcode})"
                    continue
                if status == "ok":
                    results[r] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors[r] = payload
        if pending:
            name = _body_name(fn)
            stacks = self.stacks()
            for r in sorted(pending):
                what = (f"still running after a failure on rank(s) {sorted(errors)}" if errors
                        else f"timed out after {timeout:g} s")
                errors[r] = f"{name}: {what}; its threads:\n{stacks[r]}"
            return results, errors, False
        # Every rank is back: tear the body down everywhere, then reuse.
        for c in self.conns:
            c.send(("teardown", None))
        keep = True
        deadline = time.monotonic() + _TEARDOWN_S
        for r, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                errors[r] = f"{_body_name(fn)}: rank {r}'s teardown hung:\n{self.stacks()[r]}"
                return results, errors, False
            try:
                status, payload = c.recv()
            except EOFError:
                return results, errors, False
            if status == "dirty":
                errors[r] = f"{_body_name(fn)}: rank {r}'s teardown failed:\n{payload}"
            keep = keep and status == "clean"
        del store
        return results, errors, keep


_POOLS: dict[int, _Pool] = {}
#: why the last pool of each world size went away (for the cold-start log)
_GONE: dict[int, str] = {}


def _log_cold_start(world: int, why: str) -> None:
    """One line per cold pool start in $MAPP_TEST_POOL_LOG (make test sets it;
    tests/durations.py sums it up): the world size, why it was cold, the test."""
    path = os.environ.get("MAPP_TEST_POOL_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    with open(path, "a") as f:
        f.write(f"{world}\t{why}\t{test}\n")


def _pool(world: int) -> _Pool:
    pool = _POOLS.pop(world, None)
    if pool is not None and not pool.alive():
        pool.close(kill=True)
        pool = None
        _GONE[world] = "died"
    if pool is None:
        # least recently used first: retire until the new one fits
        while _POOLS and sum(_POOLS) + world > _MAX_WARM_RANKS:
            old = next(iter(_POOLS))
            _POOLS.pop(old).close()
            _GONE[old] = f"evicted for world {world}"
        _log_cold_start(world, _GONE.pop(world, "first"))
        pool = _Pool(world)
    _POOLS[world] = pool  # most recently used last
    return pool


@atexit.register
def shutdown_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def _raise(errors: dict) -> None:
    raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, fresh: bool = False):
    fresh = fresh or os.environ.get("MAPP_TEST_WARM_RANKS", "1") == "0"
    pool = _Pool(world_size) if fresh else _pool(world_size)  # fresh: a pool of one body
    keep = False
    try:
        results, errors, keep = pool.run(fn, args, timeout)
    finally:  # also on pytest-timeout or ^C while waiting
        if fresh:
            pool.close(kill=not keep)
        elif not keep:
            _POOLS.pop(world_size, None)
            pool.close(kill=True)
            _GONE[world_size] = f"retired after {getattr(fn, '__qualname__', fn)}"
    if errors:
        _raise(errors)
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
        # ZeRO-1 with --overlap-param-gather: the weights are whole once waited for.
        getattr(run.optimizer, "finish_param_sync", lambda: None)()
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


#: what c10d, Python and the C++ runtime print when something went wrong
STACK_TRACE_MARKS = ("Traceback (most recent call last)", "Exception raised from",
                     "frame #0:", "Broken pipe", "terminate called")


def assert_no_stack_trace(output: str, what: str = "the run") -> None:
    """A successful run prints no stack trace (not even a c10d warning's)."""
    for mark in STACK_TRACE_MARKS:
        assert mark not in output, f"{what} printed a stack trace ({mark!r}):\n{output[-4000:]}"
