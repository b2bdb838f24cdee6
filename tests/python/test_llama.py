"""The Llama / Qwen / Mixtral blocks compose with everything: a Llama-shaped
model (RMSNorm, SwiGLU, RoPE with Llama-3.1 scaling, grouped-query attention,
no biases, untied output layer) trains step for step like one rank (fp32,
1e-5) under TP2, TP2+SP, TP4 (query groups replicated over tensor ranks),
PP2 with every schedule, CP2 (p2p and a2a: RoPE on the zigzag chunks),
ZeRO-1 (and ZeRO-1 + int8), selective and full recomputation, MegaFBD and a
resharded resume; bf16 tracks fp32; the Qwen2/Qwen3 options under TP2; the
Mixtral block (SwiGLU experts, shared experts, top-k scaling) under EP2 and
TP2 x EP2. The default flags keep the GPT-2 block exactly."""

from __future__ import annotations

import pytest

from dist_harness import PP2_FBD_RECOMPUTE, error_messages, run_ranks

STEPS = 3
BASE = ["--num-layers", "4", "--hidden-size", "64", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
        "--lr-warmup-iters", "1", "--train-iters", str(STEPS), "--eval-iters", "1",
        "--no-progress", "--log-interval", "1000", "--make-vocab-size-divisible-by", "64"]
LLAMA = BASE + ["--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                "--ffn-hidden-size", "96", "--swiglu", "--normalization", "RMSNorm",
                "--norm-epsilon", "1e-6", "--position-embedding-type", "rope",
                "--rotary-base", "500000", "--use-rope-scaling",
                "--rope-scaling-original-max-position", "16", "--disable-bias-linear",
                "--untie-embeddings-and-output-weights"]
MIXTRAL = LLAMA + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff",
                   "1e-2"]


def _train(rank, world, flags, out_dir):
    from megatronapp.pretrain import build_parser, train

    return train(build_parser().parse_args(flags + ["--output-dir", out_dir]))["losses"]


def _ref(tmp_path_factory, flags, name):
    return run_ranks(_train, 1, flags, str(tmp_path_factory.mktemp(name)))[0]


@pytest.fixture(scope="module")
def llama_ref(tmp_path_factory):
    return _ref(tmp_path_factory, LLAMA, "llama_ref")


def _close(got_ranks, want, tol=1e-5, what=""):
    assert len(want) == STEPS and want[-1] < want[0], want  # it learns
    for losses in got_ranks:
        assert len(losses) == len(want)
        for i, (g, w) in enumerate(zip(losses, want, strict=True)):
            assert abs(g - w) < tol, f"{what} step {i + 1}: {g} vs one rank's {w}"


PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = [
    (2, ["--tensor-model-parallel-size", "2"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    (4, ["--tensor-model-parallel-size", "4", "--sequence-parallel"]),  # 2 groups over 4 ranks
    (2, PP2 + ["--pipeline-schedule", "1f1b"]),
    (2, PP2 + ["--pipeline-schedule", "gpipe"]),
    (2, PP2 + ["--virtual-pipeline-model-parallel-size", "2"]),  # interleaved 1F1B
    (2, PP2 + ["--pipeline-schedule", "zero-bubble"]),
    (2, PP2 + ["--pipeline-schedule", "dynamic", "--virtual-pipeline-model-parallel-size", "2"]),
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel", "--pipeline-schedule", "zero-bubble"]),
    (2, ["--use-distributed-optimizer"]),
    (1, ["--recompute-granularity", "selective", "--attention-backend", "unfused"]),
    (2, ["--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
         "--recompute-method", "uniform", "--recompute-num-layers", "2"]),
    (4, PP2_FBD_RECOMPUTE),
]


@pytest.mark.parametrize("world,extra", LAYOUTS, ids=lambda v: "-".join(v) if isinstance(
    v, list) else str(v))
def test_llama_block_trains_like_one_rank(llama_ref, tmp_path, world, extra):
    _close(run_ranks(_train, world, LLAMA + extra, str(tmp_path)), llama_ref, what=extra)


def test_zero1_with_int8_gradients(llama_ref, tmp_path):
    """int8 gradients are lossy: the first step is exact, the next ones close."""
    got = run_ranks(_train, 2, LLAMA + ["--use-distributed-optimizer", "--grad-compression",
                                        "int8"], str(tmp_path))
    for losses in got:
        assert abs(losses[0] - llama_ref[0]) < 1e-5
        assert all(abs(g - w) < 5e-3 for g, w in zip(losses, llama_ref, strict=True)), losses


def test_bf16_tracks_fp32(llama_ref, tmp_path):
    got = run_ranks(_train, 2, LLAMA + ["--tensor-model-parallel-size", "2", "--bf16"],
                    str(tmp_path))[0]
    for g, w in zip(got, llama_ref, strict=True):
        assert abs(g - w) / w < 0.02, (got, llama_ref)


def test_resume_reshards_tp2_pp2_into_one_rank(llama_ref, tmp_path):
    ck = str(tmp_path / "ck")
    first = LLAMA[:]
    first[first.index("--train-iters") + 1] = "2"
    run_ranks(_train, 4, first + ["--tensor-model-parallel-size", "2",
                                  "--pipeline-model-parallel-size", "2", "--save", ck],
              str(tmp_path / "a"))
    # the architecture comes from the checkpoint: no block flag given
    resumed = run_ranks(_train, 1, BASE + ["--load", ck], str(tmp_path / "b"))[0]
    assert len(resumed) == 1 and abs(resumed[0] - llama_ref[2]) < 1e-5, (resumed, llama_ref)


@pytest.mark.parametrize("extra", [["--add-qkv-bias"], ["--qk-layernorm", "--kv-channels", "32"],
                                   ["--rotary-interleaved", "--rotary-percent", "0.5"]],
                         ids=["qwen2", "qwen3", "interleaved-partial-rope"])
def test_qwen_and_rope_options_under_tp2_and_sp(tmp_path_factory, tmp_path, extra):
    ref = _ref(tmp_path_factory, LLAMA + extra, "qwen_ref")
    got = run_ranks(_train, 2, LLAMA + extra + ["--tensor-model-parallel-size", "2",
                                                "--sequence-parallel"], str(tmp_path))
    _close(got, ref, what=extra)


@pytest.fixture(scope="module")
def mixtral_ref(tmp_path_factory):
    return _ref(tmp_path_factory, MIXTRAL, "mixtral_ref")


@pytest.mark.parametrize("world,extra", [
    (2, ["--expert-model-parallel-size", "2"]),
    (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
         "--sequence-parallel"]),
    (2, PP2 + ["--pipeline-schedule", "zero-bubble"]),
])
def test_mixtral_block_trains_like_one_rank(mixtral_ref, tmp_path, world, extra):
    _close(run_ranks(_train, world, MIXTRAL + extra, str(tmp_path)), mixtral_ref, what=extra)


def test_shared_experts_and_topk_scaling_under_ep2_tp2(tmp_path_factory, tmp_path):
    flags = MIXTRAL + ["--moe-shared-expert-intermediate-size", "64",
                       "--moe-router-topk-scaling-factor", "2.5"]
    ref = _ref(tmp_path_factory, flags, "shared_ref")
    got = run_ranks(_train, 4, flags + ["--expert-model-parallel-size", "2",
                                        "--tensor-model-parallel-size", "2"], str(tmp_path))
    _close(got, ref)


def _default_block_is_gpt2(rank, world):
    """The default flags build exactly the GPT-2 block: the same parameters
    and the same loss as the explicit GPT-2 flag values."""
    import megatronapp
    import torch
    from megatronapp.models import GPTConfig, GPTModel

    megatronapp.initialize_model_parallel()
    base = dict(vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4,
                seq_length=16)
    a = GPTModel(GPTConfig(**base), seed=3)
    b = GPTModel(GPTConfig(**base, normalization="LayerNorm", swiglu=False,
                           position_embedding_type="learned_absolute", num_query_groups=4,
                           kv_channels=8, add_bias_linear=True), seed=3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    names = [n for n, _ in a.named_parameters()]
    same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    return names, same, torch.equal(a(ids, ids), b(ids, ids))


def test_default_flags_keep_the_gpt2_block():
    names, same, loss_same = run_ranks(_default_block_is_gpt2, 1)[0]
    assert same and loss_same
    assert "position_embeddings.weight" in names and "layers.0.ln1.bias" in names
    assert "layers.0.attn.qkv.bias" in names and "layers.0.mlp.fc1.bias" in names


def _bad(rank, world, flags):
    from megatronapp.pretrain import build_parser, train

    try:
        train(build_parser().parse_args(flags))
    except SystemExit as e:
        return str(e)
    return None


@pytest.mark.parametrize("world,extra,message", [
    (1, ["--group-query-attention", "--num-query-groups", "3"],
     "--num-query-groups 3 must divide --num-attention-heads 4"),
    (1, ["--position-embedding-type", "rope", "--rotary-percent", "0.01"],
     "rotates no channel pair"),
    (1, ["--position-embedding-type", "rope", "--rotary-percent", "1.5"],
     "--rotary-percent must be in (0, 1]"),
    (1, ["--hidden-size", "62"], "set --kv-channels"),
])
def test_bad_block_flags_are_refused_before_any_collective(world, extra, message):
    flags = BASE + ["--num-attention-heads", "4"] + extra
    for msg in run_ranks(_bad, world, flags):
        assert msg is not None and message in msg, msg


def test_query_groups_that_do_not_divide_the_tensor_group_are_refused():
    flags = BASE + ["--num-attention-heads", "6", "--hidden-size", "48",
                    "--group-query-attention", "--num-query-groups", "3",
                    "--tensor-model-parallel-size", "2"]
    msgs = run_ranks(_bad, 2, flags)
    assert all("--num-query-groups 3 and --tensor-model-parallel-size 2: one must divide the "
               "other" in m for m in msgs), msgs


def test_gqa_config_errors_name_the_fix():
    from megatronapp.models import GPTConfig

    msgs = error_messages(
        lambda: GPTConfig(vocab_size=64, num_attention_heads=4, num_query_groups=3),
        lambda: GPTConfig(vocab_size=64, normalization="LayerNorm2"),
        lambda: GPTConfig(vocab_size=64, position_embedding_type="alibi"))
    assert "must divide --num-attention-heads" in msgs[0]
    assert "--normalization 'LayerNorm2'" in msgs[1]
    assert "--position-embedding-type 'alibi'" in msgs[2]
