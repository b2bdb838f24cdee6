"""Hugging Face checkpoints in and out (Llama, Qwen2, Qwen3, Mixtral, DeepSeek-V3).

    python -m megatronapp.convert import-hf --hf-dir D --output DIR \\
        [--tensor-model-parallel-size N --pipeline-model-parallel-size P \\
         --expert-model-parallel-size E --expert-tensor-parallel-size T]
    python -m megatronapp.convert export-hf --load DIR --output D

``import-hf`` writes our checkpoint format (``megatronapp.checkpoint``:
safetensors files with CRC-32s, ``metadata.json``, ``latest``) with the
architecture as the checkpoint's model config, so ``pretrain_gpt.py --load
DIR`` continues training from it with no architecture flag given (a given
flag that disagrees is an error naming both values) and ``python -m
megatronapp.scope serve --checkpoint DIR`` generates from it. The files are
laid out for the (tp, pp, ep, etp) given (etp, the expert-tensor-parallel
size, defaults to tp; the experts' weights are split over it): one file per
model-parallel rank holding that rank's shards, which that layout reads in
place; any other layout reshards on load.

Streamed: ``import-hf`` builds one output file at a time (a rank's shards, in
files of at most about 2 GiB) from slices of the Hugging Face tensors
(positioned reads of the checkpoint file engine): peak memory is one such file plus one
tensor. ``export-hf`` assembles one layer at a time from the stored pieces
(the checkpoint loader's positioned reads) and writes Hugging Face shards of
at most ``--max-shard-size-gb``. Import then export gives
back every tensor bit for bit (the stored dtype is kept).

Layouts (Megatron's): the fused QKV rows are ``[group, (its query heads, key,
value), head_dim]``; the SwiGLU fc1 (and every expert's) is ``[gate; up]``,
viewed as ``[2, ffn, hidden]`` so that a tensor-parallel shard is a
contiguous slice. Hugging Face's q/k rows are in the rotate-half order our
RoPE uses, so they need no permutation; a model trained with
``--rotary-interleaved`` is permuted into it on export. DeepSeek-V3's
multi-latent attention keeps its checkpoints' interleaved rotary pairs
(``rope_interleave``, our ``--rotary-interleaved``): nothing is permuted.
Its router's ``e_score_correction_bias`` is our expert bias (a checkpointed
buffer). Its multi-token prediction depths (``num_nextn_predict_layers``,
stored as the layers after the last decoder layer, as DeepSeek releases them:
``enorm``, ``hnorm``, ``eh_proj``, a decoder layer and ``shared_head.norm``)
are imported when their weights are in the files (``--mtp-num-layers``); the
copies of the embedding and output layer each depth holds
(``embed_tokens``, ``shared_head.head``) are ours shared, and written back
as copies on export. transformers' DeepseekV3 itself ignores those layers.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from .. import _C
from ..checkpoint.format import CheckpointError, engine_errors, write
from ..checkpoint.stream import StreamLoader, TensorFile

__all__ = ["import_hf", "export_hf", "ConversionError", "FAMILIES", "config_from_hf",
           "hf_config_from"]

FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
            "DeepseekV3ForCausalLM")


class ConversionError(ValueError):
    """An input the converter cannot use (says what and how to fix it)."""


# ---- configs ----------------------------------------------------------------------------------
def _rope(hf: dict) -> dict:
    """Our RoPE fields from a config.json (transformers 4's rope_theta /
    rope_scaling or 5's rope_parameters)."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rotary_base": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConversionError("partial_rotary_factor != 1 is not supported for these families")
    if kind == "llama3":
        out.update(use_rope_scaling=True, rope_scaling_factor=float(params["factor"]),
                   rope_scaling_low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   rope_scaling_high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   rope_scaling_original_max_position=int(
                       params.get("original_max_position_embeddings", 8192)))
    elif kind == "yarn":
        if params.get("factor") is None or params.get("attention_factor") is not None:
            raise ConversionError("YaRN RoPE needs its 'factor' and no explicit "
                                  "'attention_factor' (it is derived from mscale)")
        out.update(position_embedding_type="yarn",
                   yarn_rotary_scaling_factor=float(params["factor"]),
                   yarn_original_max_position_embeddings=int(
                       params.get("original_max_position_embeddings", 4096)),
                   yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                   yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                   yarn_mscale=float(params.get("mscale") or 0.0),
                   yarn_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))
    elif kind != "default":
        raise ConversionError(f"RoPE type {kind!r} is not supported (default, llama3 and yarn "
                              "are)")
    return out


