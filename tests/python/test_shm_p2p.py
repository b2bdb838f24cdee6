"""Pipeline send/recv through shared memory (torch.ops.mapp.shm_isend /
shm_irecv) on real processes: every dtype bit for bit against what was sent,
repeated tags matched in order, receives posted before and after their sends,
a ring far smaller than the traffic in both directions at once, the pipeline
group of initialize_model_parallel on it by default (MAPP_SHM_COLLECTIVES=0
opts out), the executor's schedules bit-identical with and without it, a
delayed (fault-injected) send, and clear errors for misuse."""

import os

import pytest

import torch
from dist_harness import run_ranks


def _exchange(rank, world, slot_bytes, slots):
    os.environ["MAPP_SHM_P2P"] = "1"
    os.environ["MAPP_SHM_P2P_SLOT_BYTES"] = str(slot_bytes)
    os.environ["MAPP_SHM_P2P_SLOTS"] = str(slots)
    import torch.distributed as dist

    import megatronapp  # noqa: F401  (loads torch.ops.mapp)
    from megatronapp import parallel_state as S

    g = dist.new_group(list(range(world)))
    assert S.enable_shared_memory(g, p2p=True) and S.shared_memory_enabled(g, p2p=True)
    assert not S.shared_memory_enabled(g)  # the collectives are a separate transport
    name = g.group_name
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def payload(src, dst, k, dtype):
        gen = torch.Generator().manual_seed(1000 * src + 10 * dst + k)
        x = torch.randn(33, 7, 5, generator=gen, dtype=torch.float64) * 50
        return x.to(dtype)

    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)
    sends, recvs = [], []
    # Half the receives are posted before the sends, half after; every tag is
    # used twice per direction (the i-th send of a tag is the i-th receive).
    for k, dtype in enumerate(dtypes):
        early = k % 2 == 0
        if early:
            buf = torch.empty(33, 7, 5, dtype=dtype)
            recvs.append((torch.ops.mapp.shm_irecv(buf, name, prv, k % 2), buf, prv, k, dtype))
        x = payload(rank, nxt, k, dtype)
        sends.append((torch.ops.mapp.shm_isend(x, name, nxt, k % 2), x))
        if not early:
            buf = torch.empty(33, 7, 5, dtype=dtype)
            recvs.append((torch.ops.mapp.shm_irecv(buf, name, prv, k % 2), buf, prv, k, dtype))
    bad = []
    for work, buf, src, k, dtype in reversed(recvs):  # waited out of order
        work.wait()
        if not torch.equal(buf, payload(src, rank, k, dtype)):
            bad.append(f"{dtype} from {src} (k={k}) differs")
    for work, _ in sends:
        work.wait()
        work.wait()  # idempotent
        assert work.is_completed()
    S.disable_shared_memory(g)
    assert not S.shared_memory_enabled(g, p2p=True)
    return bad


@pytest.mark.parametrize("world,slot,slots", [(2, 512 << 10, 4), (3, 256, 1), (4, 1024, 2)])
def test_shared_memory_send_recv_is_exact_in_any_posting_order(world, slot, slots):
    for bad in run_ranks(_exchange, world, slot, slots):
        assert not bad, bad


def _misuse(rank, world):
    os.environ["MAPP_SHM_P2P"] = "1"
    import torch.distributed as dist

    import megatronapp  # noqa: F401
    from megatronapp import parallel_state as S

    g = dist.new_group(list(range(world)))
    other = dist.new_group(list(range(world)))
    S.enable_shared_memory(g, p2p=True)
    errors = []
    for call in (
        lambda: torch.ops.mapp.shm_isend(torch.ones(3), other.group_name, 1 - rank, 0),
        lambda: torch.ops.mapp.shm_isend(torch.ones(3), g.group_name, rank, 0),
        lambda: torch.ops.mapp.shm_isend(torch.ones(4, 2).t(), g.group_name, 1 - rank, 0),
        lambda: torch.ops.mapp.shm_irecv(torch.ones(3), g.group_name, 1 - rank, -1),
    ):
        try:
            call()
            errors.append(None)
        except (RuntimeError, ValueError) as e:
            errors.append(str(e))
    # A size mismatch is an error on the receiver naming both sizes.
    if rank == 0:
        torch.ops.mapp.shm_isend(torch.ones(6), g.group_name, 1, 5).wait()
    else:
        try:
            torch.ops.mapp.shm_irecv(torch.empty(4), g.group_name, 0, 5).wait()
            errors.append(None)
        except (RuntimeError, ValueError) as e:
            errors.append(str(e))
    # A receive nobody sends to times out with the operation named.
    try:
        torch.ops.mapp.shm_irecv(torch.empty(2), g.group_name, 1 - rank, 99).wait(300)
        errors.append(None)
    except (RuntimeError, ValueError) as e:
        errors.append(str(e))
    dist.barrier()
    return errors


