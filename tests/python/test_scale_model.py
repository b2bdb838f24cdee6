"""The scale model: closed forms on a communication-free machine, the
calibration round trip, and the published Megatron-LM runs it must reproduce."""

import dataclasses as dc

import pytest

from megatronapp.tools import scale_model as sm

IDEAL = sm.Hardware(name="ideal", peak_flops=100e12, hbm_bandwidth=1e30, gpus_per_node=8,
                    intra_bus_bandwidth=1e30, intra_latency=0.0, inter_bandwidth=1e30,
                    inter_latency=0.0, gemm_efficiency=0.5, memory_passes=0.0)
SMALL = sm.Job(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024,
               vocab_size=32000, tp=2, pp=4, dp=2, global_batch_size=64, recompute=False,
               optimizer_bytes=0.0)


def test_model_flops_match_the_published_iteration_time():
    # GPT-3 175B, batch 1536 on 1,024 A100 at 138 TFLOP/s: about 32 s per iteration.
    job = sm.GPT3_175B_1024
    assert job.model_flops() / (1024 * 138e12) == pytest.approx(32.0, rel=0.02)
    # Without recomputation: 72 B s l h^2 (1 + s/6h + V/12lh); the output layer
    # (6 B s h V) is never recomputed, so only the layers' part scales by 4/3.
    b, s, n, h, v = 1536, 2048, 96, 12288, 51200
    no_rc = dc.replace(job, recompute=False).model_flops()
    assert no_rc == pytest.approx(72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h)))
    assert job.model_flops() - 6 * b * s * h * v == pytest.approx(
        (no_rc - 6 * b * s * h * v) * 4 / 3)
    assert job.parameters() == pytest.approx(175e9, rel=0.01)


def test_one_f_one_b_closed_form_without_communication():
    r = sm.predict(SMALL, IDEAL)
    st = sm.stage_times(SMALL, IDEAL)
    m, p = SMALL.microbatches, SMALL.pp
    f = st["forward"]
    b = st["backward_input"] + st["backward_weight"]
    head = sum(st["head"].values())
    # The last stage (with the output layer) is the slowest; 1F1B's makespan is
    # the bottleneck stage's work plus the fill and drain of the others.
    assert r["pipeline_s"] >= m * (f + b) + head * m
    assert r["pipeline_s"] == pytest.approx((m + p - 1) * (f + b) + m * head, rel=0.02)
    assert r["dp_s"] < 1e-12 and r["optimizer_s"] == 0.0
    # A layer's forward: weight matmuls 2bs(4h^2 + 2hf)/t + attention 4bs^2h/t.
    b_, s, h, t = 1, 1024, 1024, 2
    layer = (2 * b_ * s * (4 * h * h + 8 * h * h) + 4 * b_ * s * s * h) / t / 50e12
    assert f == pytest.approx(2 * layer)


def test_bandwidth_terms():
    slow = dc.replace(IDEAL, inter_bandwidth=1e9)
    r = sm.predict(SMALL, slow)
    params = SMALL.parameters() / (SMALL.tp * SMALL.pp)
    # ring all-reduce over dp=2: 2 (d-1)/d x bytes / bw
    assert r["dp_s"] == pytest.approx(params * 2.0 / 1e9)
    int8 = sm.predict(dc.replace(SMALL, grad_bytes=1.0), slow)
    assert int8["dp_s"] == pytest.approx(r["dp_s"] / 2)
    overlapped = sm.predict(dc.replace(SMALL, overlap_dp=True), slow)
    assert overlapped["dp_exposed_s"] < r["dp_exposed_s"]


def test_calibration_round_trip():
    want = sm.predict(SMALL, dc.replace(IDEAL, gemm_efficiency=0.37))["tflops_per_gpu"]
    assert sm.calibrate(SMALL, IDEAL, want).gemm_efficiency == pytest.approx(0.37, abs=1e-3)
    with pytest.raises(ValueError, match="cannot reach"):
        sm.calibrate(SMALL, IDEAL, 1e6)


