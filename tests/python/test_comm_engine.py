"""The communication engine: CommWork handles with is_completed() and a
bounded wait(), errors that name the operation, group and job, and the codec
state op that Python no longer decodes by hand."""

import pytest

import torch
from dist_harness import run_ranks


def _works(rank, world):
    import time

    import torch.distributed as dist

    import torch
    from megatronapp.distributed import comm

    group = dist.group.WORLD
    x = torch.arange(8, dtype=torch.float32) * (rank + 1)
    if rank == 1:
        time.sleep(1.5)  # rank 0's first wait times out meanwhile
    work = torch.ops.mapp.compressed_all_reduce_async(x, "none", [], [], False,
                                                      group.group_name)
    out = {"description": work.description()}
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"did not complete within 200 ms") as e:
            work.wait(200)
        out["timeout_message"] = str(e.value)
        out["completed_early"] = work.is_completed()
    stats = comm.wait(work)
    out["completed"] = work.is_completed()
    out["again"] = work.wait()  # a second wait returns the same result
    out["x"] = x
    out["stats"] = stats
    # An error inside the job surfaces at wait(), naming the job.
    bad = torch.ops.mapp.compressed_all_reduce_async(x, "int8", [torch.zeros(3)], [], True,
                                                     group.group_name)
    with pytest.raises(Exception, match="state") as e:
        bad.wait()
    out["error"] = str(e.value)
    return out


def test_comm_work_wait_timeout_and_errors():
    res = run_ranks(_works, 2)
    want = torch.arange(8, dtype=torch.float32) * 3  # 1x + 2x
    for out in res:
        assert torch.equal(out["x"], want)
        assert out["completed"] and out["again"] == [out["stats"]["raw_bytes"],
                                                      out["stats"]["sent_bytes"]]
        assert out["description"].startswith("dp bucket all-reduce on group '")
        assert "(job 1)" in out["description"]
    assert not res[0]["completed_early"]
    assert "dp bucket all-reduce on group" in res[0]["timeout_message"]
    assert "MAPP_COLLECTIVE_TIMEOUT_S" in res[0]["timeout_message"]


def test_codec_state_op():
    from megatronapp.distributed import comm

    st = comm.codec_state("int8:64", 1000, 4)
    assert [tuple(t.shape) for t in st] == [(1024,), (256,)]
    assert all(t.dtype == torch.float32 and not t.any() for t in st)
    # PowerSGD: a residual and one Q per matrix, seeded identically everywhere.
    a = comm.codec_state("powersgd:2", 30, 2, [0, 4, 5, 20, 2, 5], seed=7)
    b = comm.codec_state("powersgd:2", 30, 2, [0, 4, 5, 20, 2, 5], seed=7)
    assert [tuple(t.shape) for t in a] == [(30,), (5, 2), (5, 2)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    g = torch.Generator().manual_seed(7)  # the documented draw: one CPU generator, in order
    assert torch.equal(a[1], torch.randn((5, 2), generator=g))
    assert torch.equal(a[2], torch.randn((5, 2), generator=g))
    assert not comm.codec_state("none", 10, 2)
    with pytest.raises(Exception, match="lies outside the buffer"):
        comm.codec_state("powersgd:2", 10, 2, [0, 4, 5])
