"""The memory pool inside PyTorch: bit-identical training, statistics, traces."""

import json

import pytest

from dist_harness import run_ranks

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "5", "--eval-iters", "1", "--no-progress", "--log-interval", "1000"]


def _train(rank, world, extra, out_dir):
    from megatronapp.pretrain import build_parser, train

    args = build_parser().parse_args(FLAGS + extra + ["--output-dir", out_dir])
    summary = train(args)
    if "--memory-pool" in extra:
        import megatronapp as mapp

        ok, why = mapp._C.memory_cpu_is_valid()
        assert ok, why
    return summary


def test_gpt_losses_are_bit_identical_with_the_pool(tmp_path):
    tp2 = ["--tensor-model-parallel-size", "2"]
    plain = run_ranks(_train, 2, tp2, str(tmp_path / "plain"))
    trace = str(tmp_path / "trace.bin")
    # Recording turns the thread cache off (every operation must reach the
    # trace); the second pooled run trains with it on.
    pooled = run_ranks(_train, 2, tp2 + ["--memory-pool", "--record-alloc-trace", trace],
                       str(tmp_path / "pool"))
    cached = run_ranks(_train, 2, tp2 + ["--memory-pool"], str(tmp_path / "cached"))
    for a, b, c in zip(plain, pooled, cached, strict=True):
        assert a["losses"] == b["losses"] == c["losses"]  # exact: numerics are the allocator's no business
    for mem in (pooled[0]["memory"], cached[0]["memory"]):
        assert mem["num_allocs"] > 1000 and mem["num_cache_hits"] > 0.9 * mem["num_allocs"]
        assert 0.0 <= mem["fragmentation"] < 0.5
        assert mem["allocated_bytes"] <= mem["active_bytes"] <= mem["reserved_bytes"]
    # Blocks held by thread caches: per thread that allocated, at most 1 MiB in
    # the bins plus the block freed last (<= 16 MiB).
    assert 0 < cached[0]["memory"]["thread_cached_bytes"] <= 8 * 17 * (1 << 20)
    # The recorded traces replay deterministically and through both policies.
    import megatronapp as mapp

    for rank in (0, 1):
        path = f"{trace}.rank{rank}"
        first = mapp.memory.replay(path, "ours")
        again = mapp.memory.replay(path, "ours")
        torch_like = mapp.memory.replay(path, "torch-like")
        assert first["peak_reserved_bytes"] == again["peak_reserved_bytes"]
        assert first["operations"] == again["operations"] > 1000
        assert first["peak_allocated_bytes"] == torch_like["peak_allocated_bytes"]


def test_corrupt_trace_is_a_clear_error(tmp_path):
    import megatronapp as mapp

    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"MAPPTRC1" + (5).to_bytes(8, "little") + b"\x09\x00\x00\x00\x00")
    with pytest.raises(ValueError, match="unknown op 9"):
        mapp.memory.replay(str(bad))
    with pytest.raises(ValueError, match="cannot open"):
        mapp.memory.replay(str(tmp_path / "missing.bin"))
    with pytest.raises(ValueError, match="unknown pool policy"):
        mapp.memory.replay(str(bad), "best")


def _pool_basics(rank, world):
    import megatronapp as mapp
    import torch

    mapp.memory.use_pool("cpu")
    before = mapp.memory.stats()
    x = torch.ones(1 << 20)
    y = (x * 2).sum()
    del x
    after = mapp.memory.stats()
    mapp.memory.release_cached()
    released = mapp.memory.stats()
    mapp.memory.restore_default()
    z = torch.ones(10)  # default allocator again
    return json.dumps({"before": before, "after": after, "released": released,
                       "y": float(y), "z": float(z.sum())})


def test_pool_statistics_track_torch_allocations():
    res = json.loads(run_ranks(_pool_basics, 1)[0])
    assert res["y"] == 2.0 * (1 << 20) and res["z"] == 10.0
    assert res["after"]["num_allocs"] >= res["before"]["num_allocs"] + 2
    assert res["after"]["peak_allocated_bytes"] >= 2 * 4 * (1 << 20)
    assert res["released"]["reserved_bytes"] <= res["after"]["reserved_bytes"]


def test_thread_cache_arguments_are_checked():
    import megatronapp as mapp

    with pytest.raises(ValueError, match="thread_cache_bytes must be >= 0"):
        mapp.memory.use_pool("cpu", thread_cache_bytes=-1)
    with pytest.raises(ValueError, match="CPU pool only"):
        mapp.memory.use_pool("cuda", thread_cache_bytes=1 << 20)


def test_staging_buffers_come_from_their_own_pool():
    import megatronapp as mapp
    import torch

    before = mapp.memory.staging_stats()["num_allocs"]
    t = mapp.memory.staging_buffer((3, 5), torch.float64)
    assert t.shape == (3, 5) and t.dtype == torch.float64 and t.device.type == "cpu"
    t.fill_(1.5)
    assert float(t.sum()) == 22.5
    assert t.is_pinned() == torch.cuda.is_available()
    assert mapp.memory.staging_stats()["num_allocs"] == before + 1
    with pytest.raises(ValueError, match="negative dimension"):
        mapp.memory.staging_buffer((-1,))
