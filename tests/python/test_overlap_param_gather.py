"""ZeRO-1's parameter all-gather overlapped with the next forward
(``--overlap-param-gather``, DistributedOptimizer(overlap_param_gather=True)):
the mechanism (the gathers are in flight after the step, a module waits only
for its own buckets, reading the weights waits for all) and training equal
to the synchronous gather bit for bit under TP2 x DP2 with a codec, PP2 x DP2
zero-bubble in bf16, and MoE experts on their expert-data group.
Checkpoint resume with it: test_checkpoint.py."""

import pytest

import torch
from dist_harness import assert_variants_identical, error_messages, run_ranks, train_variants


def _mechanism(rank, world):
    import torch.nn as nn

    from megatronapp.distributed.data_parallel import DistributedDataParallel
    from megatronapp.optimizer import DistributedOptimizer

    def build(overlap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                              nn.Linear(64, 8))
        # ~1 KiB buckets: one per layer (its weight and bias)
        ddp = DistributedDataParallel(model, bucket_size_mb=0.001)
        opt = DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2,
                                   overlap_param_gather=overlap)
        return model, ddp, opt

    def bucket_of(ddp, p):
        return next(b for b in ddp.buckets if any(q is p for q in b.params))

    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g))
            for _ in range(3)]
    out = {}
    for overlap in (False, True):
        model, ddp, opt = build(overlap)
        seen = []
        for i, (x, y) in enumerate(data):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if overlap and i == 0:
                in_flight = [b.gather_in_flight for b in ddp.buckets]
                # Observe the first layer's forward after DDP's own pre-hook ran.
                first, last = model[0], model[4]
                model[0].register_forward_pre_hook(lambda m, a: seen.append(
                    (bucket_of(ddp, first.weight).gather_in_flight is False,
                     bucket_of(ddp, last.weight).gather_in_flight)))
        weights = [p.detach().clone() for p in ddp.state_dict().values()]  # waits for all
        out[overlap] = weights
        if overlap:
            out["in_flight"], out["seen"] = in_flight, seen
            out["len"] = len(ddp.buckets)
    return out


def test_gathers_overlap_the_next_forward_and_end_bit_identical():
    for r in run_ranks(_mechanism, 2):
        assert r["len"] == 3 and all(r["in_flight"]), r["in_flight"]
        # the first layer's forward: its own bucket waited, the last layer's still in flight
        assert r["seen"] and r["seen"][0] == (True, True), r["seen"]
        assert all(torch.equal(a, b) for a, b in zip(r[False], r[True], strict=True))


FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "1", "--no-progress",
         "--no-watchdog", "--use-distributed-optimizer", "--bucket-size-mb", "0.05"]


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--grad-compression", "int8",
     "--optimizer-impl", "fused"],
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble", "--bf16"],
    ["--num-experts", "4", "--moe-router-topk", "1", "--expert-model-parallel-size", "2"],
], ids=["tp2xdp2-int8-fused", "pp2xdp2-zb-bf16", "moe-ep2xdp2"])
def test_training_equals_the_synchronous_gather(tmp_path, layout):
    variants = {"sync": [], "overlap": ["--overlap-param-gather"]}
    results = run_ranks(train_variants, 4, FLAGS + layout, variants, str(tmp_path), 3)
    assert_variants_identical(results, ["sync", "overlap"])


def test_flag_errors_say_what_to_change():
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, ConfigError

    def check(extra):
        return lambda: Config.from_args(build_parser().parse_args(FLAGS[:-3] + extra)).check(4)

    no_zero, fbd = error_messages(
        check(["--overlap-param-gather"]),
        check(["--use-distributed-optimizer", "--overlap-param-gather",
               "--pipeline-model-parallel-size", "2", "--forward-backward-disaggregating"]),
        exc=ConfigError)
    assert "needs --use-distributed-optimizer" in no_zero, no_zero
    assert "drop --overlap-param-gather" in fbd, fbd
