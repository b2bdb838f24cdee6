"""The shared-memory transport of the C++ collectives on real processes: every
collective, dtype and layout against a float64 closed form and bit for bit
against the same call on the Gloo backend; pieces smaller than the tensor;
the tensor-parallel group of initialize_model_parallel on it by default; the
fallbacks (other node, MAPP_SHM_COLLECTIVES=0) and a missing member's timeout."""

import os

import pytest

import torch
from dist_harness import run_ranks


def _collectives_agree(rank, world, slot_bytes):
    os.environ["MAPP_SHM_SLOT_BYTES"] = str(slot_bytes)
    import torch.distributed as dist

    import megatronapp  # noqa: F401  (loads torch.ops.mapp)
    from megatronapp import _collectives as C
    from megatronapp import parallel_state as S

    shm = dist.new_group(list(range(world)))
    gloo = dist.new_group(list(range(world)))
    assert S.enable_shared_memory(shm) and S.shared_memory_enabled(shm)
    assert not S.shared_memory_enabled(gloo)
    g = torch.Generator().manual_seed(5)
    per_rank = [torch.randn(37, 6, 10, generator=g, dtype=torch.float64) for _ in range(world)]
    mine = per_rank[rank]
    bad = []

    def check(tag, got, want64, ref):
        tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5}.get(got.dtype, 1e-12)
        if not torch.allclose(got.double(), want64, rtol=tol, atol=tol):
            bad.append(f"{tag}: max err {(got.double() - want64).abs().max().item():.3e}")
        # Two addends: one rounding either way, so bit-equal to Gloo; with more,
        # the summation order differs (each side is deterministic), except integers.
        if world == 2 or not got.is_floating_point():
            if not torch.equal(got, ref):
                bad.append(f"{tag}: differs from Gloo")
        # every member holds the same bits
        every = [torch.empty_like(got, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, got.double().contiguous(), group=gloo)
        if tag.startswith(("all_reduce", "all_gather")) and not all(torch.equal(e, every[0]) for e in every):
            bad.append(f"{tag}: members disagree")

    total = sum(per_rank)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        x = (mine * 100).to(dtype) if dtype == torch.int64 else mine.to(dtype)
        want = sum(((p * 100) if dtype == torch.int64 else p).to(dtype).double() for p in per_rank)
        a, b = x.clone(), x.clone()
        C.all_reduce_sum_(a, shm)
        C.all_reduce_sum_(b, gloo)
        check(f"all_reduce {dtype}", a, want, b)
    nc = mine.float().transpose(0, 2)  # not contiguous: reduced in place all the same
    assert not nc.is_contiguous()
    C.all_reduce_sum_(nc, shm)
    via_gloo = C.all_reduce_sum_(mine.float().transpose(0, 2).contiguous(), gloo)
    check("all_reduce non-contiguous", nc, total.transpose(0, 2), via_gloo)
    for dim in (0, 1, -1):
        x = mine.float()
        check(f"all_gather dim {dim}", C.all_gather(x, dim, shm),
              torch.cat(per_rank, dim), C.all_gather(x, dim, gloo))
    for dim in (1, -1):  # each member's input: `world` copies of its data along dim
        full = torch.cat([mine] * world, dim).float()
        want = sum(torch.cat([p] * world, dim) for p in per_rank).chunk(world, dim)[rank]
        check(f"reduce_scatter dim {dim}", C.reduce_scatter_sum(full, dim, shm), want,
              C.reduce_scatter_sum(full, dim, gloo))
    y = torch.randn(8 * world, 5, generator=g).bfloat16()
    check("reduce_scatter bf16 dim 0", C.reduce_scatter_sum(y, 0, shm),
          (y.double() * world).chunk(world, 0)[rank], C.reduce_scatter_sum(y, 0, gloo))
    S.disable_shared_memory(shm)
    assert not S.shared_memory_enabled(shm)
    return bad


@pytest.mark.parametrize("world,slot", [(2, 2 << 20), (3, 256), (4, 1024)])
def test_shared_memory_collectives_match_gloo_and_closed_form(world, slot):
    for bad in run_ranks(_collectives_agree, world, slot):
        assert not bad, bad
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("mapp-")]


def _model_parallel_groups(rank, world, pp, env):
    os.environ.update(env)
    import megatronapp as mapp
    from megatronapp import parallel_state as S

    st = mapp.initialize_model_parallel(tensor_model_parallel_size=2,
                                        pipeline_model_parallel_size=pp)
    return [S.shared_memory_enabled(g) for g in
            (st.tensor_group, st.data_group, st.model_group, st.pipeline_group)] + [
                S.shared_memory_enabled(st.pipeline_group, p2p=True)]


def test_model_parallel_groups_use_shared_memory_by_default_and_can_opt_out():
    # TP2 x PP2: tensor and model groups (data groups are single ranks); the
    # pipeline group's send/recv transport (not its collectives) on request.
    assert run_ranks(_model_parallel_groups, 4, 2, {}) == [[True, False, True, False, False]] * 4
    assert (run_ranks(_model_parallel_groups, 4, 2, {"MAPP_SHM_P2P": "1"})
            == [[True, False, True, False, True]] * 4)
    # TP2 x DP2: the data-parallel group too; pipeline groups are single ranks.
    assert run_ranks(_model_parallel_groups, 4, 1, {}) == [[True, True, True, False, False]] * 4
    assert (run_ranks(_model_parallel_groups, 4, 2, {"MAPP_SHM_COLLECTIVES": "0",
                                                      "MAPP_SHM_P2P": "1"})
            == [[False] * 5] * 4)