def config_from_hf(hf: dict) -> dict:
    """GPTConfig fields of a Hugging Face config.json (one of FAMILIES)."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in FAMILIES:
        raise ConversionError(f"architecture {arch!r} is not supported; supported: "
                              f"{', '.join(FAMILIES)}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{arch} with hidden_act {act!r}: only silu (SwiGLU) is supported")
    if hf.get("mlp_bias") or (arch == "LlamaForCausalLM" and hf.get("attention_bias")):
        raise ConversionError(f"{arch} with attention_bias / mlp_bias is not supported")
    if hf.get("use_sliding_window"):
        raise ConversionError(f"{arch} with use_sliding_window is not supported")
    heads = hf["num_attention_heads"]
    cfg = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        seq_length=hf.get("max_position_embeddings", 4096),
        normalization="RMSNorm", layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        swiglu=True, position_embedding_type="rope", add_bias_linear=False,
        add_qkv_bias=arch == "Qwen2ForCausalLM", qk_layernorm=arch == "Qwen3ForCausalLM",
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)))
    cfg.update(_rope(hf))
    if arch == "MixtralForCausalLM":
        cfg.update(num_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
                   moe_ffn_hidden_size=hf["intermediate_size"], moe_layer_freq=1,
                   moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
    if arch == "DeepseekV3ForCausalLM":
        cfg.update(_deepseek_v3(hf))
    return cfg


def _deepseek_v3(hf: dict) -> dict:
    """MLA, the first dense layers and the routed + shared experts of a
    DeepseekV3 config.json (its multi-token prediction depths: import_hf, when
    their weights are there)."""
    if hf.get("attention_bias"):
        raise ConversionError("DeepseekV3ForCausalLM with attention_bias is not supported")
    k, E = hf["num_experts_per_tok"], hf["n_routed_experts"]
    groups, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if not hf.get("norm_topk_prob", True) and k > 1:
        raise ConversionError("DeepseekV3 with norm_topk_prob=false is not supported (our "
                              "sigmoid router normalizes the top-k weights)")
    if groups > 1 and k != 2 * topk_group:
        raise ConversionError(
            f"DeepseekV3 group-limited routing: transformers scores a group by its best 2 "
            f"experts, Megatron (and we) by its best num_experts_per_tok / topk_group = "
            f"{k}/{topk_group}; they agree only when num_experts_per_tok = 2 x topk_group")
    first_dense = int(hf.get("first_k_dense_replace", 0))
    L = hf["num_hidden_layers"]
    return dict(
        multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        num_query_groups=hf["num_attention_heads"], kv_channels=None,
        rotary_interleaved=bool(hf.get("rope_interleave", True)),
        num_experts=E, moe_router_topk=k, moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq=[0] * first_dense + [1] * (L - first_dense),
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0)
        * hf["moe_intermediate_size"] or None,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=topk_group if groups > 1 else None,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def _family(cfg: dict) -> str:
    if cfg.get("multi_latent_attention"):
        return _deepseek_family(cfg)
    unsupported = []
    if cfg.get("normalization") != "RMSNorm":
        unsupported.append("--normalization LayerNorm")
    if not cfg.get("swiglu"):
        unsupported.append("a GELU MLP (no --swiglu)")
    if cfg.get("position_embedding_type") != "rope":
        unsupported.append(f"--position-embedding-type {cfg.get('position_embedding_type')}")
    elif cfg.get("rotary_percent", 1.0) != 1.0:
        unsupported.append(f"--rotary-percent {cfg['rotary_percent']} (these families rotate "
                           "every channel)")
    if cfg.get("add_bias_linear", True):
        unsupported.append("linear biases (no --disable-bias-linear)")
    if cfg.get("num_experts"):
        if cfg.get("moe_shared_expert_intermediate_size") or cfg.get(
                "moe_router_topk_scaling_factor") or cfg.get(
                "moe_router_score_function", "softmax") != "softmax" or cfg.get("qk_layernorm") \
                or cfg.get("add_qkv_bias") or cfg.get("moe_layer_freq", 1) not in (1, [1] * cfg[
                    "num_layers"]):
            unsupported.append("an MoE other than Mixtral's (shared experts, sigmoid or scaled "
                               "routing, dense layers, QK norm or QKV bias)")
        family = "MixtralForCausalLM"
    elif cfg.get("qk_layernorm"):
        family = "Qwen3ForCausalLM"
        if cfg.get("add_qkv_bias"):
            unsupported.append("--qk-layernorm with --add-qkv-bias")
    elif cfg.get("add_qkv_bias"):
        family = "Qwen2ForCausalLM"
    else:
        family = "LlamaForCausalLM"
    if unsupported:
        raise ConversionError("this checkpoint has no Hugging Face equivalent among "
                              f"{', '.join(FAMILIES)}: {'; '.join(unsupported)}")
    return family


def _deepseek_family(cfg: dict) -> str:
    unsupported = []
    if cfg.get("normalization") != "RMSNorm" or not cfg.get("swiglu"):
        unsupported.append("LayerNorm or a GELU MLP")
    if cfg.get("add_bias_linear", True):
        unsupported.append("linear biases (no --disable-bias-linear)")
    if cfg.get("num_experts"):
        if cfg.get("moe_router_score_function") != "sigmoid" or not cfg.get(
                "moe_router_enable_expert_bias"):
            unsupported.append("a router other than sigmoid scores with the expert bias")
        freq = _moe_pattern(cfg)
        k = freq.index(1) if 1 in freq else len(freq)
        if freq != [0] * k + [1] * (len(freq) - k):
            unsupported.append(f"--moe-layer-freq {freq} (DeepSeek-V3 has dense layers first, "
                               "then MoE layers)")
        g, gk = cfg.get("moe_router_num_groups"), cfg.get("moe_router_group_topk")
        if g and cfg["moe_router_topk"] != 2 * gk:
            unsupported.append("group-limited routing with --moe-router-topk != 2 x "
                               "--moe-router-group-topk (transformers scores a group by its "
                               "best 2 experts)")
        shared = cfg.get("moe_shared_expert_intermediate_size")
        if shared and shared % cfg["moe_ffn_hidden_size"]:
            unsupported.append("a shared-expert width that is not a multiple of the expert width")
    if unsupported:
        raise ConversionError("this checkpoint has no DeepseekV3ForCausalLM equivalent: "
                              + "; ".join(unsupported))
    return "DeepseekV3ForCausalLM"


def _deepseek_hf_config(cfg: dict, hf: dict) -> dict:
    L, E = cfg["num_layers"], cfg.get("num_experts")
    freq = _moe_pattern(cfg)
    first_dense = freq.index(1) if E and 1 in freq else L
    f_moe = cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"]
    shared = cfg.get("moe_shared_expert_intermediate_size") or 0
    hf.update(model_type="deepseek_v3", intermediate_size=cfg["ffn_hidden_size"],
              q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
              qk_nope_head_dim=cfg["qk_head_dim"], qk_rope_head_dim=cfg["qk_pos_emb_head_dim"],
              v_head_dim=cfg["v_head_dim"],
              qk_head_dim=cfg["qk_head_dim"] + cfg["qk_pos_emb_head_dim"],
              head_dim=cfg["qk_pos_emb_head_dim"],
              num_key_value_heads=cfg["num_attention_heads"],
              rope_interleave=bool(cfg.get("rotary_interleaved")), attention_bias=False,
              first_k_dense_replace=first_dense, n_routed_experts=E or 1,
              num_experts_per_tok=cfg.get("moe_router_topk", 1) if E else 1,
              moe_intermediate_size=f_moe, n_shared_experts=shared // f_moe if shared else 0,
              routed_scaling_factor=cfg.get("moe_router_topk_scaling_factor") or 1.0,
              n_group=cfg.get("moe_router_num_groups") or 1,
              topk_group=cfg.get("moe_router_group_topk") or 1, norm_topk_prob=True,
              num_nextn_predict_layers=cfg.get("mtp_num_layers") or 0)
    return hf


def hf_config_from(cfg: dict, dtype: str = "float32") -> dict:
    """A Hugging Face config.json for our model config `cfg`."""
    family = _family(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.get("rotary_base", 10000.0)}
    if cfg.get("position_embedding_type") == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": cfg.get("rotary_base", 10000.0),
                "factor": cfg["yarn_rotary_scaling_factor"],
                "original_max_position_embeddings": cfg["yarn_original_max_position_embeddings"],
                "beta_fast": cfg["yarn_beta_fast"], "beta_slow": cfg["yarn_beta_slow"],
                "mscale": cfg["yarn_mscale"], "mscale_all_dim": cfg["yarn_mscale_all_dim"]}
    elif cfg.get("use_rope_scaling"):
        rope = {"rope_type": "llama3", "rope_theta": cfg.get("rotary_base", 10000.0),
                "factor": cfg.get("rope_scaling_factor", 8.0),
                "low_freq_factor": cfg.get("rope_scaling_low_freq_factor", 1.0),
                "high_freq_factor": cfg.get("rope_scaling_high_freq_factor", 4.0),
                "original_max_position_embeddings": cfg.get(
                    "rope_scaling_original_max_position", 8192)}
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral",
                  "DeepseekV3ForCausalLM": "deepseek_v3"}[family]
    hf = {"architectures": [family], "model_type": model_type,
          "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
          "intermediate_size": cfg.get("moe_ffn_hidden_size") if cfg.get("num_experts")
          else cfg["ffn_hidden_size"],
          "num_hidden_layers": cfg["num_layers"], "num_attention_heads": cfg["num_attention_heads"],
          "num_key_value_heads": cfg.get("num_query_groups") or cfg["num_attention_heads"],
          "head_dim": cfg.get("kv_channels") or cfg["hidden_size"] // cfg["num_attention_heads"],
          "hidden_act": "silu", "max_position_embeddings": cfg.get("seq_length", 4096),
          "rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5),
          "tie_word_embeddings": bool(cfg.get("share_embeddings_and_output_weights", True)),
          "initializer_range": cfg.get("init_method_std", 0.02),
          "rope_parameters": rope, "rope_theta": rope["rope_theta"],
          "attention_dropout": 0.0, "dtype": dtype, "torch_dtype": dtype, "use_cache": True}
    if rope["rope_type"] != "default":
        hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if family == "LlamaForCausalLM":
        hf.update(attention_bias=False, mlp_bias=False)
    if family == "MixtralForCausalLM":
        hf.update(num_local_experts=cfg["num_experts"], num_experts_per_tok=cfg["moe_router_topk"],
                  router_aux_loss_coef=cfg.get("moe_aux_loss_coeff", 0.0))
    if family in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_layers"])
    if family == "DeepseekV3ForCausalLM":
        _deepseek_hf_config(cfg, hf)
    return hf


def _full_config(cfg: dict) -> dict:
    """`cfg` completed with every GPTConfig default (the checkpoint's model config)."""
    from ..models.gpt import GPTConfig

    try:
        return dataclasses.asdict(GPTConfig(**cfg))
    except (TypeError, ValueError) as e:
        raise ConversionError(f"the Hugging Face config maps to an invalid model: {e}") from None


# ---- the tensor map ---------------------------------------------------------------------------
def _hf_layer_names(cfg: dict, i: int, qkv_bias: bool) -> dict:
    """{our global name: [Hugging Face names it is fused from]} of layer i."""
    p = f"model.layers.{i}."
    out = {f"layers.{i}.ln1.weight": [p + "input_layernorm.weight"],
           f"layers.{i}.ln2.weight": [p + "post_attention_layernorm.weight"]}
    if cfg.get("multi_latent_attention"):
        return {**out, **_deepseek_layer_names(cfg, i, p)}
    out.update({f"layers.{i}.attn.qkv.weight": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
                f"layers.{i}.attn.proj.weight": [p + "self_attn.o_proj.weight"]})
    if qkv_bias:
        out[f"layers.{i}.attn.qkv.bias"] = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    if cfg.get("qk_layernorm"):
        out[f"layers.{i}.attn.q_layernorm.weight"] = [p + "self_attn.q_norm.weight"]
        out[f"layers.{i}.attn.k_layernorm.weight"] = [p + "self_attn.k_norm.weight"]
    if cfg.get("num_experts"):
        out[f"layers.{i}.mlp.router.weight"] = [p + "block_sparse_moe.gate.weight"]
        for e in range(cfg["num_experts"]):
            q = p + f"block_sparse_moe.experts.{e}."
            out[f"layers.{i}.mlp.experts.experts.{e}.fc1"] = [q + "w1.weight", q + "w3.weight"]
            out[f"layers.{i}.mlp.experts.experts.{e}.fc2"] = [q + "w2.weight"]
    else:
        out[f"layers.{i}.mlp.fc1.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        out[f"layers.{i}.mlp.fc2.weight"] = [p + "mlp.down_proj.weight"]
    return out


def _mtp_names(cfg: dict, j: int, qkv_bias: bool) -> dict:
    """{our global name: [Hugging Face names]} of MTP depth j (0-based),
    stored (DeepSeek's layout) as Hugging Face layer num_layers + j."""
    i = cfg["num_layers"] + j
    p, o = f"model.layers.{i}.", f"mtp.{j}."
    out = {o + "enorm.weight": [p + "enorm.weight"], o + "hnorm.weight": [p + "hnorm.weight"],
           o + "eh_proj.weight": [p + "eh_proj.weight"]}
    for n, srcs in _hf_layer_names(cfg, i, qkv_bias).items():
        out[o + "layer." + n.split(".", 2)[2]] = srcs
    out[o + "final_layernorm.weight"] = [p + "shared_head.norm.weight"]
    return out


def _mtp_copies(cfg: dict, j: int) -> dict:
    """{Hugging Face name: our global name} of the embedding and output layer
    copies DeepSeek's checkpoints hold in MTP depth j (ours are shared)."""
    p = f"model.layers.{cfg['num_layers'] + j}."
    head = ("word_embeddings.weight" if cfg["share_embeddings_and_output_weights"]
            else "output_layer.weight")
    return {p + "embed_tokens.weight": "word_embeddings.weight", p + "shared_head.head.weight": head}


def _moe_pattern(cfg: dict) -> list:
    """0/1 per layer: which layers have experts (all 0 for a dense model)."""
    from ..models.gpt import moe_layer_pattern

    if not cfg.get("num_experts"):
        return [0] * cfg["num_layers"]
    return moe_layer_pattern(cfg.get("moe_layer_freq", 1), cfg["num_layers"])


def _deepseek_layer_names(cfg: dict, i: int, p: str) -> dict:
    a, o = p + "self_attn.", f"layers.{i}.attn."
    out = {o + "kv_down.weight": [a + "kv_a_proj_with_mqa.weight"],
           o + "kv_norm.weight": [a + "kv_a_layernorm.weight"],
           o + "kv_up.weight": [a + "kv_b_proj.weight"],
           o + "proj.weight": [a + "o_proj.weight"]}
    if cfg.get("q_lora_rank") is None:
        out[o + "q_proj.weight"] = [a + "q_proj.weight"]
    else:
        out.update({o + "q_down.weight": [a + "q_a_proj.weight"],
                    o + "q_norm.weight": [a + "q_a_layernorm.weight"],
                    o + "q_up.weight": [a + "q_b_proj.weight"]})
    m, q = p + "mlp.", f"layers.{i}.mlp."
    pattern = _moe_pattern(cfg)
    if not pattern[min(i, len(pattern) - 1)]:  # an MTP depth's layer: the last layer's kind
        out[q + "fc1.weight"] = [m + "gate_proj.weight", m + "up_proj.weight"]
        out[q + "fc2.weight"] = [m + "down_proj.weight"]
        return out
    out[q + "router.weight"] = [m + "gate.weight"]
    out[q + "router.expert_bias"] = [m + "gate.e_score_correction_bias"]
    for e in range(cfg["num_experts"]):
        x = m + f"experts.{e}."
        out[q + f"experts.experts.{e}.fc1"] = [x + "gate_proj.weight", x + "up_proj.weight"]
        out[q + f"experts.experts.{e}.fc2"] = [x + "down_proj.weight"]
    if cfg.get("moe_shared_expert_intermediate_size"):
        out[q + "shared_experts.fc1.weight"] = [m + "shared_experts.gate_proj.weight",
                                                m + "shared_experts.up_proj.weight"]
        out[q + "shared_experts.fc2.weight"] = [m + "shared_experts.down_proj.weight"]
    return out


class _Layout:
    """Where each global tensor lives under (tp, pp, ep, etp): its shape (in
    the partition view checkpoints use), the dim split over the tensor group
    (the expert-tensor group for the experts' weights; None: replicated), the
    size of that group, its pipeline stage and its expert-parallel rank."""

    def __init__(self, cfg: dict, tp: int, pp: int, ep: int, etp: int | None = None):
        from ..pipeline.layout import layer_layout

        etp = tp if etp is None else etp
        self.cfg, self.tp, self.pp, self.ep, self.etp = cfg, tp, pp, ep, etp
        h, heads, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_channels"]
        ng, L = cfg["num_query_groups"], cfg["num_layers"]
        problems = []
        for what, n in (("vocab_size", cfg["vocab_size"]), ("num_attention_heads", heads),
                        ("ffn_hidden_size", cfg["ffn_hidden_size"])):
            if n % tp:
                problems.append(f"{what} {n} is not divisible by the tensor-parallel size {tp}")
        if ng % tp and (tp % ng or heads % tp):
            problems.append(f"num_key_value_heads {ng} and the tensor-parallel size {tp}: one "
                            "must divide the other")
        if cfg.get("num_experts"):
            if cfg["num_experts"] % ep:
                problems.append(f"num_local_experts {cfg['num_experts']} is not divisible by the "
                                f"expert-parallel size {ep}")
            if tp % etp:
                problems.append(f"--expert-tensor-parallel-size {etp} does not divide the "
                                f"tensor-parallel size {tp}")
            elif cfg["moe_ffn_hidden_size"] % etp:
                problems.append(f"the expert width {cfg['moe_ffn_hidden_size']} is not divisible "
                                f"by the expert-tensor-parallel size {etp}")
        elif ep > 1 or etp != tp:
            flag = (f"--expert-model-parallel-size {ep}" if ep > 1
                    else f"--expert-tensor-parallel-size {etp}")
            problems.append(f"{flag} needs an MoE model (this one is dense)")
        if L < pp:
            problems.append(f"{L} layers cannot fill {pp} pipeline stages")
        if problems:
            raise ConversionError("the model does not divide the layout: " + "; ".join(problems)
                                  + ". Pick sizes that divide it (or import at tp=pp=ep=1 and "
                                  "let --load reshard)")
        counts = layer_layout(L, pp, 1)
        self.stage_of_layer = [s for s, n in enumerate(counts) for _ in range(n)]
        self.qkv_split = ng % tp == 0
        self.d, self.h, self.heads, self.ng = d, h, heads, ng

    def place(self, name: str, shape: list) -> tuple:
        """(view shape, dim split in it or None, the size of the group it is
        split over, pipeline stage, ep rank or None)."""
        import re

        cfg = self.cfg
        stage = 0
        if name.startswith("layers."):
            stage = self.stage_of_layer[int(name.split(".")[1])]
        elif name in ("final_layernorm.weight", "output_layer.weight") or name.startswith("mtp."):
            stage = self.pp - 1
        expert = re.search(r"\.mlp\.experts\.experts\.(\d+)\.(fc1|fc2)$", name)
        ep_rank = int(expert.group(1)) // (cfg["num_experts"] // self.ep) if expert else None
        view, dim = list(shape), None
        if name in ("word_embeddings.weight", "output_layer.weight"):
            dim = 0
        elif name.endswith((".attn.qkv.weight", ".attn.qkv.bias")):
            dim = 0 if self.qkv_split else None
        elif name.endswith((".attn.q_proj.weight", ".attn.q_up.weight", ".attn.kv_up.weight")):
            dim = 0  # column-parallel over heads
        elif name.endswith((".attn.proj.weight", ".mlp.fc2.weight",
                            ".shared_experts.fc2.weight")) or (
                expert and expert.group(2) == "fc2"):
            dim = 1
        elif name.endswith((".mlp.fc1.weight", ".shared_experts.fc1.weight")) or (
                expert and expert.group(2) == "fc1"):
            view, dim = [2, shape[0] // 2, *shape[1:]], 1  # [gate; up], split along the width
        return view, dim, (self.etp if expert else self.tp), stage, ep_rank


# ---- Hugging Face files -----------------------------------------------------------------------
class _HFFiles:
    """The safetensors files of a Hugging Face directory, opened lazily and
    read through the checkpoint file engine: a slice of a tensor reads only
    its bytes (a row range is one positioned read; a column range, strided
    reads of at most 64 MiB)."""

    def __init__(self, directory: str):
        self.dir, self.entries = directory, {}
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self.where = json.load(f)["weight_map"]
            missing = sorted({f for f in self.where.values()
                              if not os.path.exists(os.path.join(directory, f))})
            if missing:
                raise ConversionError(f"{directory}: shard(s) {', '.join(missing)} named by "
                                      "model.safetensors.index.json are missing")
        elif os.path.exists(single):
            self.where = {k: "model.safetensors" for k in self._file("model.safetensors")}
        elif any(n.endswith(".bin") for n in os.listdir(directory)):
            raise ConversionError(f"{directory}: only safetensors checkpoints are supported "
                                  "(re-save with save_pretrained(..., safe_serialization=True))")
        else:
            raise ConversionError(f"{directory}: no model.safetensors or "
                                  "model.safetensors.index.json")

    def _file(self, fname: str) -> dict:
        if fname not in self.entries:
            self.entries[fname] = TensorFile(os.path.join(self.dir, fname)).entries
        return self.entries[fname]

    def slice(self, name: str) -> _HFTensor:
        if name not in self.where:
            raise ConversionError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        fname = self.where[name]
        entries = self._file(fname)
        if name not in entries:
            raise ConversionError(f"{self.dir}/{fname}: no tensor {name!r} (the index names it)")
        dtype, shape = entries[name][:2]
        return _HFTensor(self.dir, fname, name, dtype, shape)

    def shape(self, name: str) -> list:
        return self.slice(name).get_shape()

    def close(self):
        self.entries.clear()


class _HFTensor:
    """One tensor of a Hugging Face file; indexing with slices (a range of
    at most one dimension) reads only that part."""

    def __init__(self, directory, fname, name, dtype, shape):
        self.dir, self.fname, self.name, self.dtype, self.shape = (directory, fname, name, dtype,
                                                                   list(shape))

    def get_shape(self) -> list:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        part, out = None, list(self.shape)
        for dim, s in enumerate(index):
            lo, hi, step = s.indices(self.shape[dim])
            if (lo, hi) != (0, self.shape[dim]):
                if part is not None or step != 1:
                    raise ConversionError(f"{self.name}: one contiguous range per read")
                part, out[dim] = [dim, lo, hi], hi - lo
        dest = torch.empty(out, dtype=self.dtype)
        ld = StreamLoader(self.dir, {"pieces": [
            {"name": self.name, "kind": "hf", "global_shape": self.shape, "tp_slice": None,
             "flat": None, "file": self.fname, "key": self.name}]}, threads=1)
        ld.into(self.name, "hf", dest, part, self.shape)
        ld.wait()
        return dest


def _read_part(hf: _HFFiles, lay: _Layout, name: str, sources: list, dim, lo: int, hi: int):
    """Our tensor `name` in its view, or [lo, hi) of it along `dim` (None:
    whole), read from slices of the Hugging Face tensors it is fused from."""
    if name.endswith(("qkv.weight", "qkv.bias")):  # [group, (queries, key, value), d]
        d, ng, qpg = lay.d, lay.ng, lay.heads // lay.ng
        per = (qpg + 2) * d
        g0, g1 = (0, ng) if dim is None else (lo // per, hi // per)
        q, k, v = (hf.slice(s) for s in sources)
        parts = []
        for g in range(g0, g1):
            parts += [q[g * qpg * d:(g + 1) * qpg * d], k[g * d:(g + 1) * d],
                      v[g * d:(g + 1) * d]]
        return torch.cat(parts, 0)
    if len(sources) == 2:  # [gate; up] viewed [2, f, h], split along f
        gate, up = (hf.slice(s) for s in sources)
        if dim is None:
            lo, hi = 0, hf.shape(sources[0])[0]
        return torch.stack([gate[lo:hi], up[lo:hi]], 0)
    src = hf.slice(sources[0])
    if dim is None:
        return src[:]
    return src[lo:hi] if dim == 0 else src[:, lo:hi]


def _our_tensors(cfg: dict, hf: _HFFiles) -> dict:
    """{our global name: (HF source names, global shape in our natural layout)}."""
    h, d = cfg["hidden_size"], cfg["kv_channels"]
    heads, ng = cfg["num_attention_heads"], cfg["num_query_groups"]
    qkv_bias = cfg.get("add_qkv_bias") or cfg.get("add_bias_linear")
    out = {"word_embeddings.weight": (["model.embed_tokens.weight"], None)}
    for i in range(cfg["num_layers"]):
        for n, srcs in _hf_layer_names(cfg, i, qkv_bias).items():
            out[n] = (srcs, None)
    out["final_layernorm.weight"] = (["model.norm.weight"], None)
    if not cfg["share_embeddings_and_output_weights"]:
        out["output_layer.weight"] = (["lm_head.weight"], None)
    for j in range(cfg.get("mtp_num_layers") or 0):
        for n, srcs in _mtp_names(cfg, j, qkv_bias).items():
            out[n] = (srcs, None)
    for n, (srcs, _) in list(out.items()):
        shapes = [hf.shape(s) for s in srcs]
        if n.endswith("qkv.weight"):
            want = [[heads * d, h], [ng * d, h], [ng * d, h]]
        elif n.endswith("qkv.bias"):
            want = [[heads * d], [ng * d], [ng * d]]
        else:
            want = None
        if want is not None and shapes != want:
            raise ConversionError(f"{srcs}: shapes {shapes}, expected {want} from config.json")
        shape = [sum(s[0] for s in shapes), *shapes[0][1:]]
        out[n] = (srcs, shape)
    return out


def import_hf(hf_dir: str, output: str, *, tensor_model_parallel_size: int = 1,
              pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
              max_file_bytes: int = 2 << 30,
              expert_tensor_parallel_size: int | None = None) -> str:
    """Converts a Hugging Face checkpoint directory into our checkpoint format
    at `output` (see the module docstring); returns the checkpoint path. Each
    model-parallel rank's shards go to files of about `max_file_bytes`, built
    one at a time (the converter's peak memory). The experts' weights are
    split over `expert_tensor_parallel_size` (default: the tensor-parallel
    size), as ``--expert-tensor-parallel-size`` splits them in training."""
    from ..checkpoint import FORMAT_VERSION

    cpath = os.path.join(hf_dir, "config.json")
    if not os.path.exists(cpath):
        raise ConversionError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    with open(cpath) as f:
        hf_cfg = json.load(f)
    cfg = config_from_hf(hf_cfg)  # an unsupported architecture is named before any file
    hf = _HFFiles(hf_dir)
    mtp = int(hf_cfg.get("num_nextn_predict_layers") or 0) \
        if cfg.get("multi_latent_attention") else 0
    if mtp and f"model.layers.{cfg['num_layers']}.eh_proj.weight" in hf.where:
        cfg["mtp_num_layers"] = mtp  # DeepSeek's release holds them; transformers' saves do not
    cfg = _full_config(cfg)
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, \
        expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    for flag, n in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        if n < 1:
            raise ConversionError(f"{flag} must be >= 1, got {n}")
    lay = _Layout(cfg, tp, pp, ep, etp)
    tensors = _our_tensors(cfg, hf)
    # Which model-parallel rank file holds each piece.
    files: dict = {}
    for name, (srcs, shape) in tensors.items():
        view, dim, split, stage, ep_rank = lay.place(name, shape)
        eps = [ep_rank] if ep_rank is not None else [0]
        ranks = range(split) if dim is not None else [0]
        for t in ranks:
            for e in eps:
                files.setdefault((stage, e, t), []).append((name, srcs, view, dim, split, t))
    name = _C.checkpoint_name(0)
    final = os.path.join(output, name)
    if os.path.exists(final):
        raise ConversionError(f"{final} exists: choose an empty --output directory")
    with engine_errors():
        tmp = _C.checkpoint_begin(output, name)
    pieces = []
    for i, key in enumerate(sorted(files)):
        out, nbytes, part = {}, 0, 0

        def flush(i=i):
            nonlocal out, nbytes, part
            if not out:
                return
            fname = f"rank{i}-{part:05d}.safetensors"
            write(os.path.join(tmp, fname), out, {"rank": i, "iteration": 0,
                                                  "source": "import-hf"})
            for pc in pieces:
                if pc["file"] is None:
                    pc["file"] = fname
            out, nbytes, part = {}, 0, part + 1

        for tname, srcs, view, dim, split, t in files[key]:
            if dim is None:
                part_t = _read_part(hf, lay, tname, srcs, None, 0, 0)
                tp_slice, local = None, view
            else:
                n = view[dim] // split
                lo, hi = t * n, (t + 1) * n
                part_t = _read_part(hf, lay, tname, srcs, dim, lo, hi)
                tp_slice = [dim, lo, hi]
                local = list(view)
                local[dim] = n
            part_t = part_t.reshape(local).contiguous()
            k = f"model/{tname}"
            out[k] = part_t
            nbytes += part_t.numel() * part_t.element_size()
            pieces.append({"name": tname, "kind": "param", "global_shape": list(view),
                           "dtype": str(part_t.dtype), "tp_slice": tp_slice,
                           "flat": [0, part_t.numel()], "file": None, "key": k})
            if nbytes >= max_file_bytes:  # bounded memory: never a whole rank's shard
                flush()
        flush()
    hf.close()
    meta = {"format": FORMAT_VERSION, "iteration": 0, "config": cfg,
            "extra": {"consumed_samples": 0, "imported_from": os.path.abspath(hf_dir),
                      "hf_architecture": hf_cfg["architectures"][0]},
            "parallel": {"world": 0, "tp": tp, "pp": pp, "dp": 1, "ep": ep, "etp": etp, "cp": 1,
                         "vpp": 1,
                         "source": "import-hf"},
            "pieces": pieces, "ddp": {}}
    with engine_errors():  # metadata.json, the rename, `latest`
        return _C.checkpoint_commit(output, name, json.dumps(meta), 0)


# ---- export -----------------------------------------------------------------------------------
_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def _deinterleave(w: torch.Tensor, heads: int, d: int, rot: int) -> torch.Tensor:
    """Rows of `heads` heads from the interleaved RoPE pairing (2i, 2i+1) to
    the rotate-half one (i, i + rot/2): the same attention scores."""
    w = w.reshape(heads, d, *w.shape[1:])
    r = w[:, :rot]
    r = torch.cat([r[:, 0::2], r[:, 1::2]], dim=1)
    return torch.cat([r, w[:, rot:]], dim=1).reshape(heads * d, *w.shape[2:])


def export_hf(load: str, output: str, *, dtype: str = "auto",
              max_shard_size: int = 2 << 30) -> str:
    """Writes the checkpoint at `load` (a directory's latest or an iter_*
    path) as a Hugging Face model directory `output` (config.json,
    safetensors shards and their index); returns `output`."""
    from ..checkpoint import read_metadata

    if dtype not in _DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    try:
        found = read_metadata(load)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    if found is None:
        raise ConversionError(f"--load {load}: no checkpoint there")
    path, meta = found
    cfg = meta.get("config") or {}
    if "hidden_size" not in cfg or "vocab_size" not in cfg:
        raise ConversionError(f"{path}: its metadata has no GPT model config")
    cfg = _full_config({k: v for k, v in cfg.items() if k in _gpt_fields()})
    _family(cfg)  # an error now, before anything is written
    params = {}
    for pc in meta["pieces"]:
        if pc["kind"] == "param":
            params.setdefault(pc["name"], (pc["global_shape"], pc["dtype"]))
    want = _DTYPES[dtype]
    stored = {d for _, d in params.values()}
    out_dtype = want or (getattr(torch, next(iter(stored)).replace("torch.", ""))
                         if len(stored) == 1 else torch.float32)
    os.makedirs(output, exist_ok=True)
    d = cfg["kv_channels"]
    heads, ng = cfg["num_attention_heads"], cfg["num_query_groups"]
    rot = int(d * cfg["rotary_percent"])
    rot -= rot % 2
    qkv_bias = cfg["add_qkv_bias"] or cfg["add_bias_linear"]
    # (our names, {Hugging Face name: our name} written as copies), one group at a time
    groups = [(["word_embeddings.weight"], {})]
    groups += [(list(_hf_layer_names(cfg, i, qkv_bias)), {}) for i in range(cfg["num_layers"])]
    groups.append((["final_layernorm.weight"] + (
        [] if cfg["share_embeddings_and_output_weights"] else ["output_layer.weight"]), {}))
    # DeepSeek's MTP depths (other families have no Hugging Face place for them), each
    # with copies of the embedding and output layer
    depths = (cfg.get("mtp_num_layers") or 0) if cfg["multi_latent_attention"] else 0
    groups += [(list(_mtp_names(cfg, j, qkv_bias)), _mtp_copies(cfg, j)) for j in range(depths)]
    shard, shard_bytes, index, nshard = {}, 0, {}, 0
    written = []

    def flush():
        nonlocal shard, shard_bytes, nshard
        if not shard:
            return
        nshard += 1
        fname = f"model-{nshard:05d}.safetensors"
        write(os.path.join(output, fname), shard, {"format": "pt"})
        for k in shard:
            index[k] = fname
        written.append(fname)
        shard, shard_bytes = {}, 0

    for names, copies in groups:
        load = list(dict.fromkeys(names + list(copies.values())))
        missing = [n for n in load if n not in params]
        if missing:
            raise ConversionError(f"{path}: no stored tensor(s) {missing[:3]} (a checkpoint of a "
                                  "different model?)")
        ld = StreamLoader(path, meta)
        full = {}
        try:
            for n in load:
                gshape, dt = params[n]
                full[n] = torch.empty(gshape, dtype=getattr(torch, dt.replace("torch.", "")))
                ld.into(n, "param", full[n], None, gshape)
        finally:
            ld.wait()
        pairs = [(hf_name, full[n]) for hf_name, n in copies.items()]
        for n in names:
            pairs += _to_hf(n, full[n], cfg, heads, ng, d, rot, qkv_bias)
        for hf_name, x in pairs:
            x = x.to(out_dtype).contiguous()
            shard[hf_name] = x
            shard_bytes += x.numel() * x.element_size()
        full.clear()
        if shard_bytes >= max_shard_size:
            flush()
    flush()
    if len(written) == 1:
        os.replace(os.path.join(output, written[0]), os.path.join(output, "model.safetensors"))
    else:
        total = sum(os.path.getsize(os.path.join(output, f)) for f in written)
        with open(os.path.join(output, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=2)
    dname = str(out_dtype).replace("torch.", "")
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(hf_config_from(cfg, dname), f, indent=2)
    return output


def _gpt_fields() -> set:
    from ..models.gpt import GPTConfig

    return set(GPTConfig.__dataclass_fields__)


def _to_hf(n, t, cfg, heads, ng, d, rot, qkv_bias):
    """[(Hugging Face name, tensor)] of our global tensor `n` (its view)."""
    if n == "word_embeddings.weight":  # tied: transformers ties lm_head to it
        return [("model.embed_tokens.weight", t)]
    if n == "final_layernorm.weight":
        return [("model.norm.weight", t)]
    if n == "output_layer.weight":
        return [("lm_head.weight", t)]
    i = int(n.split(".")[1])
    srcs = (_mtp_names(cfg, i, qkv_bias) if n.startswith("mtp.") else
            _hf_layer_names(cfg, i, qkv_bias))[n]
    if n.endswith(("qkv.weight", "qkv.bias")):
        qpg = heads // ng
        g = t.reshape(ng, (qpg + 2) * d, *t.shape[1:])
        q = g[:, :qpg * d].reshape(heads * d, *t.shape[1:])
        k = g[:, qpg * d:(qpg + 1) * d].reshape(ng * d, *t.shape[1:])
        v = g[:, (qpg + 1) * d:].reshape(ng * d, *t.shape[1:])
        if cfg["rotary_interleaved"]:  # to the rotate-half pairing transformers uses
            q, k = _deinterleave(q, heads, d, rot), _deinterleave(k, ng, d, rot)
        return list(zip(srcs, (q, k, v), strict=True))
    if len(srcs) == 2:  # [gate; up] viewed [2, f, h]
        return [(srcs[0], t[0]), (srcs[1], t[1])]
    return [(srcs[0], t)]
