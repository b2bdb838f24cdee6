"""The warm multi-rank harness itself (dist_harness.run_ranks): every body
gets fresh process groups and a fresh process's view; a failing or hanging
body is named with each rank's traceback and its processes are replaced, so
the next body runs normally."""

import os

import pytest

from dist_harness import run_ranks


def _state(rank, world, tag):
    import torch.distributed as dist

    import torch
    from megatronapp import parallel_state as S

    seen = {"env": os.environ.get("MAPP_HARNESS_PROBE"), "pid": os.getpid(),
            "groups": len(dist.distributed_c10d._world.pg_names),  # noqa: SLF001
            "patched": S.node_identity.__name__, "mp": S.model_parallel_is_initialized(),
            "draw": torch.rand(1).item(), "dtype": str(torch.get_default_dtype())}
    # Everything a careless body may leave behind:
    os.environ["MAPP_HARNESS_PROBE"] = tag
    S.node_identity = lambda: "patched"
    torch.set_default_dtype(torch.float64)
    import megatronapp as mapp

    mapp.initialize_model_parallel(1, 1)
    g = dist.new_group(list(range(world)))
    S.enable_shared_memory(g)  # left attached on purpose
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    return seen, t.tolist()


def test_each_body_sees_a_fresh_process(monkeypatch):
    monkeypatch.setenv("MAPP_HARNESS_PROBE", "from-the-test")
    first = run_ranks(_state, 2, "left-by-body-1")
    second = run_ranks(_state, 2, "left-by-body-2")
    for a, b in zip(first, second, strict=True):
        (sa, ta), (sb, tb) = a, b
        assert sa["pid"] == sb["pid"]  # the same warm processes ...
        assert sb["env"] == "from-the-test"  # ... the test's environment, not the last body's
        assert sb["groups"] == sa["groups"] == 1  # only the new default group
        assert sb["patched"] == "node_identity" and not sb["mp"]
        assert sb["draw"] == sa["draw"]  # torch's start-up seed
        assert sb["dtype"] == "torch.float32"
        assert ta == tb == [3.0, 3.0]


def _fail_on_rank0(rank, world):
    import torch.distributed as dist

    if rank == 0:
        raise ValueError("rank 0 gives up")
    dist.barrier()  # waits forever for rank 0


def _hang(rank, world):
    import time

    while True:
        time.sleep(0.1)


def _pid(rank, world):
    return os.getpid()


def test_a_failing_body_is_named_and_its_processes_replaced():
    before = run_ranks(_pid, 2)
    with pytest.raises(AssertionError) as e:
        run_ranks(_fail_on_rank0, 2)
    msg = str(e.value)
    assert "ValueError: rank 0 gives up" in msg
    assert "_fail_on_rank0" in msg and "still running after a failure on rank(s) [0]" in msg
    assert "in barrier" in msg  # rank 1's stack, where it waited
    after = run_ranks(_pid, 2)
    assert set(after).isdisjoint(before)  # new processes, and they work


def test_a_hanging_body_times_out_naming_itself():
    with pytest.raises(AssertionError) as e:
        run_ranks(_hang, 2, timeout=3)
    msg = str(e.value)
    assert "test_harness._hang" in msg and "timed out after 3 s" in msg
    assert "in _hang" in msg  # each rank's stack
    assert run_ranks(_pid, 2, fresh=True) and run_ranks(_pid, 1)


def _raise_everywhere(rank, world):
    raise SystemExit(f"bad flag on rank {rank}")


def test_an_error_on_every_rank_keeps_the_processes():
    before = run_ranks(_pid, 2)
    with pytest.raises(AssertionError, match="bad flag on rank 1"):
        run_ranks(_raise_everywhere, 2)
    assert run_ranks(_pid, 2) == before


def _gloo_threads(rank, world):
    from dist_harness import thread_count

    task = f"/proc/{os.getpid()}/task"
    loops = 0
    for t in os.listdir(task):
        try:
            with open(f"{task}/{t}/comm") as f:
                loops += f.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return thread_count(), loops


def _train_tp2(rank, world, out):
    from megatronapp.pretrain import build_parser, train

    train(build_parser().parse_args([
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--eval-iters", "1", "--no-progress", "--log-interval", "1000",
        "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
        "--output-dir", out]))


def _ddp_is_collected(rank, world):
    import gc
    import weakref

    import torch
    from megatronapp.distributed.data_parallel import DistributedDataParallel

    m = torch.nn.Linear(4, 4)
    d = DistributedDataParallel(m)
    d(torch.ones(2, 4)).sum().backward()
    d.finish_grad_sync()
    refs = [weakref.ref(d), weakref.ref(m.weight)]
    del d, m
    gc.collect()
    return [r() is None for r in refs]


def test_a_training_leaves_no_process_group_behind(tmp_path):
    """A finished run's modules, parameters and process groups are garbage:
    the gradient hooks (held in C++, out of the collector's sight) reach the
    DDP module weakly. Before, every run kept its groups' Gloo threads alive
    (about 4 loop and 4 worker threads), and warm ranks ran with hundreds."""
    assert run_ranks(_ddp_is_collected, 2) == [[True, True]] * 2
    (threads, loops), _ = run_ranks(_gloo_threads, 2)
    for i in range(3):
        run_ranks(_train_tp2, 2, str(tmp_path / str(i)))
    (threads_after, loops_after), _ = run_ranks(_gloo_threads, 2)
    assert loops_after <= loops + 2 and threads_after <= threads + 6, (
        (threads, loops), (threads_after, loops_after))