def test_misuse_is_a_clear_error():
    for rank, errs in enumerate(run_ranks(_misuse, 2)):
        assert "has no shared-memory p2p transport" in errs[0]
        assert "cannot send to member" in errs[1]
        assert "must be contiguous" in errs[2]
        assert "outside [0, 2^32)" in errs[3]
        if rank == 1:
            assert "receive of 16 bytes" in errs[4] and "has 24 bytes" in errs[4], errs[4]
        assert "timed out" in errs[-1] and "tag 99" in errs[-1], errs[-1]


def _pipeline(rank, world, schedule, env, delay):
    os.environ["MAPP_SHM_P2P"] = "1"  # opt-in; MAPP_SHM_COLLECTIVES=0 still turns it off
    os.environ.update(env)
    if delay:
        os.environ["MAPP_INJECT_LINK_DELAY"] = "rank=0,peer=1,ms=30"
    import megatronapp as mapp
    from megatronapp import parallel_state as S
    from megatronapp.pipeline import Schedule, forward_backward

    st = mapp.initialize_model_parallel(pipeline_model_parallel_size=world)
    torch.manual_seed(0)
    h, mb, m = 16, 3, 8
    layers = [torch.nn.Linear(h, h, dtype=torch.float64) for _ in range(2 * world)]
    v = 2 if schedule == "interleaved" else 1
    chunks = [torch.nn.Sequential(*[layers[(c * world + st.pp_rank) * (2 // v) + i]
                                    for i in range(2 // v)]) for c in range(v)]
    sched = Schedule.by_name(schedule, world, m, v)
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(mb, h, generator=gen, dtype=torch.float64),
             torch.randn(mb, h, generator=gen, dtype=torch.float64)) for _ in range(m)]
    res = forward_backward(sched, chunks, iter(data), lambda out, t: ((out - t) ** 2).mean(),
                           tensor_shape=(mb, h), dtype=torch.float64)
    grads = [p.grad.clone() for c in chunks for p in c.parameters()]
    used = res.shared_memory
    return (S.shared_memory_enabled(st.pipeline_group, p2p=True),
            [float(x) for x in res.losses], grads, used)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero-bubble"])
def test_schedules_through_shared_memory_match_gloo_bit_for_bit(schedule):
    shm = run_ranks(_pipeline, 4, schedule, {}, False)
    gloo = run_ranks(_pipeline, 4, schedule, {"MAPP_SHM_COLLECTIVES": "0"}, False)
    assert all(r[0] for r in shm) and not any(r[0] for r in gloo)
    for a, b in zip(shm, gloo, strict=True):
        assert a[1] == b[1]
        assert all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))
    assert shm[-1][1], "the last stage reports losses"


def test_messages_larger_than_a_ring_stay_on_gloo():
    # 3 x 16 float64 = 384 bytes per message, rings of one 256-byte slot: the
    # executor sends through Gloo (a message that does not fit would only move
    # while its sender is inside a p2p call), with the same numbers.
    small = {"MAPP_SHM_P2P_SLOT_BYTES": "256", "MAPP_SHM_P2P_SLOTS": "1"}
    tiny = run_ranks(_pipeline, 2, "1f1b", small, False)
    ref = run_ranks(_pipeline, 2, "1f1b", {}, False)
    assert all(r[0] and not r[3] for r in tiny) and all(r[3] for r in ref)
    off = run_ranks(_pipeline, 2, "1f1b", {"MAPP_SHM_P2P": "0"}, False)
    assert not any(r[0] or r[3] for r in off)  # MAPP_SHM_P2P=0 (the default): Gloo
    for a, b in zip(tiny, ref, strict=True):
        assert a[1] == b[1] and all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))


def test_fault_injected_delayed_send_through_shared_memory():
    # The delayed send is issued from a timer thread while the main thread
    # waits on a shared-memory receive: no deadlock, same numbers.
    slow = run_ranks(_pipeline, 2, "1f1b", {}, True)
    fast = run_ranks(_pipeline, 2, "1f1b", {}, False)
    for a, b in zip(slow, fast, strict=True):
        assert a[0] and a[1] == b[1]
        assert all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))
