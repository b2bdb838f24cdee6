"""Multi-latent attention (DeepSeek-V2/V3) and YaRN: the module equals
Hugging Face's DeepseekV3Attention (float64, with and without the query
compression, interleaved and half-split RoPE, YaRN with its softmax
temperature), and a DeepSeek-shaped model trains step for step like one
rank (fp32, 1e-5) under TP2, TP2 + SP, CP2 (ring and all-to-all), PP2
ZB-V, ZeRO-1, selective and full recomputation; a TP2 checkpoint resumes
on one rank with the architecture taken from it."""

from __future__ import annotations

import pytest
from test_llama import BASE, STEPS  # the same small training run as the Llama block's

import torch
from dist_harness import error_messages, run_ranks

DEEPSEEK = BASE + ["--num-attention-heads", "4", "--ffn-hidden-size", "96", "--swiglu",
                   "--normalization", "RMSNorm", "--disable-bias-linear",
                   "--untie-embeddings-and-output-weights", "--multi-latent-attention",
                   "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "16",
                   "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
                   "--position-embedding-type", "yarn", "--rotary-interleaved",
                   "--yarn-rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings",
                   "8", "--yarn-mscale", "1", "--yarn-mscale-all-dim", "1"]


def _hf_attention(q_lora_rank, interleave, yarn):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6, max_position_embeddings=64, rope_interleave=interleave,
        rope_parameters=rope, attention_bias=False, rms_norm_eps=1e-6)
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    attn = hf.DeepseekV3Attention(cfg, 0).double()
    for p in attn.parameters():  # random norms too
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.2)
    return cfg, attn, hf.DeepseekV3RotaryEmbedding(cfg)


def _against_hf(rank, world, q_lora_rank, interleave, yarn):
    import megatronapp as mapp
    from megatronapp.models import GPTConfig
    from megatronapp.models.mla import MultiLatentAttention

    state = mapp.initialize_model_parallel(1, 1)
    try:
        cfg, ref, rotary = _hf_attention(q_lora_rank, interleave, yarn)
        ours = MultiLatentAttention(GPTConfig(
            vocab_size=64, hidden_size=32, num_attention_heads=4, seq_length=16,
            normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False,
            multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=12,
            qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rotary_interleaved=interleave,
            position_embedding_type="yarn" if yarn else "rope", yarn_rotary_scaling_factor=4.0,
            yarn_original_max_position_embeddings=8, yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
            attention_backend="unfused"), state, 0.02).double()
        names = {"q_proj": "q_proj", "q_down": "q_a_proj", "q_norm": "q_a_layernorm",
                 "q_up": "q_b_proj", "kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm",
                 "kv_up": "kv_b_proj", "proj": "o_proj"}
        with torch.no_grad():
            for mine, theirs in names.items():
                if getattr(ours, mine) is not None:
                    getattr(ours, mine).weight.copy_(getattr(ref, theirs).weight)
        b, s = 2, 16
        x = torch.randn(b, s, 32, dtype=torch.float64)
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        cos, sin = rotary(x, pos)
        mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1).expand(b, 1, s, s)
        want = ref(x, (cos.double(), sin.double()), mask)[0]
        errs = []
        for fused in (False, True):  # our unfused path and torch's fused attention
            ours.fused = fused
            got = ours(x.transpose(0, 1).contiguous()).transpose(0, 1)
            errs.append((got - want).abs().max().item())
        return errs
    finally:
        mapp.destroy_model_parallel()


@pytest.mark.parametrize("q_lora_rank,interleave,yarn", [(10, True, True), (None, False, False),
                                                         (10, False, True)])
def test_mla_equals_hugging_face_deepseek_v3_attention(q_lora_rank, interleave, yarn):
    errs = run_ranks(_against_hf, 1, q_lora_rank, interleave, yarn)[0]
    assert max(errs) < 1e-6, errs


def test_yarn_frequencies_and_temperature_match_hugging_face():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatronapp.models.rotary import RotaryEmbedding

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 0.707}
    cfg = DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=rope, max_position_embeddings=163840)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = RotaryEmbedding(64, yarn={"factor": 40.0, "original_max_position": 4096,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                     "mscale_all_dim": 0.707})
    assert torch.allclose(ours.inv_freq, want.float(), rtol=1e-6, atol=0)
    assert abs(ours.attention_factor - factor) < 1e-12