def test_reproduces_megatron_within_ten_percent():
    hw = sm.calibrate(sm.GPT3_175B_1024, sm.A100_SELENE, 138.0)
    assert 0.3 < hw.gemm_efficiency < 0.9
    # Held out: 1T parameters on 3,072 A100 at 502 PFLOP/s (Narayanan et al. 2021).
    for schedule, v in (("1f1b", 1), ("1f1b", 2)):
        got = sm.predict(dc.replace(sm.GPT_1T_3072, schedule=schedule, vpp=v), hw)
        assert got["aggregate_pflops"] == pytest.approx(502, rel=0.10), (schedule, v)


def test_bad_jobs_are_rejected():
    with pytest.raises(ValueError, match="not divisible"):
        sm.predict(dc.replace(SMALL, global_batch_size=63), IDEAL)
    with pytest.raises(ValueError, match="multiple of tp x pp"):
        sm.gpus_for(SMALL, 12)


def test_selective_recompute_reproduces_the_530b_run():
    """Calibrated on MT-NLG 530B with full recomputation (42.1% MFU on 2,240
    A100, Korthikanti et al. 2022), the model predicts the same run with
    selective recomputation and sequence parallelism: published 54.2%."""
    full = dc.replace(sm.MT_NLG_530B_2240, recompute=True, sequence_parallel=False)
    measured = 0.421 * sm.A100_SELENE.peak_flops / 1e12  # useful TFLOP/s per GPU
    hw = sm.calibrate(full, sm.A100_SELENE, measured * full.model_flops() / full.useful_flops())
    assert sm.predict(full, hw)["model_flops_utilization"] == pytest.approx(0.421, rel=1e-3)
    got = sm.predict(sm.MT_NLG_530B_2240, hw)
    assert got["model_flops_utilization"] == pytest.approx(0.542, rel=0.10)
    # selective: the hardware does almost no more work than the model needs
    assert got["hardware_flops_utilization"] < 1.02 * got["model_flops_utilization"]


def test_selective_adds_core_attention_to_backward_and_precision_scales_memory():
    st = {g: sm.stage_times(dc.replace(SMALL, recompute=g), IDEAL)
          for g in (None, "selective", "full")}
    b, s, h, t = 1, 1024, 1024, 2
    layers = SMALL.num_layers / SMALL.pp
    attn = 4 * b * s * s * h / t / 50e12
    assert st["selective"]["backward_input"] - st[None]["backward_input"] == pytest.approx(
        layers * attn)
    assert st["full"]["backward_input"] - st[None]["backward_input"] == pytest.approx(
        st[None]["forward"])
    assert SMALL.model_flops() == SMALL.useful_flops()
    sel = dc.replace(SMALL, recompute="selective")
    assert sel.model_flops() - sel.useful_flops() == pytest.approx(
        4 * SMALL.global_batch_size * s * s * h * SMALL.num_layers)
    slow_mem = dc.replace(IDEAL, hbm_bandwidth=1e12, memory_passes=2.0)
    f16 = sm.stage_times(SMALL, slow_mem)["forward"] - sm.stage_times(SMALL, IDEAL)["forward"]
    f32 = (sm.stage_times(dc.replace(SMALL, act_bytes=4), slow_mem)["forward"]
           - sm.stage_times(dc.replace(SMALL, act_bytes=4), IDEAL)["forward"])
    assert f32 == pytest.approx(2 * f16)
    with pytest.raises(ValueError, match="recompute must be"):
        dc.replace(SMALL, recompute="sometimes").model_flops()


