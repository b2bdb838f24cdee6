"""End-to-end GPT: the losses of the first steps agree across parallel layouts.

The model draws full weights and slices them, and every rank sees the same
global batch, so TP=1, TP=2 (with and without sequence parallelism) and
TP=2 x DP=2 must produce the same losses up to float32 reduction order."""

import pytest

from dist_harness import run_ranks

STEPS = 4
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--train-iters", str(STEPS),
         "--eval-iters", "1", "--no-progress", "--log-interval", "1000"]


def _train(rank, world, extra, out_dir):
    from megatronapp.pretrain import build_parser, train

    args = build_parser().parse_args(FLAGS + extra + ["--output-dir", out_dir])
    return train(args)["losses"]


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    return run_ranks(_train, 1, [], str(tmp_path_factory.mktemp("tp1")))[0]


@pytest.mark.parametrize("world,extra", [
    (2, ["--tensor-model-parallel-size", "2"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    (4, ["--tensor-model-parallel-size", "2"]),  # tp 2 x dp 2
    (2, ["--tensor-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]),
])
def test_gpt_losses_match_tp1(reference_losses, tmp_path, world, extra):
    if "--untie-embeddings-and-output-weights" in extra:
        reference = run_ranks(_train, 1, ["--untie-embeddings-and-output-weights"], str(tmp_path / "r"))[0]
    else:
        reference = reference_losses
    losses = run_ranks(_train, world, extra, str(tmp_path))
    assert len(reference) == STEPS
    assert reference[-1] < reference[0]  # it learns
    for rank_losses in losses:
        for step, (got, want) in enumerate(zip(rank_losses, reference, strict=True)):
            assert abs(got - want) < 1e-4, f"step {step + 1}: {got} vs TP=1 {want} ({extra})"


def test_outputs_written(tmp_path):
    run_ranks(_train, 2, ["--tensor-model-parallel-size", "2"], str(tmp_path))
    assert (tmp_path / "loss.csv").read_text().count("\n") == STEPS + 1
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert (tmp_path / "summary.json").exists()


PP_REF = ["--num-layers", "4"]


@pytest.fixture(scope="module")
def reference_losses_4layers(tmp_path_factory):
    return run_ranks(_train, 1, PP_REF, str(tmp_path_factory.mktemp("pp1")))[0]


@pytest.mark.parametrize("world,extra", [
    (2, ["--pipeline-model-parallel-size", "2"]),  # 1F1B, tied embeddings across stages
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe",
         "--decoder-first-pipeline-num-layers", "1"]),  # uneven: 1 + 3 layers
    (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--pipeline-schedule", "zero-bubble", "--use-distributed-optimizer"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel", "--pipeline-schedule", "gpipe"]),
    (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dynamic",
         "--pipeline-replan-interval", "2", "--use-distributed-optimizer"]),  # pp 2 x dp 2
    # ZB-V: stage 0 holds layers 0 and 3, the embedding and the tied output layer
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel", "--pipeline-schedule", "zb-v", "--use-distributed-optimizer"]),
])
def test_gpt_pipeline_losses_match_single_process(reference_losses_4layers, tmp_path, world,
                                                  extra):
    losses = run_ranks(_train, world, PP_REF + extra, str(tmp_path))
    for rank_losses in losses:
        for step, (got, want) in enumerate(zip(rank_losses, reference_losses_4layers,
                                               strict=True)):
            assert abs(got - want) < 1e-4, f"step {step + 1}: {got} vs PP=1 {want} ({extra})"


@pytest.mark.parametrize("world,extra,message", [
    (2, ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
     "3 layers do not divide evenly over 2 virtual pipeline stages"),
    (4, ["--num-layers", "2", "--pipeline-model-parallel-size", "2",
         "--virtual-pipeline-model-parallel-size", "2"], "2 layers cannot fill 4 virtual"),
    (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
         "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "6"],
     "must be a multiple of the pipeline size"),
    (3, ["--pipeline-model-parallel-size", "2"], "world size 3 is not divisible"),
    (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
         "--pipeline-layer-layout", "1,2"], "must have positive counts summing to --num-layers 4"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-layout", "1,x"],
     "expected comma-separated layer counts"),
    (2, ["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v",
         "--virtual-pipeline-model-parallel-size", "3"], "runs two model chunks per stage"),
])
def test_bad_pipeline_configuration_is_rejected_before_any_collective(world, extra, message):
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, ConfigError

    args = build_parser().parse_args(FLAGS + extra)
    with pytest.raises(ConfigError, match=message):
        Config.from_args(args).check(world)