def _train(rank, world, flags, out_dir):
    from megatronapp.pretrain import build_parser, train

    return train(build_parser().parse_args(flags + ["--output-dir", out_dir]))["losses"]


@pytest.fixture(scope="module")
def deepseek_ref(tmp_path_factory):
    return run_ranks(_train, 1, DEEPSEEK, str(tmp_path_factory.mktemp("mla_ref")))[0]


LAYOUTS = [
    (2, ["--tensor-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel", "--pipeline-schedule", "zb-v"]),
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    (2, ["--use-distributed-optimizer", "--recompute-granularity", "selective",
         "--attention-backend", "unfused"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity",
         "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"]),
]


@pytest.mark.parametrize("world,extra", LAYOUTS, ids=lambda v: "-".join(v) if isinstance(
    v, list) else str(v))
def test_deepseek_block_trains_like_one_rank(deepseek_ref, tmp_path, world, extra):
    assert len(deepseek_ref) == STEPS and deepseek_ref[-1] < deepseek_ref[0]  # it learns
    for losses in run_ranks(_train, world, DEEPSEEK + extra, str(tmp_path)):
        for i, (g, w) in enumerate(zip(losses, deepseek_ref, strict=True)):
            assert abs(g - w) < 1e-5, f"{extra} step {i + 1}: {g} vs one rank's {w}"


def test_resume_on_one_rank_takes_the_architecture_from_the_checkpoint(deepseek_ref, tmp_path):
    ck = str(tmp_path / "ck")
    first = DEEPSEEK[:]
    first[first.index("--train-iters") + 1] = "2"
    run_ranks(_train, 2, first + ["--tensor-model-parallel-size", "2", "--save", ck],
              str(tmp_path / "a"))
    resumed = run_ranks(_train, 1, BASE + ["--load", ck], str(tmp_path / "b"))[0]
    assert len(resumed) == 1 and abs(resumed[0] - deepseek_ref[2]) < 1e-5, (resumed, deepseek_ref)


def test_bad_mla_flags_name_the_fix():
    from megatronapp.models import GPTConfig

    kw = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, multi_latent_attention=True,
              position_embedding_type="rope")
    msgs = error_messages(
        lambda: GPTConfig(**{**kw, "position_embedding_type": "learned_absolute"}),
        lambda: GPTConfig(**kw, qk_pos_emb_head_dim=3),
        lambda: GPTConfig(**kw, num_query_groups=2),
        lambda: GPTConfig(**kw, kv_lora_rank=0),
        lambda: GPTConfig(**{**kw, "position_embedding_type": "yarn"},
                          yarn_rotary_scaling_factor=0.5))
    assert "use --position-embedding-type rope or yarn" in msgs[0]
    assert "--qk-pos-emb-head-dim must be even" in msgs[1]
    assert "drop --qk-layernorm and --group-query-attention" in msgs[2]
    assert "--kv-lora-rank must be >= 1" in msgs[3]
    assert "--yarn-rotary-scaling-factor must be >= 1" in msgs[4]