def test_moe_terms_reduce_to_the_dense_closed_forms_and_count_deepseek_v3():
    import dataclasses as dc

    from megatronapp.tools import scale_model as sm

    job = sm.GPT3_175B_1024
    generic = dc.replace(job, attention_params=4 * job.hidden_size ** 2)  # same model, new path
    assert generic.per_token_terms and not job.per_token_terms
    assert abs(generic.useful_flops() / job.useful_flops() - 1) < 1e-12
    a, b = sm.predict(job, sm.A100_SELENE), sm.predict(generic, sm.A100_SELENE)
    # (the generic parameter count leaves out biases and LayerNorms: 1e-5 of the DP time)
    assert abs(a["iteration_s"] / b["iteration_s"] - 1) < 1e-5
    ds = sm.DEEPSEEK_V3_2048
    # the report's 671B main model, plus its MTP depth: 14B in the released
    # weights, which hold their own copies of the embedding and head (2 x 0.93B)
    assert abs((ds.parameters() - ds.mtp_parameters()) / 671e9 - 1) < 0.01
    assert 11e9 < ds.mtp_parameters() < 13e9
    # 37B activated per token: 2 x 37B FLOPs per token for the weights, +/- attention
    assert 70e9 < ds.forward_flops_per_token() < 100e9


def test_reproduces_deepseek_v3_training_cost_within_fifteen_percent():
    """180K H800 GPU-hours per trillion tokens (DeepSeek-V3 report), predicted
    with the matmul efficiency calibrated on GPT-3 175B (A100), never on it."""
    import dataclasses as dc

    from megatronapp.tools import scale_model as sm

    hw = sm.calibrate(sm.GPT3_175B_1024, sm.A100_SELENE, 138.0)
    h800 = dc.replace(sm.H800_DEEPSEEK, gemm_efficiency=hw.gemm_efficiency)
    got = sm.gpu_hours_per_trillion_tokens(sm.DEEPSEEK_V3_2048, h800)
    assert abs(got / 180e3 - 1) < 0.15, got
    # The all-to-all matters: not hidden, it would cost more.
    worse = sm.gpu_hours_per_trillion_tokens(dc.replace(sm.DEEPSEEK_V3_2048, a2a_overlap=0.0),
                                             h800)
    assert worse > got * 1.1


def test_context_parallel_terms_on_a_communication_free_machine():
    cp2 = dc.replace(SMALL, cp=2, dp=1)
    a, b = sm.stage_times(SMALL, IDEAL), sm.stage_times(cp2, IDEAL)
    assert b["forward"] == pytest.approx(a["forward"] / 2)  # half the tokens, half the work
    assert cp2.gpus == SMALL.gpus
    # A slow link: each ring step costs what the block of attention cannot hide.
    slow = dc.replace(IDEAL, intra_bus_bandwidth=1e9)
    cp2 = dc.replace(cp2, tp=1)  # (no tensor-parallel all-reduce on the slow link)
    b, b_slow = sm.stage_times(cp2, IDEAL), sm.stage_times(cp2, slow)
    s, h, t = 512, 1024, 1
    step = 2 * s * h / t * 2 / 1e9  # K and V of 512 tokens, bf16
    block = 4 * s * 1024 * h / t / 50e12 / 2
    layers = SMALL.num_layers / SMALL.pp
    assert b_slow["forward"] - b["forward"] == pytest.approx(layers * (step - block))
    assert b_slow["backward_input"] - b["backward_input"] == pytest.approx(
        layers * 2 * (step - block))
    with pytest.raises(ValueError, match="cp_comm_type"):
        sm.stage_times(dc.replace(cp2, cp_comm_type="ring"), IDEAL)


