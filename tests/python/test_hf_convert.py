"""Hugging Face interop: tiny random Llama / Qwen2 / Qwen3 / Mixtral /
DeepSeek-V3 models built locally with ``transformers`` (nothing downloaded)
are the exact references. Imported at TP1, TP2, PP2, TP2 x PP2 (and EP2,
TP2 x EP2 for the MoE families), our
model's logits equal the transformers model's within 1e-5 (fp32); export ->
``from_pretrained`` gives the same logits; import -> export returns every
tensor bit for bit; bad inputs get clear errors."""

from __future__ import annotations

import json
import os

import pytest

import torch
from dist_harness import error_messages, run_ranks

pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "deepseek_v3")


def _hf_model(family: str, seed: int = 0):
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6)
    if family == "llama":  # Llama-3.1: scaled RoPE, untied output layer
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":  # QKV biases, tied embeddings
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":  # query/key RMSNorm, head_dim != hidden / heads
        cfg = tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
        cls = tf.Qwen3ForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                               tie_word_embeddings=False)
        cls = tf.MixtralForCausalLM
    else:  # MLA with query compression and YaRN, a dense first layer, routed + shared
        # experts with sigmoid scores, the score-correction bias, node-limited routing
        common.update(num_key_value_heads=4)
        cfg = tf.DeepseekV3Config(
            **common, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
        cls = tf.DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a wrong mapping
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def _ids():
    return torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{family: (directory, reference logits [2, 24, 96])}."""
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(family)
        model = _hf_model(family)
        model.save_pretrained(str(d))
        with torch.no_grad():
            out[family] = (str(d), model(_ids()).logits.float())
    return out


def _our_model(ckpt, state):
    """This rank's stage of our model, built from `ckpt`'s config and loaded from it."""
    from megatronapp import checkpoint
    from megatronapp.models import GPTConfig, GPTModel
    from megatronapp.pipeline.layout import layer_layout

    _, meta = checkpoint.read_metadata(ckpt)
    cfg = GPTConfig(**{k: v for k, v in meta["config"].items()
                       if k in GPTConfig.__dataclass_fields__})
    pp = state.pp_size
    counts = layer_layout(cfg.num_layers, pp, 1)
    first = sum(counts[:state.pp_rank])
    model = GPTModel(cfg, parallel_state=state, pre_process=state.pp_rank == 0,
                     post_process=state.pp_rank == pp - 1,
                     layer_numbers=list(range(first, first + counts[state.pp_rank])), seed=9)
    checkpoint.load(ckpt, [model], parallel_state=state)
    return model.eval()


def _our_logits(rank, world, ckpt, tp, pp, ep, etp=None):
    """Our model at (tp, pp, ep, etp) loaded from `ckpt`; the full logits on
    the last rank."""
    import torch.distributed as dist

    import megatronapp

    state = megatronapp.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                                  expert_tensor_parallel_size=etp)
    model = _our_model(ckpt, state)
    cfg = model.config
    ids = _ids()
    with torch.no_grad():
        if state.pp_rank == 0:
            x = model(ids)
        else:
            x = torch.empty(ids.shape[1], ids.shape[0], cfg.hidden_size)
            dist.recv(x, megatronapp.parallel_state.get_pipeline_model_parallel_prev_rank())
            x = model(x)
        if state.pp_rank < pp - 1:
            dist.send(x.contiguous(),
                      megatronapp.parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x.contiguous(), group=state.tensor_group)
    return torch.cat(parts, dim=-1) if rank == dist.get_world_size() - 1 else None


def _import(hf_dir, out, tp=1, pp=1, ep=1, max_file_bytes=2 << 30, etp=None):
    from megatronapp.convert import import_hf

    return import_hf(hf_dir, out, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                     expert_model_parallel_size=ep, max_file_bytes=max_file_bytes,
                     expert_tensor_parallel_size=etp)


# (tp, pp, ep, etp); etp None: the tensor-parallel size
LAYOUTS = [(1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None), (2, 2, 1, None)]
MOE_LAYOUTS = [(1, 1, 2, None), (2, 1, 2, None),
               (2, 1, 2, 1)]  # Megatron's DeepSeek recipe: TP2, experts whole (etp 1) over EP2


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_logits_equal_transformers_at_every_layout(hf_dirs, tmp_path, family):
    hf_dir, want = hf_dirs[family]
    layouts = LAYOUTS + (MOE_LAYOUTS if family in ("mixtral", "deepseek_v3") else [])
    for tp, pp, ep, etp in layouts:
        out = str(tmp_path / f"ckpt_{tp}{pp}{ep}{etp}")
        _import(hf_dir, out, tp, pp, ep, etp=etp)
        # the experts' grid (etp x ep) fills the tensor ranks before it needs data ranks
        world = tp * pp * max(1, ep * (etp or tp) // tp)
        got = [r for r in run_ranks(_our_logits, world, out, tp, pp, ep, etp)
               if r is not None][0]
        err = (got - want).abs().max().item()
        assert err < 1e-5, (family, (tp, pp, ep, etp), err)


def _files(d):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trips_bit_for_bit_and_loads_in_transformers(hf_dirs, tmp_path, family):
    import transformers as tf

    from megatronapp.convert import export_hf

    hf_dir, want = hf_dirs[family]
    # at tp 2 x pp 2 (MoE: ep 2, whole experts) in files of ~20 KB: the export
    # reassembles every shard
    moe = family in ("mixtral", "deepseek_v3")
    ckpt = _import(hf_dir, str(tmp_path / "ckpt"), 2, 2, 2 if moe else 1, max_file_bytes=20_000,
                   etp=1 if moe else None)
    assert len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")]) > 8
    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_size=40_000)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))  # sharded
    a, b = _files(hf_dir), _files(out)
    a.pop("lm_head.weight", None) if family == "qwen2" else None  # tied: not stored
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    model = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = model(_ids()).logits.float()
    assert (got - want).abs().max().item() < 1e-5
    assert os.path.basename(ckpt) == "iter_0000000"


def test_bad_inputs_get_clear_errors(hf_dirs, tmp_path):
    from megatronapp.convert import ConversionError, export_hf, import_hf

    llama = hf_dirs["llama"][0]
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.load(open(os.path.join(llama, "config.json")))
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(json.load(open(os.path.join(llama,
                                                                                "config.json")))))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    msgs = error_messages(
        lambda: import_hf(str(bad), str(tmp_path / "o1")),
        lambda: import_hf(str(sharded), str(tmp_path / "o2")),
        lambda: import_hf(llama, str(tmp_path / "o3"), tensor_model_parallel_size=3),
        lambda: import_hf(llama, str(tmp_path / "o4"), expert_model_parallel_size=2),
        lambda: import_hf(str(tmp_path), str(tmp_path / "o5")),
        lambda: export_hf(str(tmp_path / "nothing"), str(tmp_path / "o6")),
        lambda: import_hf(hf_dirs["mixtral"][0], str(tmp_path / "o7"),
                          tensor_model_parallel_size=2, expert_tensor_parallel_size=4),
        lambda: import_hf(llama, str(tmp_path / "o8"), tensor_model_parallel_size=2,
                          expert_tensor_parallel_size=1),
        exc=ConversionError)
    assert "GPTNeoXForCausalLM" in msgs[0] and "LlamaForCausalLM" in msgs[0]
    assert "model-00001-of-00002.safetensors" in msgs[1] and "missing" in msgs[1]
    assert "does not divide the layout" in msgs[2] and "tensor-parallel size 3" in msgs[2]
    assert "needs an MoE model" in msgs[3]
    assert "no config.json" in msgs[4]
    assert "no checkpoint" in msgs[5]
    assert "--expert-tensor-parallel-size 4 does not divide the tensor-parallel size 2" in msgs[6]
    assert "--expert-tensor-parallel-size 1 needs an MoE model" in msgs[7]


def _tokenizer_json(path: str) -> str:
    """A word-level tokenizer.json over the tiny models' 96 ids ('t0' ... 't94', '</s>')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(95)}
    vocab["</s>"] = 95
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(path)
    return path


def test_scope_serves_an_imported_model_and_generates_what_transformers_does(hf_dirs, tmp_path):
    """`python -m megatronapp.scope serve --checkpoint DIR` (2 ranks, TP2) with
    the model's tokenizer.json: greedy tokens equal transformers' generate."""
    import subprocess
    import sys
    import time
    import urllib.request

    import transformers as tf

    from dist_harness import free_port

    hf_dir, _ = hf_dirs["llama"]
    ckpt = _import(hf_dir, str(tmp_path / "ckpt"), 2)
    tok = _tokenizer_json(str(tmp_path / "tokenizer.json"))
    prompt = [3, 17, 42, 8, 77]
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                              pad_token_id=95)[0, len(prompt):].tolist()
    port, port_file = free_port(), str(tmp_path / "port")
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(tmp_path / f"serve{r}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "megatronapp.scope", "serve", "--port", "0", "--port-file",
             port_file, "--checkpoint", os.path.dirname(ckpt), "--tensor-model-parallel-size", "2",
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok],
            env=env, stdout=log, stderr=log))
    try:
        t0 = time.monotonic()
        while not os.path.exists(port_file):
            if time.monotonic() - t0 > 120 or any(p.poll() is not None for p in procs):
                raise AssertionError((tmp_path / "serve0.log").read_text()[-3000:])
            time.sleep(0.2)
        req = urllib.request.Request(
            f"http://127.0.0.1:{open(port_file).read()}/api/generate",
            data=json.dumps({"prompt": " ".join(f"t{i}" for i in prompt),
                             "max_new_tokens": 5}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            got = json.loads(r.read())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
    assert got["tokens"][0] == prompt + want, (got["tokens"], want)  # prompt, then 5 new


def _train_interleaved_and_export(rank, world, out):
    """A model with --rotary-interleaved (and SwiGLU, GQA, RMSNorm, Qwen2's
    QKV bias) saved as a checkpoint and exported: the export permutes q/k
    into the rotate-half pairing, so transformers computes our logits."""
    import dataclasses

    import transformers as tf

    import megatronapp
    from megatronapp import checkpoint
    from megatronapp.convert import export_hf
    from megatronapp.models import GPTConfig, GPTModel

    state = megatronapp.initialize_model_parallel()
    cfg = GPTConfig(vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4,
                    num_query_groups=2, ffn_hidden_size=96, seq_length=64, swiglu=True,
                    normalization="RMSNorm", position_embedding_type="rope",
                    rotary_interleaved=True, rotary_base=10000.0, add_bias_linear=False,
                    add_qkv_bias=True, share_embeddings_and_output_weights=False,
                    layernorm_epsilon=1e-6)
    model = GPTModel(cfg, parallel_state=state, seed=4).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases and norms away from 0 and 1
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
        ours = model(_ids()).float()
    checkpoint.save(out + "/ck", 0, [model], config=dataclasses.asdict(cfg),
                    parallel_state=state)
    export_hf(out + "/ck", out + "/hf")
    hf = tf.AutoModelForCausalLM.from_pretrained(out + "/hf").eval()
    with torch.no_grad():
        theirs = hf(_ids()).logits.float()
    return type(hf).__name__, (ours - theirs).abs().max().item()


def test_export_of_interleaved_rope_permutes_into_transformers_pairing(tmp_path):
    arch, err = run_ranks(_train_interleaved_and_export, 1, str(tmp_path))[0]
    assert arch == "Qwen2ForCausalLM" and err < 1e-5, (arch, err)


def _with_mtp(hf_dir: str, out: str) -> str:
    """The tiny DeepSeek-V3 directory with one MTP depth added as DeepSeek
    releases it: Hugging Face layer num_hidden_layers holding enorm, hnorm,
    eh_proj, a decoder layer (the last one's kind, its own weights) and
    shared_head.norm, with copies of the embedding and output layer."""
    from safetensors.torch import save_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    L, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    t = _files(hf_dir)
    g = torch.Generator().manual_seed(11)
    p, last = f"model.layers.{L}.", f"model.layers.{L - 1}."
    for k, v in list(t.items()):
        if k.startswith(last):
            t[p + k[len(last):]] = v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)
    for n in ("enorm", "hnorm", "shared_head.norm"):
        t[p + n + ".weight"] = 1 + 0.2 * torch.randn(h, generator=g)
    t[p + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    t[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
    t[p + "shared_head.head.weight"] = t["lm_head.weight"].clone()
    os.makedirs(out)
    save_file(t, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def _mtp_reference(hf_dir: str, ids, labels) -> float:
    """DeepSeek-V3's depth-1 MTP loss (fp32: transformers' grouped expert
    GEMM takes no float64) from the Hugging Face tensors, with transformers'
    modules: the main model's last decoder output h0 (before
    its norm); x = eh_proj([enorm(Emb(labels)); hnorm(h0)]); the MTP layer run
    as a one-layer transformers model whose final norm and head are
    shared_head.norm and the (shared) output layer; cross-entropy against the
    labels shifted once more, the last position masked."""
    import transformers as tf
    from safetensors.torch import save_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    t = _files(hf_dir)
    L = cfg["num_hidden_layers"]
    main = tf.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    seen = []
    main.model.layers[-1].register_forward_hook(
        lambda m, i, o: seen.append(o[0] if isinstance(o, tuple) else o))
    # the MTP layer as a one-layer model (MoE: no dense first layer), in its own directory
    p = f"model.layers.{L}."
    sd = {"model.embed_tokens.weight": t["model.embed_tokens.weight"],
          "model.norm.weight": t[p + "shared_head.norm.weight"],
          "lm_head.weight": t[p + "shared_head.head.weight"]}
    sd.update({"model.layers.0." + k[len(p):]: v for k, v in t.items() if k.startswith(p)
               and k[len(p):].split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                 "post_attention_layernorm")})
    one_dir = hf_dir + "_one_layer"
    os.makedirs(one_dir)
    save_file(sd, os.path.join(one_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(one_dir, "config.json"), "w") as f:
        json.dump({**cfg, "num_hidden_layers": 1, "first_k_dense_replace": 0,
                   "num_nextn_predict_layers": 0}, f)
    one = tf.AutoModelForCausalLM.from_pretrained(one_dir).eval()
    assert not any(n.startswith("model.layers.1") for n, _ in one.named_parameters())

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * w

    with torch.no_grad():
        main(ids)
        e = torch.nn.functional.embedding(labels, t["model.embed_tokens.weight"])
        x = torch.cat([rms(e, t[p + "enorm.weight"]), rms(seen[0], t[p + "hnorm.weight"])], -1)
        x = x @ t[p + "eh_proj.weight"].T
        logits = one(inputs_embeds=x).logits
        target = torch.roll(labels, -1, dims=1)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    return ce[:, :-1].mean().item()


def _our_mtp_loss(rank, world, ckpt, tp, pp, ep, etp):
    """(MTP depths, per-depth losses) on the last stage, None elsewhere: the
    main model's stages pass their activations forward, the last one runs
    the MTP depths with its own copy of the embedding."""
    import torch.distributed as dist

    import megatronapp
    from megatronapp import parallel_state as ps
    from megatronapp.models.mtp import mtp_loss

    state = megatronapp.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                                  expert_tensor_parallel_size=etp)
    model = _our_model(ckpt, state)
    ids = _ids()
    # (with gradients on: the last stage keeps its hidden states for MTP only then)
    if state.pp_rank == 0:
        x = model(ids)
    else:
        x = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
        dist.recv(x, ps.get_pipeline_model_parallel_prev_rank())
        x = model(x)
    if state.pp_rank < pp - 1:
        dist.send(x.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
        return None
    _, losses = mtp_loss(model, model.take_mtp_hidden(), torch.roll(ids, -1, dims=1))
    return model.config.mtp_num_layers, [x.item() for x in losses]


def test_deepseek_mtp_depths_import_and_export(hf_dirs, tmp_path):
    """DeepSeek's released layout of its MTP depth: imported (TP2 x EP2 with
    whole experts) its loss equals the transformers-module reference within
    1e-5 (fp32, as the logits above), and so it does split over two
    pipeline stages (the depth on the last one, with its own embedding copy);
    exported, every tensor (the embedding / head copies too) comes back bit
    for bit."""
    from megatronapp.convert import export_hf

    src = _with_mtp(hf_dirs["deepseek_v3"][0], str(tmp_path / "hf_mtp"))
    ids = _ids()
    want = _mtp_reference(src, ids, torch.roll(ids, -1, dims=1))
    _import(src, str(tmp_path / "ckpt_pp2"), 1, 2, 1)
    got = run_ranks(_our_mtp_loss, 2, str(tmp_path / "ckpt_pp2"), 1, 2, 1, None)
    assert got[0] is None  # the first stage has no MTP depth
    depths, losses = got[1]
    assert depths == 1 and abs(losses[0] - want) < 1e-5, ("pp2", losses, want)
    ckpt = _import(src, str(tmp_path / "ckpt"), 2, 1, 2, etp=1)
    for depths, losses in run_ranks(_our_mtp_loss, 2, ckpt, 2, 1, 2, 1):
        assert depths == 1 and abs(losses[0] - want) < 1e-5, (losses, want)
    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf_out"))
    assert json.load(open(os.path.join(out, "config.json")))["num_nextn_predict_layers"] == 1
    a, b = _files(src), _files(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