def _other_node(rank, world):
    import torch.distributed as dist

    import megatronapp  # noqa: F401
    from megatronapp import _collectives as C
    from megatronapp import parallel_state as S

    S.node_identity = lambda: f"node-{rank}"  # as if each rank had its own host
    g = dist.new_group(list(range(world)))
    enabled = S.enable_shared_memory(g)
    x = torch.full((3,), float(rank + 1))
    C.all_reduce_sum_(x, g)
    return enabled, x.tolist()


def test_group_spanning_nodes_stays_on_gloo():
    want = float(sum(range(1, 3)))
    assert run_ranks(_other_node, 2) == [(False, [want] * 3)] * 2


def _missing_member(rank, world):
    os.environ["MAPP_COLLECTIVE_TIMEOUT_S"] = "2"
    import torch.distributed as dist

    import megatronapp  # noqa: F401
    from megatronapp import _collectives as C
    from megatronapp import parallel_state as S

    g = dist.new_group(list(range(world)))
    assert S.enable_shared_memory(g)
    if rank == 1:
        return "skipped"  # never joins the all-reduce
    with pytest.raises(RuntimeError, match="timed out waiting for the other members"):
        C.all_reduce_sum_(torch.ones(4), g)
    with pytest.raises(RuntimeError, match="cannot be used again"):
        C.all_reduce_sum_(torch.ones(4), g)
    return "raised"


def test_missing_member_is_an_error_not_a_hang():
    assert run_ranks(_missing_member, 2) == ["raised", "skipped"]


def _compressed_agree(rank, world):
    import torch.distributed as dist

    import megatronapp as mapp
    from megatronapp import parallel_state as S

    shm, gloo = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    assert S.enable_shared_memory(shm)
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(1000, generator=g)
    bad = []
    for spec in ("none", "bf16", "int8", "onebit", "topk:0.1"):
        a = mapp.comm.all_reduce(x.clone(), shm, spec)
        b = mapp.comm.all_reduce(x.clone(), gloo, spec)
        ra = mapp.comm.reduce_scatter(x.clone(), shm, spec)
        rb = mapp.comm.reduce_scatter(x.clone(), gloo, spec)
        # The codecs' payloads are only moved: same bytes, same decoded sums.
        # Plain sums of 3+ members differ from Gloo's in summation order only.
        if spec == "none" and world > 2:
            ok = torch.allclose(a, b, atol=1e-6) and torch.allclose(ra, rb, atol=1e-6)
        else:
            ok = torch.equal(a, b) and torch.equal(ra, rb)
        if not ok:
            bad.append(f"{spec}: max diff {(a - b).abs().max().item():.3e}")
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_collectives_through_shared_memory_match_gloo(world):
    for bad in run_ranks(_compressed_agree, world):
        assert not bad, bad


def _coalesced_and_finish_sums(rank, world):
    """torch.ops.mapp.coalesced_all_reduce_ (mixed dtypes, a non-contiguous
    tensor, a scale, buffers split at 25 MiB) and finish_grad_sums_ (SP sums,
    tied embeddings, zb-v's local pair) against float64 closed forms."""
    import torch.distributed as dist

    import megatronapp  # noqa: F401  (loads torch.ops.mapp)

    group = dist.group.WORLD.group_name
    bad = []

    def of(r, shape, dtype, seed):
        return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 31 * r),
                            dtype=torch.float64)).to(dtype)

    specs = [((7, 5), torch.float32), ((3,), torch.float64), ((4, 6), torch.bfloat16),
             ((1 << 22,), torch.float32), ((3 << 20,), torch.float32), ((9,), torch.float32)]
    mine = [of(rank, s, d, i) for i, (s, d) in enumerate(specs)]
    mine.append(of(rank, (6, 4), torch.float32, 99).t())  # non-contiguous
    want = [sum(of(r, s, d, i).double() for r in range(world)) / world
            for i, (s, d) in enumerate(specs)]
    want.append(sum(of(r, (6, 4), torch.float32, 99).double() for r in range(world)).t() / world)
    torch.ops.mapp.coalesced_all_reduce_(mine, group, 1.0 / world)
    for i, (got, w) in enumerate(zip(mine, want, strict=True)):
        tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-5
        if got.shape != w.shape or not torch.allclose(got.double(), w, rtol=tol, atol=tol):
            bad.append(f"coalesced tensor {i} ({got.dtype})")
    # SP partial sums over the group, the embedding over the group
    sp, emb = [of(rank, (5,), torch.float32, 1)], [of(rank, (2, 3), torch.float32, 2)]
    torch.ops.mapp.finish_grad_sums_(sp, group, emb, group)
    if not torch.allclose(sp[0].double(), sum(of(r, (5,), torch.float32, 1).double()
                                              for r in range(world)), atol=1e-5):
        bad.append("sequence-parallel sum")
    if not torch.allclose(emb[0].double(), sum(of(r, (2, 3), torch.float32, 2).double()
                                               for r in range(world)), atol=1e-5):
        bad.append("embedding sum")
    # two tied embeddings on this rank (zb-v): added locally, no collective
    a, b = torch.ones(3), torch.full((3,), 2.0)
    torch.ops.mapp.finish_grad_sums_([], "", [a, b], group)
    if not (torch.equal(a, torch.full((3,), 3.0)) and torch.equal(b, a)):
        bad.append("local pair")
    return bad


def test_coalesced_all_reduce_and_finish_sums_match_closed_forms():
    assert run_ranks(_coalesced_and_finish_sums, 2) == [[], []]
