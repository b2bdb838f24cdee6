"""Pipeline parallelism: the executor on real Gloo ranks (PP=2, PP=4,
PP=2 x TP=2, PP=2 x DP=2 with DDP) for every schedule (ZB-V's wave
placement included) against the
single-process model; schedules and simulator from Python."""

import pytest

import torch
from dist_harness import assert_variants_identical, run_ranks, train_variants

H, S, B = 8, 4, 3  # hidden, sequence, micro-batch

V1 = ["gpipe", "1f1b", "zero-bubble", ("dynamic", "dfc"), ("dynamic", "bfc"),
      ("dynamic", "auto"), ("dynamic", "adaptive")]
V2 = ["interleaved", ("dynamic", "dfc"), ("dynamic", "auto"), ("dynamic", "adaptive")]


def _blocks(n):
    import megatronapp as mapp
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(H)
            self.fc1 = mapp.tensor_parallel.ColumnParallelLinear(H, 2 * H)
            self.fc2 = mapp.tensor_parallel.RowParallelLinear(2 * H, H)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))

    torch.manual_seed(0)
    return [Block() for _ in range(n)]


def _microbatch(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _loss(out, target):
    return (out - target).pow(2).mean()


def _reference(rank, world, configs):
    import megatronapp as mapp

    mapp.initialize_model_parallel(1, 1)
    out = {}
    for n_blocks, m in configs:
        model = torch.nn.Sequential(*_blocks(n_blocks))
        losses = []
        for i in range(m):
            x, y = _microbatch(i)
            loss = _loss(model(x), y)
            losses.append(float(loss.detach()))
            (loss / m).backward()
        out[(n_blocks, m)] = ({n: p.grad.clone() for n, p in model.named_parameters()}, losses)
    return out


def _run(rank, world, tp, pp, v_list, m, use_ddp):
    import megatronapp as mapp
    from megatronapp import pipeline
    from megatronapp.pipeline.layout import virtual_stage

    state = mapp.initialize_model_parallel(tp, pp)
    dp = state.dp_size
    out = {}
    for v, names, *placement in v_list:
        blocks = _blocks(pp * v)
        mine = [virtual_stage(state.pp_rank, c, pp, *placement) for c in range(v)]
        chunks = [torch.nn.Sequential(blocks[vs]) for vs in mine]
        if use_ddp:
            chunks = [mapp.data_parallel.DistributedDataParallel(c, bucket_size_mb=0.0005)
                      for c in chunks]
        for name in names:
            if isinstance(name, tuple):
                sched = pipeline.Schedule.dynamic(pp, m, v, policy=name[1])
                key = f"{name[0]}-{name[1]}-v{v}"
            else:
                sched = pipeline.Schedule.by_name(name, pp, m, v)
                key = f"{name}-v{v}"
            for b in blocks:
                for p in b.parameters():
                    p.grad = None
            data = iter([_microbatch(state.dp_rank * m + i) for i in range(m)])
            # With tp > 1 the blocks' outputs are equal on both tensor ranks:
            # each sends half of every tensor between stages.
            res = pipeline.forward_backward(sched, chunks, data, _loss, tensor_shape=(S, B, H),
                                            scatter_gather=tp > 1)
            sends = sum(a.type in ("SEND_ACT", "SEND_GRAD") for a in sched.actions(state.pp_rank))
            grads = {}
            for vs, c in zip(mine, chunks, strict=True):
                module = c.module if use_ddp else c
                for n, p in module.named_parameters():
                    g = p.grad.clone()
                    grads[(vs, n.split(".", 1)[1], getattr(p, "partition_dim", None))] = g
            out[key] = {"grads": grads, "peak": res.peak_activations,
                        "expected_peak": sched.peak_activations(state.pp_rank),
                        "losses": [float(x) for x in res.losses], "tp": (state.tp_rank, tp),
                        "dp": dp, "sent": (res.sent_bytes, sends * S * B * H * 4 // tp)}
    return out


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference, 1, [(n, m) for n in (2, 4, 8) for m in (4, 8)])[0]


@pytest.mark.parametrize("tp,pp,world,ddp", [(1, 2, 2, False), (1, 4, 4, False),
                                             (2, 2, 4, False), (1, 2, 4, True)])
def test_executor_gradients_match_single_process(reference, tp, pp, world, ddp):
    """Every schedule's gradients and losses against the single-process model;
    at TP2 x PP2 the stages exchange halves (scatter/gather over the tensor
    group), and every rank sent exactly its share of the bytes."""
    m = 4
    v_list = [(1, V1), (2, V2), (2, ["zb-v"], "wave")]
    results = run_ranks(_run, world, tp, pp, v_list, m, ddp, timeout=600)
    dp = world // (tp * pp)
    checked = 0
    for r in results:
        for key, res in r.items():
            v = 2 if key.endswith("v2") else 1
            ref_grads, ref_losses = reference[(pp * v, m * dp)]
            assert res["peak"] == res["expected_peak"], (key, res["peak"], res["expected_peak"])
            assert res["sent"][0] == res["sent"][1], (key, res["sent"])
            tp_rank, tp_size = res["tp"]
            for (vs, name, pdim), g in res["grads"].items():
                full = ref_grads[f"{vs}.{name}"]
                if pdim is not None:
                    full = full.chunk(tp_size, dim=pdim)[tp_rank]
                err = float((g - full).abs().max())
                assert err < 1e-5, (key, vs, name, err)
                checked += 1
            if res["losses"]:
                dp_rank = None  # losses of this replica's microbatches are one of the dp slices
                slices = [ref_losses[i * m:(i + 1) * m] for i in range(dp)]
                assert any(max(abs(a - b) for a, b in zip(res["losses"], s, strict=True)) < 1e-5
                           for s in slices), (key, res["losses"], dp_rank)
    assert checked > 0


def test_schedule_api_and_closed_forms(tmp_path):
    from megatronapp import pipeline as pl

    for p, m in [(2, 4), (4, 8), (4, 16)]:
        for s in (pl.Schedule.gpipe(p, m), pl.Schedule.one_f_one_b(p, m)):
            r = pl.simulate(s, forward=1.0, backward_input=0.5, backward_weight=0.5)
            assert abs(r.bubble_fraction - (p - 1) / (m + p - 1)) < 1e-12
        for v in (2, 3):
            r = pl.simulate(pl.Schedule.interleaved(p, m, v))
            assert abs(r.bubble_fraction - (p - 1) / (v * m + p - 1)) < 1e-12
        zb = pl.simulate(pl.Schedule.zero_bubble(p, m))
        ofob = pl.simulate(pl.Schedule.one_f_one_b(p, m))
        bubble = [(x.bubble_fraction * p * x.makespan) for x in (zb, ofob)]
        assert bubble[0] <= bubble[1] / 3 + 1e-9
    s = pl.Schedule.interleaved(2, 4, 2)
    assert s.actions(0)[0].type == "F" and s.actions(1)[0].type == "RECV_ACT"
    assert pl.Schedule.from_json(s.to_json()).actions(1) == s.actions(1)
    path = tmp_path / "s.csv"
    path.write_text(s.to_csv())
    assert pl.Schedule.from_csv(path).actions(0) == s.actions(0)
    hand = pl.Schedule.from_actions([[("F", 0), ("B", 0)], [("F", 0), ("B", 0)]], microbatches=1)
    assert [a.type for a in hand.actions(1)] == ["RECV_ACT", "F", "B", "SEND_GRAD"]
    with pytest.raises(ValueError, match=r"stage 1, action #1 B\(mb=0, chunk=0\): backward before"):
        pl.Schedule.from_actions([[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]], microbatches=1)
    with pytest.raises(ValueError, match="must be a multiple of the pipeline size"):
        pl.Schedule.interleaved(4, 6, 2)
    with pytest.raises(ValueError, match="unknown dynamic pipeline policy"):
        pl.Schedule.dynamic(2, 4, policy="fastest")
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        pl.Schedule.by_name("2f2b", 2, 4)
    # latency + bytes / bandwidth: one GPipe microbatch crosses each link twice
    r = pl.simulate(pl.Schedule.gpipe(2, 1), p2p=0.01, bandwidth=1e9, message_bytes=1e8)
    assert abs(r.makespan - (3 * 2 + 2 * (0.01 + 0.1))) < 1e-12
    r = pl.simulate(pl.Schedule.zero_bubble(4, 8), p2p=0.1)
    r.gantt(tmp_path / "zb.png")
    import json

    trace = json.loads(r.chrome_trace(tmp_path / "zb.json"))
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(r.timeline)
    assert (tmp_path / "zb.png").stat().st_size > 1000


GPT_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--lr", "1e-3", "--lr-warmup-iters", "1", "--train-iters", "2", "--eval-iters", "1",
             "--no-progress", "--no-watchdog", "--hidden-dropout", "0.1",
             "--attention-dropout", "0.1", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("layout", [
    ["--pipeline-schedule", "1f1b"],
    ["--pipeline-schedule", "zero-bubble", "--use-distributed-optimizer"],
    ["--pipeline-schedule", "1f1b", "--virtual-pipeline-model-parallel-size", "2"],
    ["--pipeline-schedule", "1f1b", "--num-experts", "4", "--moe-router-topk", "2"],
], ids=["1f1b", "zero-bubble-zero1", "interleaved", "moe"])
def test_scatter_gather_between_stages_is_bit_identical(tmp_path, layout):
    """TP2 x PP2 without sequence parallelism, --scatter-gather-tensors-in-pipeline:
    each tensor rank sends half of every activation and gradient and the
    receivers all-gather; losses, gradients and weights equal those of sending
    whole tensors, with dropout on, in 1F1B, zero-bubble + ZeRO-1, interleaved
    and MoE."""
    variants = {"whole": [], "scatter-gather": ["--scatter-gather-tensors-in-pipeline"]}
    results = run_ranks(train_variants, 4, GPT_FLAGS + layout, variants, str(tmp_path),
                        timeout=400)
    assert_variants_identical(results, list(variants))


def _engine_unwinds(rank, world):
    """One stage: exceptions from a chunk's forward, from a custom autograd
    Function's backward and from the loss reach the caller as themselves, and
    the DDP reducer's switches the engine flips during a step are restored."""
    import megatronapp as mapp
    from megatronapp import pipeline

    mapp.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    net = mapp.data_parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    sched = pipeline.Schedule.by_name("1f1b", 1, 3)
    data = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(3)]

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise KeyError("boom in backward")

    def bad_forward_loss(out, y):
        raise ZeroDivisionError("boom in the loss")

    seen = []
    for name, loss in [("loss", bad_forward_loss),
                       ("backward", lambda out, y: Boom.apply(out).sum())]:
        try:
            pipeline.forward_backward(sched, net, iter(data), loss)
        except Exception as e:  # noqa: BLE001 - the type is the point
            seen.append((name, type(e).__name__, str(e)))
        r = net._reducer
        seen.append((name, r.sync, r.finish_at_backward_end))
    # After the failures a normal step runs, with the same gradients as autograd.
    net.zero_grad_buffer()
    res = pipeline.forward_backward(sched, net, iter(data), lambda o, y: (o - y).pow(2).mean())
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(net.module.state_dict())
    for x, y in data:
        ((ref(x) - y).pow(2).mean() / 3).backward()
    return seen, float((net.module.weight.grad - ref.weight.grad).abs().max()), len(res.losses)


def test_engine_exceptions_surface_as_themselves_and_restore_the_reducer():
    seen, err, n = run_ranks(_engine_unwinds, 1)[0]
    assert seen[0] == ("loss", "ZeroDivisionError", "boom in the loss"), seen
    assert seen[2][:2] == ("backward", "KeyError") and "boom in backward" in seen[2][2], seen
    assert seen[1] == ("loss", True, True) and seen[3] == ("backward", True, True), seen
    assert err < 1e-6 and n == 3


def _gil_released(rank, world):
    """Stage 1 waits for stage 0's slow forward inside the engine: a Python
    thread (as the dead-rank watchdog's heartbeat) keeps running meanwhile."""
    import threading
    import time

    import megatronapp as mapp
    from megatronapp import pipeline

    st = mapp.initialize_model_parallel(1, 2)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)

    def slow(x):
        if st.pp_rank == 0:
            t = time.monotonic() + 0.6
            while time.monotonic() < t:  # busy: holds the GIL on rank 0 only
                pass
        return lin(x)

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return slow(x)

    ticks, stop = [0], threading.Event()

    def beat():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.01)

    data = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(2)]
    th = threading.Thread(target=beat, daemon=True)
    th.start()
    t0 = time.monotonic()
    pipeline.forward_backward(pipeline.Schedule.by_name("1f1b", 2, 2), Chunk(), iter(data),
                              lambda o, y: (o - y).pow(2).mean(), tensor_shape=(2, 4))
    wall = time.monotonic() - t0
    stop.set()
    th.join()
    return ticks[0], wall