def test_group_limited_routing_reaches_at_most_g_groups_and_picks_their_best():
    """Against a brute-force reference: each token keeps the g groups with
    the largest sum of their k/g best scores, then its k best experts there."""
    from megatronapp.moe.router import Router

    torch.manual_seed(0)
    E, G, g, k, T = 16, 4, 2, 4, 64
    for score in ("sigmoid", "softmax"):
        r = Router(32, E, k, score_function=score, num_groups=G, group_topk=g,
                   enable_expert_bias=score == "sigmoid")
        if score == "sigmoid":
            r.expert_bias.copy_(torch.randn(E) * 0.1)
        x = torch.randn(T, 32)
        _, idx, _ = r(x)
        logits = x @ r.weight.T
        sel = torch.sigmoid(logits) + r.expert_bias if score == "sigmoid" else logits
        for t in range(T):
            groups = sel[t].view(G, -1)
            gscore = groups.topk(k // g).values.sum(-1)
            keep = set(gscore.topk(g).indices.tolist())
            allowed = [e for e in range(E) if e // (E // G) in keep]
            want = sorted(sorted(allowed, key=lambda e: -sel[t, e].item())[:k])
            assert sorted(idx[t].tolist()) == want, (score, t)
            assert len({e // (E // G) for e in idx[t].tolist()}) <= g
    msgs = error_messages(lambda: Router(32, 16, 4, num_groups=3, group_topk=1),
                          lambda: Router(32, 16, 4, num_groups=4, group_topk=3),
                          lambda: Router(32, 16, 4, num_groups=4))
    assert "must divide --num-experts 16" in msgs[0]
    assert "divide --moe-router-topk 4" in msgs[1]
    assert "go together" in msgs[2]


DEEPSEEK_MOE = DEEPSEEK + ["--num-experts", "8", "--moe-router-topk", "2",
                           "--moe-router-score-function", "sigmoid",
                           "--moe-router-enable-expert-bias", "--moe-router-num-groups", "4",
                           "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor",
                           "2.5", "--moe-shared-expert-intermediate-size", "32",
                           "--moe-ffn-hidden-size", "24", "--moe-layer-freq", "([0]*1+[1]*3)",
                           "--moe-router-load-balancing-type", "seq_aux_loss",
                           "--moe-aux-loss-coeff", "1e-2"]


CP2 = ["--context-parallel-size", "2"]


@pytest.fixture(scope="module")
def deepseek_moe_ref(tmp_path_factory):
    return run_ranks(_train, 1, DEEPSEEK_MOE, str(tmp_path_factory.mktemp("moe_ref")))[0]


def test_deepseek_moe_block_under_ep2_tp2_and_cp2_matches_one_rank(deepseek_moe_ref, tmp_path):
    """Dense first layer, sigmoid scores with the bias, node-limited routing,
    shared experts, top-k scaling and the sequence-wise balance loss: EP2,
    TP2 x SP, TP2 x SP with whole experts spread over the tensor pair
    (--expert-tensor-parallel-size 1, DeepSeek-V3's Megatron layout), CP2
    (the balance loss over the whole sequences), EP2 over the context pair,
    and TP2 x SP x CP2 (all-to-all) x EP2 compute what one rank does."""
    one = deepseek_moe_ref
    for world, extra in ((2, ["--expert-model-parallel-size", "2"]),
                         (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                         (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--expert-tensor-parallel-size", "1",
                              "--expert-model-parallel-size", "2"]),
                         (2, CP2),
                         (2, CP2 + ["--expert-model-parallel-size", "2"]),
                         (4, CP2 + ["--cp-comm-type", "a2a", "--tensor-model-parallel-size", "2",
                                    "--sequence-parallel", "--expert-model-parallel-size", "2"])):
        for losses in run_ranks(_train, world, DEEPSEEK_MOE + extra,
                                str(tmp_path / "_".join(extra[::2]))):
            assert all(abs(a - b) < 1e-5 for a, b in zip(losses, one, strict=True)), (
                extra, losses, one)


MTP = DEEPSEEK + ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]


def _mtp_reference(rank, world):
    """Our MTP loss against a hand-written float64 one from the same weights."""
    import torch.nn.functional as F

    import megatronapp as mapp
    from megatronapp.models import GPTConfig, GPTModel
    from megatronapp.models.mtp import AddToGradient, mtp_loss

    mapp.initialize_model_parallel(1, 1)
    try:
        cfg = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                        seq_length=16, normalization="RMSNorm", swiglu=True,
                        position_embedding_type="rope", add_bias_linear=False,
                        share_embeddings_and_output_weights=False, mtp_num_layers=2,
                        mtp_loss_scaling_factor=0.3, attention_backend="unfused")
        model = GPTModel(cfg).double()
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        labels = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
        model(ids)
        hidden = model.take_mtp_hidden()
        got, parts = mtp_loss(model, hidden, labels)

        def rms(x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

        want, h = [], hidden.detach()
        for k, layer in enumerate(model.mtp, 1):
            tok = torch.roll(labels, -(k - 1), 1)
            e = model.word_embeddings.weight[tok].transpose(0, 1)  # [s, b, h]
            x = torch.cat([rms(e, layer.enorm.weight), rms(h, layer.hnorm.weight)], -1)
            h = layer.layer(x @ layer.eh_proj.weight.T)
            logits = rms(h, layer.final_layernorm.weight) @ model.output_layer.weight.T
            tgt = torch.roll(labels, -k, 1).transpose(0, 1)
            ce = F.cross_entropy(logits.reshape(-1, 64), tgt.reshape(-1), reduction="none")
            keep = (torch.arange(16) < 16 - k).double().unsqueeze(1).expand(16, 2).reshape(-1)
            want.append(float(((ce * keep).sum() / keep.sum()).detach()))
        a = torch.tensor(2.0, requires_grad=True)
        b = torch.tensor(5.0, requires_grad=True)
        out = AddToGradient.apply(a * 3, b * b)
        out.backward()
        return ([float(x) for x in parts], want, float(got), float(out), float(a.grad),
                float(b.grad))
    finally:
        mapp.destroy_model_parallel()


def test_mtp_losses_equal_a_hand_written_reference():
    parts, want, got, out, ga, gb = run_ranks(_mtp_reference, 1)[0]
    # (our RMSNorm computes in float32, as Megatron's and Hugging Face's)
    assert all(abs(p - w) < 1e-6 for p, w in zip(parts, want, strict=True)), (parts, want)
    assert abs(got - 0.3 / 2 * sum(parts)) < 1e-6  # (its cross-entropy is in float32)
    # the trained loss is reported without the MTP term, which still gets the gradient
    assert (out, ga, gb) == (6.0, 3.0, 10.0)


def _train_summary(rank, world, flags, out_dir):
    from megatronapp.pretrain import build_parser, train

    s = train(build_parser().parse_args(flags + ["--output-dir", out_dir]))
    return s["losses"], s["mtp_losses"]


@pytest.fixture(scope="module")
def mtp_ref(tmp_path_factory):
    return run_ranks(_train_summary, 1, MTP, str(tmp_path_factory.mktemp("mtp_ref")))[0]


@pytest.mark.parametrize("world,extra", [
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel"]),  # MTP on the last stage, its embedding replica summed
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v",
         "--use-distributed-optimizer"]),  # the last stage is stage 0: summed in place
    (2, ["--use-distributed-optimizer", "--recompute-granularity", "full",
         "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    (2, CP2),  # the shifted tokens cross the zigzag chunks
    (4, CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--cp-comm-type", "a2a"]),
    (4, CP2 + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble"]),
], ids=["tp2-pp2-sp", "pp2-zbv-zero1", "dp2-zero1-recompute", "cp2", "tp2-sp-cp2-a2a",
        "pp2-zb-cp2"])
def test_mtp_trains_like_one_rank_and_reports_its_losses(mtp_ref, tmp_path, world, extra):
    losses, mtp = mtp_ref
    assert len(mtp) == STEPS and all(len(m) == 2 for m in mtp)
    assert mtp[-1][0] < mtp[0][0]  # the depth-1 prediction learns
    for got, got_mtp in run_ranks(_train_summary, world, MTP + extra, str(tmp_path)):
        for i in range(STEPS):
            assert abs(got[i] - losses[i]) < 1e-5, (extra, i, got, losses)
            assert all(abs(a - b) < 1e-5 for a, b in zip(got_mtp[i], mtp[i], strict=True)), (
                extra, i, got_mtp, mtp)


def test_mtp_changes_training(mtp_ref, tmp_path):
    plain = run_ranks(_train_summary, 1, MTP[:MTP.index("--mtp-num-layers")]
                      + ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0"],
                      str(tmp_path))[0]
    assert plain[0][0] == mtp_ref[0][0]  # the first loss: same model, MTP not reported in it
    assert plain[0][1] != mtp_ref[0][1]  # then MTP's gradient has trained the trunk


def test_moe_checkpoint_of_cp2_x_ep2_resumes_on_one_rank(tmp_path):
    """Under CP2 x EP2 the experts live on the two context ranks: both store
    theirs, and one rank resumes the run."""
    import os

    flags = DEEPSEEK_MOE + ["--mtp-num-layers", "1"]
    flags[flags.index("--train-iters") + 1] = "4"
    ck = str(tmp_path / "ck")
    two = run_ranks(_train, 2, flags + CP2 + ["--expert-model-parallel-size", "2", "--save", ck,
                                              "--save-interval", "2"], str(tmp_path / "a"))[0]
    one = run_ranks(_train, 1, flags + ["--load", os.path.join(ck, "iter_0000002")],
                    str(tmp_path / "b"))[0]
    assert len(one) == 2 and all(abs(a - b) < 1e-5 for a, b in zip(one, two[2:], strict=True)), (
        one, two)


def test_deepseek_moe_with_its_expert_bias_resumes_bit_identically(tmp_path):
    """The expert bias is state, not a parameter: checkpoints keep it, so an
    EP2 x DP2 ZeRO-1 run with MTP resumes bit for bit."""
    import os

    flags = DEEPSEEK_MOE + ["--mtp-num-layers", "1", "--expert-model-parallel-size", "2",
                            "--use-distributed-optimizer"]
    flags[flags.index("--train-iters") + 1] = "4"
    ck = str(tmp_path / "ck")
    full = run_ranks(_train, 2, flags + ["--save", ck, "--save-interval", "2"], str(tmp_path / "a"))
    resumed = run_ranks(_train, 2, flags + ["--load", os.path.join(ck, "iter_0000002")],
                        str(tmp_path / "b"))
    for a, b in zip(full, resumed, strict=True):
        assert b == a[2:], (a, b)  # exact float equality


def test_seq_aux_loss_equals_its_definition_per_sequence():
    """DeepSeek-V3's sequence-wise balance loss against a loop over sequences."""
    from megatronapp.moe.router import Router

    torch.manual_seed(0)
    E, k, s, b = 8, 2, 6, 3
    r = Router(16, E, k, score_function="sigmoid", enable_expert_bias=True,
               load_balancing_type="seq_aux_loss", aux_loss_coeff=0.1)
    x = torch.randn(s * b, 16)  # [s, b] flattened, as the MoE layer gives it
    _, idx, aux = r(x, seq_shape=(s, b))
    scores = torch.sigmoid(x @ r.weight.T)
    norm = scores / scores.sum(-1, keepdim=True)
    want = 0.0
    for j in range(b):
        rows = [t * b + j for t in range(s)]
        f = torch.zeros(E)
        for t in rows:
            for e in idx[t].tolist():
                f[e] += E / (k * s)
        want += float((f * norm[rows].mean(0)).sum().detach()) / b
    assert abs(float(aux) - 0.1 * want) < 1e-6, (float(aux), 0.1 * want)
    with pytest.raises(ValueError, match="seq_aux_loss needs the"):
        r(x)


def _seq_aux_over_context(rank, world):
    """Each rank routes its half of every sequence (the two zigzag chunks)."""
    import torch.distributed as dist

    from megatronapp.models.context_parallel import zigzag_split
    from megatronapp.moe.router import Router

    torch.manual_seed(0)
    E, k, s, b = 8, 2, 8, 3
    r = Router(16, E, k, score_function="sigmoid", enable_expert_bias=True,
               load_balancing_type="seq_aux_loss", aux_loss_coeff=0.1)
    x = torch.randn(s, b, 16)
    _, _, whole = r(x.reshape(s * b, 16), seq_shape=(s, b))
    (g_whole,) = torch.autograd.grad(whole, r.weight)
    mine = zigzag_split(x, world, rank, 0)
    _, _, part = r(mine.reshape(-1, 16), seq_shape=(s // world, b), seq_group=dist.group.WORLD)
    (g_part,) = torch.autograd.grad(part, r.weight)
    return float(whole), float(part), g_whole, g_part


def test_seq_aux_loss_over_the_context_group_is_the_whole_sequences():
    """Under context parallelism the ranks' losses average to the whole
    sequences' loss, and their gradients (averaged, as the context ranks'
    are) to its gradient."""
    out = run_ranks(_seq_aux_over_context, 2)
    whole, g_whole = out[0][0], out[0][2]
    assert abs(sum(o[1] for o in out) / 2 - whole) < 1e-7, out  # (the router is float32)
    g = sum(o[3] for o in out) / 2
    assert torch.allclose(g, g_whole, rtol=1e-5, atol=1e-8), (g - g_whole).abs().max()
    assert out[0][1] != out[1][1]  # each rank's share differs: not a copy of the whole


def test_deepseek_block_with_int8_gradients_and_in_bf16(deepseek_ref, tmp_path):
    """ZeRO-1 + int8 gradients (lossy: the first step exact, then close) and
    bf16 (within 2% of fp32 under TP2 + SP)."""
    got = run_ranks(_train, 2, DEEPSEEK + ["--use-distributed-optimizer", "--grad-compression",
                                           "int8"], str(tmp_path / "int8"))
    for losses in got:
        assert abs(losses[0] - deepseek_ref[0]) < 1e-5
        assert all(abs(g - w) < 5e-3 for g, w in zip(losses, deepseek_ref, strict=True)), losses
    bf16 = run_ranks(_train, 2, DEEPSEEK + ["--tensor-model-parallel-size", "2",
                                            "--sequence-parallel", "--bf16"],
                     str(tmp_path / "bf16"))[0]
    for g, w in zip(bf16, deepseek_ref, strict=True):
        assert abs(g - w) / w < 0.02, (bf16, deepseek_ref)


def test_deepseek_moe_block_with_zero1_int8_and_in_bf16(deepseek_moe_ref, tmp_path):
    """The MoE block (experts, shared expert, expert bias, seq_aux) under
    DP2 x EP2 with ZeRO-1 over both the dense and the expert data groups and
    int8 gradients in both (lossy: the first step exact, then close), and in
    bf16 under TP2 x SP with whole experts over the tensor pair (within 2% of
    fp32)."""
    ref = deepseek_moe_ref
    got = run_ranks(_train, 4, DEEPSEEK_MOE + ["--expert-model-parallel-size", "2",
                                               "--use-distributed-optimizer",
                                               "--grad-compression", "int8"],
                    str(tmp_path / "int8"))
    for losses in got:
        assert losses == got[0]  # every rank reports the global batch's loss
    assert abs(got[0][0] - ref[0]) < 1e-5
    assert all(abs(g - w) < 1e-2 for g, w in zip(got[0], ref, strict=True)), (got[0], ref)
    bf16 = run_ranks(_train, 2, DEEPSEEK_MOE + ["--tensor-model-parallel-size", "2",
                                                "--sequence-parallel", "--bf16",
                                                "--expert-tensor-parallel-size", "1",
                                                "--expert-model-parallel-size", "2"],
                     str(tmp_path / "bf16"))[0]
    for g, w in zip(bf16, ref, strict=True):
        assert abs(g - w) / w < 0.02, (bf16, ref)
    assert bf16[-1] < bf16[0]


def _count(rank, world):
    import megatronapp as mapp
    from megatronapp.models import GPTConfig, GPTModel

    mapp.initialize_model_parallel(1, 1)
    try:
        out = []
        for extra in ({}, {"q_lora_rank": None}, {"share_embeddings_and_output_weights": True}):
            cfg = GPTConfig(**{**dict(
                vocab_size=64, hidden_size=32, num_layers=3, num_attention_heads=4,
                seq_length=16, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                position_embedding_type="yarn", multi_latent_attention=True, q_lora_rank=12,
                kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1, 1],
                moe_shared_expert_intermediate_size=16, mtp_num_layers=2,
                share_embeddings_and_output_weights=False), **extra})
            model = GPTModel(cfg)
            out.append((sum(p.numel() for p in model.parameters()), cfg.num_parameters()))
        return out
    finally:
        mapp.destroy_model_parallel()


def test_parameter_count_of_mla_moe_and_mtp_is_the_models():
    for built, counted in run_ranks(_count, 1)[0]:
        assert built == counted, (built, counted)