def test_reproduces_megatron_context_parallel_speedups_within_fifteen_percent():
    """Megatron-Core's context-parallel guide: GPT 175B at TP8CP2 runs 1.25x
    faster at 16K and TP8CP4 1.20x at 32K than TP8CP1, which must recompute
    everything to fit. Same GPUs and microbatches per pipeline; H100 with the
    matmul efficiency calibrated on GPT-3 175B (A100), never on these runs."""
    hw = dc.replace(sm.H100_EOS, gemm_efficiency=sm.calibrate(
        sm.GPT3_175B_1024, sm.A100_SELENE, 138.0).gemm_efficiency)
    for seq, cp, published in ((16384, 2, 1.25), (32768, 4, 1.20)):
        tp_only = dc.replace(sm.GPT3_175B_LONG_512, seq_length=seq)
        assert not sm.memory_per_gpu(dc.replace(tp_only, recompute=None), hw)["fits"]
        tp_only = sm.least_recompute(tp_only, hw)
        assert tp_only.recompute == "full"
        assert sm.context_parallel(tp_only, cp // 2, hw).recompute == "full"  # half: no room
        for comm in ("p2p", "a2a"):
            with_cp = sm.context_parallel(tp_only, cp, hw, comm)
            assert with_cp.recompute is None and with_cp.gpus == tp_only.gpus
            speedup = sm.tokens_per_s(with_cp, hw) / sm.tokens_per_s(tp_only, hw)
            assert abs(speedup / published - 1) < 0.15, (seq, comm, speedup)
    # Where TP alone fits without recomputation, CP only adds communication.
    short = sm.least_recompute(dc.replace(sm.GPT3_175B_LONG_512, seq_length=2048), hw)
    assert short.recompute is None
    assert sm.tokens_per_s(sm.context_parallel(short, 2, hw), hw) <= sm.tokens_per_s(short, hw)
    with pytest.raises(ValueError, match="does not divide"):
        sm.context_parallel(short, 3, hw)


def test_reproduces_llama3_405b_within_fifteen_percent():
    """Llama 3 405B (BF16 H100, Llama 3 paper Table 4): 430 TFLOP/s per GPU
    at 8,192 GPUs, 400 at 16,384 (model FLOPs, no recomputation counted),
    predicted with the efficiency calibrated on GPT-3 175B (A100), never on it."""
    hw = sm.calibrate(sm.GPT3_175B_1024, sm.A100_SELENE, 138.0)
    h100 = dc.replace(sm.H100_EOS, gemm_efficiency=hw.gemm_efficiency)
    job = sm.LLAMA3_405B_8192
    assert job.parameters() == pytest.approx(405e9, rel=0.01)
    for gpus, published in ((8192, 430.0), (16384, 400.0)):
        got = sm.predict(sm.gpus_for(job, gpus), h100)["model_flops_utilization"] * 989
        assert abs(got / published - 1) < 0.15, (gpus, got)


def _script_flags(path: str) -> list:
    """The MODEL and TRAIN arrays of an example launch script."""
    import re
    import shlex

    text = open(path).read()
    out = []
    for name in ("MODEL", "TRAIN"):
        body = re.search(name + r"=\((.*?)\)\n", text, re.S).group(1)
        out += shlex.split(body)
    return out


def test_deepseek_v3_from_its_real_flags_reproduces_its_training_cost():
    """examples/deepseek_v3/train_deepseek_v3.sh's flags, parsed by the
    trainer's parser, give the report's model (671B, MLA) and its 180K H800
    GPU-hours per trillion tokens within 15% (what the flags do not say: the
    vocabulary, FP8, the dispatch, DualPipe's overlap, balanced stages)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = _script_flags(os.path.join(root, "examples", "deepseek_v3", "train_deepseek_v3.sh"))
    ds = sm.DEEPSEEK_V3_2048
    job = sm.job_from_flags(flags, 2048, vocab_size=ds.vocab_size, fp8=True,
                            a2a_bytes=ds.a2a_bytes, a2a_node_copies=ds.a2a_node_copies,
                            a2a_overlap=ds.a2a_overlap, balance_stages=True, overlap_dp=True)
    assert (job.attention_params, job.qk_head_dim, job.v_head_dim) == (
        ds.attention_params, ds.qk_head_dim, ds.v_head_dim)
    assert (job.num_experts, job.moe_topk, job.moe_dense_layers, job.moe_shared_experts,
            job.ep, job.pp, job.dp, job.tp) == (256, 8, 3, 1, 64, 16, 128, 1)
    assert abs((job.parameters() - job.mtp_parameters()) / 671e9 - 1) < 0.01
    assert job.mtp_layers == 1
    hw = sm.calibrate(sm.GPT3_175B_1024, sm.A100_SELENE, 138.0)
    h800 = dc.replace(sm.H800_DEEPSEEK, gemm_efficiency=hw.gemm_efficiency)
    got = sm.gpu_hours_per_trillion_tokens(job, h800)  # ZB-H1 standing in for DualPipe
    assert abs(got / 180e3 - 1) < 0.15, got
    assert job == ds  # the flags give exactly the hand-built job