def test_engine_releases_the_gil_while_it_waits():
    ticks, wall = run_ranks(_gil_released, 2)[1]
    assert wall > 1.0, wall  # stage 1 waited for two slow forwards
    assert ticks > 0.5 * wall / 0.01 * 0.5, (ticks, wall)  # the heartbeat thread kept beating


def _adaptive(rank, world):
    """AdaptiveSchedule (the engine's mapp::AdaptiveSchedule) at PP2 with a slow
    second stage: one re-plan after `interval` steps from measured F/B times
    and a probed link, the same plan on both ranks, and the plan is the
    dynamic planner's under the reported costs."""
    import time

    import megatronapp as mapp
    from megatronapp import pipeline

    st = mapp.initialize_model_parallel(1, 2)
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            if st.pp_rank == 1:
                t = time.monotonic() + 0.01
                while time.monotonic() < t:
                    pass
            return self.lin(x)

    sched = pipeline.AdaptiveSchedule(2, 4, interval=2)
    first = sched.schedule.to_csv()
    data = [(torch.randn(2, 8), torch.randn(2, 8)) for _ in range(4)]
    for _ in range(2):
        res = pipeline.forward_backward(sched.schedule, Chunk(), iter(data),
                                        lambda o, y: (o - y).pow(2).mean(), tensor_shape=(2, 8))
        sched.observe(res)
    c = sched.costs
    again = pipeline.Schedule.dynamic(2, 4, 1, "adaptive", None, c).to_csv()
    return (first, sched.replans, list(c.forward), list(c.p2p), sched.schedule.to_csv(), again)


def test_adaptive_schedule_replans_from_measured_times_alike_on_every_rank():
    a, b = run_ranks(_adaptive, 2)
    assert a[1] == b[1] == 1
    assert a[2] == b[2] and a[3] == b[3]  # one all-reduce: the same numbers everywhere
    f0, f1 = a[2]
    assert f1 > f0 + 0.005, a[2]  # stage 1's 10 ms forwards were measured
    assert a[3][0] > 0, a[3]  # the link 0 <-> 1 was probed
    assert a[4] == b[4] == a[5]  # the planner's plan under those costs, on both ranks
