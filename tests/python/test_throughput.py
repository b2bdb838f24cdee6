"""Model TFLOP/s per rank and MFU: the FLOP count against hand counts and
Megatron-LM's formula (num_floating_point_operations in its training.py,
transcribed here) for GPT and Llama blocks, and the numbers a run logs."""

import pytest

from dist_harness import run_ranks


def _gpt(**kw):
    from megatronapp.models import GPTConfig

    return GPTConfig(**{**dict(vocab_size=256, hidden_size=64, num_layers=2,
                               num_attention_heads=4, seq_length=32), **kw})


LLAMA = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
             position_embedding_type="rope", num_query_groups=2, ffn_hidden_size=172,
             share_embeddings_and_output_weights=False)


def _megatron(h, n, a, s, v, ffn, groups=None, gated=False, kv=None):
    """Megatron-LM's model FLOPs per token (forward + backward), dense models."""
    kv = kv or h // a
    groups = groups or a
    ratio = kv * a / h
    mult = 1.5 if gated else 1.0
    return 12 * n * h * h * ((1 + groups / a + s / h) * ratio + ffn / h * mult
                             + v / (2 * n * h))


def test_gpt_block_flops_by_hand_and_by_megatrons_formula():
    cfg = _gpt()
    h, s, f, v = 64, 32, 256, 256
    layer = (2 * h * 3 * h          # QKV
             + 2 * h * h            # attention output projection
             + 2 * h * f + 2 * f * h  # fc1, fc2
             + 2 * s * 4 * (16 + 16))  # scores and values: 2 s heads (d_qk + d_v)
    assert cfg.flops_per_token() == 2 * layer + 2 * v * h  # + the output layer
    assert 3 * cfg.flops_per_token() == _megatron(h, 2, 4, s, v, f)


def test_llama_block_flops_by_hand_and_by_megatrons_formula():
    cfg = _gpt(**LLAMA)
    h, s, f, v, d = 64, 32, 172, 256, 16
    layer = (2 * h * 4 * d          # queries: 4 heads
             + 2 * h * 2 * 2 * d    # keys and values: 2 groups
             + 2 * 4 * d * h        # output projection
             + 2 * h * 2 * f        # gate and up
             + 2 * f * h            # down
             + 2 * s * 4 * (d + d))
    assert cfg.flops_per_token() == 2 * layer + 2 * v * h
    assert 3 * cfg.flops_per_token() == pytest.approx(
        _megatron(h, 2, 4, s, v, f, groups=2, gated=True), rel=1e-12)


def test_moe_and_mla_flops_count_what_a_token_passes_through():
    h, s, v = 64, 32, 256
    moe = _gpt(**LLAMA, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48,
               moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1])
    dense = _gpt(**LLAMA)
    attn_and_core = 2 * h * 4 * 16 + 2 * h * 2 * 2 * 16 + 2 * 4 * 16 * h + 2 * s * 4 * 32
    expert = 2 * h * 2 * 48 + 2 * 48 * h
    shared = 2 * h * 2 * 32 + 2 * 32 * h
    moe_layer = attn_and_core + 2 * h * 8 + 2 * expert + shared  # router, top-2, shared
    dense_layer = attn_and_core + 2 * h * 2 * 172 + 2 * 172 * h
    assert moe.flops_per_token() == dense_layer + moe_layer + 2 * v * h
    assert dense.flops_per_token() == 2 * dense_layer + 2 * v * h
    mla = _gpt(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
               position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=24,
               kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
               ffn_hidden_size=96, mtp_num_layers=1)
    a = 4
    attn = (2 * h * 24 + 2 * 24 * a * (16 + 8)       # query down and up
            + 2 * h * (16 + 8) + 2 * 16 * a * (16 + 12)  # latent KV + rotary key, up
            + 2 * a * 12 * h                          # output projection
            + 2 * s * a * ((16 + 8) + 12))            # scores (qk + rope), values
    layer = attn + 2 * h * 2 * 96 + 2 * 96 * h
    mtp = 2 * 2 * h * h + layer + 2 * v * h           # projection, its layer, the head
    assert mla.flops_per_token() == 2 * layer + 2 * v * h + mtp


FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "3", "--eval-iters", "1", "--no-progress", "--log-interval", "1"]


def _run(rank, world, flags, out_dir):
    import contextlib
    import io

    from megatronapp.pretrain import build_parser, train

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        s = train(build_parser().parse_args(FLAGS + flags + ["--output-dir", out_dir]))
    return s, buf.getvalue()


def test_a_run_logs_tflops_per_rank_and_mfu(tmp_path):
    """TP2 x DP2 (4 ranks): each iteration's TFLOP/s per rank is the model
    FLOPs of a global batch over its seconds and the 4 ranks; MFU only with a
    peak (a CPU has none), shown in the log lines and the summary."""
    from megatronapp.models import GPTConfig

    flops = 3 * 8 * 32 * GPTConfig(vocab_size=256, hidden_size=64, num_layers=2,
                                   num_attention_heads=4, seq_length=32).flops_per_token()
    (s, out), *_ = run_ranks(_run, 4, ["--tensor-model-parallel-size", "2"],
                             str(tmp_path / "a"))
    for rec in s["history"]:
        assert rec["tflops_per_rank"] == pytest.approx(flops / rec["seconds"] / 4 / 1e12,
                                                       rel=1e-12)
        assert "mfu" not in rec
    assert "TFLOP/s/rank" in out and "MFU" not in out
    assert s["tflops_per_rank"] == pytest.approx(
        flops * 3 / s["train_seconds"] / 4 / 1e12, rel=1e-12)
    (s, out), *_ = run_ranks(_run, 2, ["--peak-tflops", "0.01"], str(tmp_path / "b"))
    for rec in s["history"]:
        assert rec["mfu"] == pytest.approx(rec["tflops_per_rank"] / 0.01, rel=1e-12)
    assert f"MFU {100 * s['history'][0]['mfu']:.1f}%" in out
    assert any("done:" in x and "TFLOP/s/rank, MFU" in x for x in out.splitlines()), out


def test_device_peaks():
    import torch
    from megatronapp.training.throughput import device_peak_tflops

    assert device_peak_tflops(torch.device("cpu")) is None
