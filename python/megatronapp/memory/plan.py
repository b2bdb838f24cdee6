"""The memory planner: what one rank of a training run holds, before running
it (``megatronapp.memory.estimate``, ``python -m megatronapp.memory estimate``).

It reads the run's flags (a :class:`~megatronapp.training.Config`, the
pretrain parser's namespace or a dict of flag names) and does not build or
validate anything: callers check the configuration first (``Config.check``).

Per rank, in bytes:

* **parameters**, **gradients** (the DDP buckets: fp32 main gradients under
  --bf16/--fp16; ZeRO-1's padded buckets plus its parameter buffer and
  reduce-scatter shard), **optimizer** state (AdamW moments or SGD's momentum; fp32 master
  weights under mixed precision or ZeRO-1; sharded over dp with
  --use-distributed-optimizer), **communication** (codec error feedback and
  state, per bucket), **data** (the token stream kept in memory);
* **activations per microbatch** of each model chunk: the tensors autograd
  keeps for backward, counted from this runtime's layers (what each op saves:
  LayerNorm inputs, linear inputs — sharded under sequence parallelism —,
  the fused QKV output, core attention's saved tensors for the backend,
  MLP intermediates), reduced by selective or full recomputation; under
  context parallelism every activation holds seq / cp tokens, and gradients
  and ZeRO-1's shards are over the dp x cp ranks that reduce them;
* **in-flight activations**: the schedule's own peak, walking the stage's
  actions (F stores a microbatch's activations, B frees them; zero-bubble's
  BI keeps what W still needs — every linear's input and output gradient —
  until W) plus the working set of the backward step at that moment (one
  layer's gradients, the recomputed region, the logits' cross-entropy);
* **pool overhead**: the expected reserved-over-allocated of the caching pool
  (its block rounding and fragmentation; docs/memory.md).

``total`` (everything but the pool overhead) is what the pool reports as peak
allocated bytes; tests/python/test_memory_plan.py checks it within 10% on
every layout of its matrix, and benchmarks/RESULTS.md lists the comparison.
Transformer shapes at scale (the 530B run) use the same formulas.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

__all__ = ["Breakdown", "estimate", "plan_recompute", "MemoryLimitError"]

_MiB = 2**20
#: Expected pool overhead: reserved over peak allocated on the recorded GPT
#: traces (docs/memory.md: 0.1-6.1% fragmentation; the upper end is planned).
POOL_OVERHEAD = 0.06


class MemoryLimitError(ValueError):
    """Nothing fits under --memory-limit-gb; the message says what to try."""


@dataclass
class Breakdown:
    """Bytes per rank (the worst pipeline stage unless a stage was asked for)."""

    stage: int
    parameters: int
    gradients: int
    optimizer: int
    communication: int
    data: int
    activations_per_microbatch: int  #: one microbatch through all of this stage's chunks
    in_flight_activations: int  #: the schedule's peak of stored activations
    peak_in_flight_microbatches: float  #: in units of one microbatch through the stage
    transient: int  #: backward working set at that peak
    pool_overhead: int
    recompute: str = "none"

    @property
    def static(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.communication + self.data

    @property
    def total(self) -> int:
        """Peak allocated bytes (what the pool's peak_allocated_bytes measures)."""
        return self.static + self.in_flight_activations + self.transient

    @property
    def reserved(self) -> int:
        return self.total + self.pool_overhead

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(static=self.static, total=self.total, reserved=self.reserved)
        return d

    def table(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer), ("communication buffers", self.communication),
                ("data", self.data),
                ("activations / microbatch", self.activations_per_microbatch),
                (f"in-flight activations (peak {self.peak_in_flight_microbatches:.2f} "
                 f"microbatches)", self.in_flight_activations),
                ("backward working set", self.transient),
                ("total (peak allocated)", self.total),
                (f"pool overhead (~{POOL_OVERHEAD:.0%})", self.pool_overhead),
                ("reserved", self.reserved)]
        out = [f"pipeline stage {self.stage}, recomputation {self.recompute}"]
        out += [f"  {name:<45s} {b / _MiB:12.2f} MiB" for name, b in rows]
        return "\n".join(out)


# ---- shapes -----------------------------------------------------------------------------


@dataclass
class _Shape:
    tp: int
    pp: int
    dp: int
    cp: int  #: context-parallel size: activations hold s = seq / cp tokens
    vpp: int
    microbatches: int
    b: int
    s: int  #: tokens of one sequence on this rank (seq / cp)
    seq: int  #: the whole sequence (position embeddings)
    h: int
    a: int
    f: int
    vocab: int  #: padded
    layers: list  #: layers per virtual stage
    sp: bool
    tied: bool
    act: int  #: bytes of the model dtype
    grad: int  #: bytes of a gradient-bucket element
    mixed: bool
    zero: bool
    codec: str
    attention_local: bool
    attention_dropout: float
    recompute: str | None
    method: str | None
    recompute_layers: int | None
    distribute: bool
    schedule: str
    policy: str
    memory_limit: int | None
    # ---- the block (Llama / Qwen / Mixtral flags; defaults: GPT-2's) ----
    d: int = 0  #: channels per head (--kv-channels; default h / a)
    g: int = 0  #: key/value groups (--num-query-groups; default a)
    gate: int = 1  #: 2 with --swiglu (fc1 holds gate and up)
    bias: bool = True  #: linear biases (not --disable-bias-linear)
    qkv_bias: bool = True
    rms: bool = False  #: RMSNorm: a weight, no bias, no saved mean
    learned_pos: bool = True  #: a position table (not with rope / none)
    rope: bool = False
    qk_norm: bool = False
    # ---- multi-latent attention (--multi-latent-attention; 0: off) ----
    rq: int = 0  #: --q-lora-rank (0: a plain query projection)
    rkv: int = 0  #: --kv-lora-rank
    dq: int = 0  #: --qk-head-dim
    dr: int = 0  #: --qk-pos-emb-head-dim (the decoupled rotary key/query channels)
    dv: int = 0  #: --v-head-dim
    mtp: int = 0  #: --mtp-num-layers: extra layers, logits and losses on the last stage
    #: fp32 optimizer state bytes per parameter: AdamW's two moments (8), SGD's
    #: momentum buffer (4; none without momentum)
    state_bytes: int = 8
    #: --optimizer muon: the linear layers' matrices keep one momentum (4 bytes),
    #: the rest AdamW's two moments (state_bytes)
    muon: bool = False

    @property
    def mla(self) -> bool:
        return self.rkv > 0

    @property
    def qkv(self) -> int:
        """Output features of the fused QKV projection: (a + 2 g) d; under MLA
        the query and the key/value up projections' together."""
        if self.mla:
            return self.a * (2 * self.dq + self.dr + self.dv)
        return (self.a + 2 * self.g) * self.d

    @property
    def dv_(self) -> int:
        """Value channels per head (the output projection's input per head)."""
        return self.dv if self.mla else self.d


def _flags(config) -> dict:
    """{flag name with underscores: value} of a Config, namespace or dict."""
    if hasattr(config, "flat"):
        return config.flat()
    return dict(config) if isinstance(config, dict) else dict(vars(config))


def _granularity(f: dict):
    if f.get("recompute_activations") and f.get("recompute_granularity") is None:
        return "selective"
    return f.get("recompute_granularity")


def _shape(f: dict, world_size: int, vocab_size: int | None) -> _Shape:
    from ..data import padded_vocab_size
    from ..pipeline.layout import layer_layout, parse_layout

    if f.get("num_experts"):
        raise ValueError("the memory planner does not model MoE layers yet (--num-experts): "
                         "its estimate would leave out the experts' weights and the dispatched "
                         "tokens; size MoE runs with megatronapp.tools.scale_model.memory_per_gpu or "
                         "drop --memory-limit-gb / --recompute-granularity auto")
    tp, pp = f["tensor_model_parallel_size"], f["pipeline_model_parallel_size"]
    vpp = f.get("virtual_pipeline_model_parallel_size") or 1
    cp = f.get("context_parallel_size") or 1
    dp = world_size // (tp * pp * cp)
    b = f["micro_batch_size"]
    layout = layer_layout(f["num_layers"], pp, vpp, first=f.get("decoder_first_pipeline_num_layers"),
                          last=f.get("decoder_last_pipeline_num_layers"),
                          layout=parse_layout(f["pipeline_layer_layout"])
                          if f.get("pipeline_layer_layout") else None)
    if vocab_size is None:
        vocab_size = 256  # the byte-level tokenizer
    mixed = bool(f.get("bf16") or f.get("fp16"))
    act = 2 if mixed else 4
    backend = f.get("attention_backend", "auto")
    on_cpu = f.get("distributed_backend", "auto") == "gloo" or (
        f.get("distributed_backend", "auto") == "auto" and not _cuda_available())
    dropout = f.get("attention_dropout", 0.0)
    local = backend in ("unfused", "local") or (backend == "auto" and dropout > 0 and on_cpu)
    h = f["hidden_size"]
    a = f["num_attention_heads"]
    gqa = f.get("group_query_attention") and f.get("num_query_groups")
    block = dict(d=f.get("kv_channels") or h // a, g=f["num_query_groups"] if gqa else a,
                 gate=2 if f.get("swiglu") else 1, bias=not f.get("disable_bias_linear"),
                 qkv_bias=not f.get("disable_bias_linear") or bool(f.get("add_qkv_bias")),
                 rms=f.get("normalization") == "RMSNorm",
                 learned_pos=f.get("position_embedding_type", "learned_absolute")
                 == "learned_absolute", rope=f.get("position_embedding_type") == "rope",
                 qk_norm=bool(f.get("qk_layernorm")))
    block["mtp"] = f.get("mtp_num_layers") or 0
    if f.get("optimizer", "adam") == "sgd":
        block["state_bytes"] = 4 if f.get("sgd_momentum", 0.9) else 0
    block["muon"] = f.get("optimizer") == "muon"
    if f.get("multi_latent_attention"):
        block.update(rq=f.get("q_lora_rank") or 0, rkv=f["kv_lora_rank"], dq=f["qk_head_dim"],
                     dr=f["qk_pos_emb_head_dim"], dv=f["v_head_dim"])
    return _Shape(**block,
        tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp, microbatches=f["global_batch_size"] // (b * dp),
        b=b, s=f["seq_length"] // cp, seq=f["seq_length"], h=h, a=f["num_attention_heads"],
        f=f.get("ffn_hidden_size") or 4 * h,
        vocab=padded_vocab_size(vocab_size, tp, f.get("make_vocab_size_divisible_by", 128)),
        layers=list(layout), sp=bool(f.get("sequence_parallel")) and tp > 1,
        tied=not f.get("untie_embeddings_and_output_weights"), act=act,
        grad=4 if (mixed or f.get("accumulate_allreduce_grads_in_fp32")) else act, mixed=mixed,
        zero=bool(f.get("use_distributed_optimizer")),
        codec=f.get("grad_compression", "none"), attention_local=local,
        attention_dropout=dropout, recompute=_granularity(f),
        method=f.get("recompute_method"), recompute_layers=f.get("recompute_num_layers"),
        distribute=bool(f.get("distribute_saved_activations")),
        schedule=f.get("pipeline_schedule", "1f1b"),
        policy=f.get("pipeline_dynamic_policy", "adaptive"),
        memory_limit=f.get("pipeline_memory_limit"))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ---- parameters -------------------------------------------------------------------------


def _layer_params(x: _Shape) -> tuple[int, int]:
    """(tensor-parallel, replicated) parameter elements of one layer on a rank."""
    h, f, t, d = x.h, x.f, x.tp, x.d
    norm = h if x.rms else 2 * h
    qkv = x.qkv * h + (x.qkv if x.qkv_bias else 0)
    fc1 = x.gate * f * h + (x.gate * f if x.bias else 0)
    if x.mla:  # up projections column-parallel; down projections and latent norms whole
        per = 1 if x.rms else 2
        q_in = x.rq or h
        sharded = (q_in * x.a * (x.dq + x.dr) + x.rkv * x.a * (x.dq + x.dv)) // t
        replicated = h * (x.rkv + x.dr) + per * x.rkv + (h * x.rq + per * x.rq if x.rq else 0)
    elif x.g % t == 0:
        sharded, replicated = qkv // t, 0
    else:  # query groups replicated over the tensor ranks: the whole QKV on each
        sharded, replicated = 0, qkv
    sharded += (x.a * x.dv_ * h) // t + fc1 // t + h * f // t
    replicated += 2 * norm + (2 * h if x.bias else 0)  # two norms, the row-parallel biases
    if x.qk_norm:
        replicated += 2 * (d if x.rms else 2 * d)
    return sharded, replicated


def _layer_vectors(x: _Shape) -> int:
    """The 1-D parameter elements (norms, biases) of one layer on a rank;
    the rest of :func:`_layer_params` are the linear layers' matrices."""
    h, f, t, d = x.h, x.f, x.tp, x.d
    norm = h if x.rms else 2 * h
    out = 2 * norm + (2 * h if x.bias else 0)
    if x.bias:
        out += x.gate * f // t
    if x.qkv_bias and not x.mla:
        out += x.qkv // t if x.g % t == 0 else x.qkv
    if x.qk_norm:
        out += 2 * (d if x.rms else 2 * d)
    if x.mla:
        per = 1 if x.rms else 2
        out += per * x.rkv + (per * x.rq if x.rq else 0)
    return out


def _muon_matrices(x: _Shape, vs: int) -> int:
    """Elements of virtual stage vs that --optimizer muon orthogonalizes: the
    layers' (and MTP depths') 2-D weights, not the embeddings or the output
    layer (training/setup.py's split)."""
    sh, rep = _layer_params(x)
    per_layer = sh + rep - _layer_vectors(x)
    n = per_layer * x.layers[vs]
    if vs == x.pp * x.vpp - 1 and x.mtp:
        n += (per_layer + 2 * x.h * x.h) * x.mtp
    return n


def _chunk_params(x: _Shape, vs: int) -> list[tuple[int, bool]]:
    """(elements, tensor-parallel) of each parameter group of virtual stage vs."""
    n_vs = x.pp * x.vpp
    first, last = vs == 0, vs == n_vs - 1
    groups = []
    sh, rep = _layer_params(x)
    groups += [(sh * x.layers[vs], True), (rep * x.layers[vs], False)]
    if first or (last and x.tied):
        groups.append((x.vocab // x.tp * x.h, True))  # word embeddings (or the replica)
    if first and x.learned_pos:
        groups.append((x.seq * x.h, False))  # positions
    if last:
        norm = (1 if x.rms else 2) * x.h
        groups.append((norm, False))  # final norm
        if not x.tied:
            groups.append((x.vocab // x.tp * x.h, True))
        if x.mtp:  # per depth: a layer, the 2h -> h projection (whole), three norms
            groups += [(sh * x.mtp, True), ((rep + 2 * x.h * x.h + 3 * norm) * x.mtp, False)]
    return groups


# ---- activations ------------------------------------------------------------------------


def _layer_saved(x: _Shape, selective: bool) -> tuple[int, int]:
    """(bytes autograd keeps for one layer and one microbatch, bytes of that
    which zero-bubble's W still needs after BI: the linear inputs and output
    gradients)."""
    s, b, h, f, t, e = x.s, x.b, x.h, x.f, x.tp, x.act
    sl = s // t if x.sp else s  # LayerNorm / residual region
    heads = x.a // t
    # two norm inputs and their statistics (fp32); RMSNorm also keeps its
    # normalized output before the weight (and a float32 copy of a 16-bit input)
    ln = 2 * sl * b * h * e + 4 * sl * b * 4
    if x.rms:
        ln += 2 * sl * b * h * e + (2 * sl * b * h * 4 if e != 4 else 0)
    # QKV and fc1 inputs: under sequence parallelism their sequence shard, gathered
    # again in backward (tensor_parallel.layers._SequenceParallelLinear)
    lin_in = 2 * sl * b * h * e
    # kept by the core attention: q, k, v (views of the QKV output; under
    # grouped-query attention copies expanded to every query head)
    qkv = 3 * s * b * heads * x.d * e
    if x.g == x.a and (x.qk_norm or x.rope):  # new q and k; v keeps the QKV output alive
        qkv += 2 * s * b * heads * x.d * e
    if x.mla:
        # q and k are concatenations [nope, rotated pe] and v a contiguous copy;
        # the latents: the down projection's output (the norm's input is a view
        # of it), the norm's statistics (and its normalized output and fp32
        # copy, as the block's RMSNorm) and its output (the up projection's
        # input; the sequence shard under sequence parallelism)
        qkv = s * b * heads * (2 * (x.dq + x.dr) + x.dv) * e

        def latent(r, whole):
            kept = sl * b * (whole + r) * e + sl * b * 4
            if x.rms:
                kept += sl * b * r * e + (sl * b * r * 4 if e != 4 else 0)
            return kept

        qkv += latent(x.rkv, x.rkv + x.dr) + (latent(x.rq, x.rq) if x.rq else 0)
    ctx = s * b * heads * x.dv_ * e  # the projection's input
    # fc1 output (the activation's input; gate and up with SwiGLU), its output
    # (fc2's input); SwiGLU also keeps silu(gate)
    mlp = (x.gate + 1 + (x.gate - 1)) * s * b * f // t * e
    core = 0
    if not selective:
        if x.attention_local:
            probs = b * heads * s * s * e
            core = probs * (2 if x.attention_dropout > 0 else 1)
        else:
            core = s * b * heads * x.dv_ * e + b * heads * s * 4  # SDPA's output and log-sum-exp
    saved = ln + lin_in + qkv + ctx + mlp + core
    # W keeps each linear's input and the gradient of its output.
    # (The row-parallel layers' output gradient is the whole [s, b, h]: under
    # sequence parallelism it is gathered before their backward.)
    w_residual = (s * b * h * e + s * b * x.qkv // t * e) \
        + (s * b * heads * x.dv_ * e + s * b * h * e) \
        + (s * b * h * e + s * b * x.gate * f // t * e) + (s * b * f // t * e + s * b * h * e)
    return saved, w_residual


def _layer_backward_working_set(x: _Shape) -> int:
    """Gradients alive while one layer runs backward (the MLP's: the fc1/GELU
    output gradients, 2 x s b f/t, and the residual stream's)."""
    s, b, h, f, t, e = x.s, x.b, x.h, x.f, x.tp, x.act
    sl = s // t if x.sp else s
    ws = (x.gate + 1) * s * b * f // t * e + 2 * sl * b * h * e + s * b * h * e
    if x.attention_local:
        ws = max(ws, 2 * b * (x.a // t) * s * s * e + s * b * x.qkv // t * e)
    return ws


def _chunk_activations(x: _Shape, vs: int) -> dict:
    """Bytes one microbatch keeps through virtual stage vs, its W residual,
    and the backward working set of the stage."""
    n_vs = x.pp * x.vpp
    first, last = vs == 0, vs == n_vs - 1
    s, b, h, t, e = x.s, x.b, x.h, x.tp, x.act
    sl = s // t if x.sp else s
    n = x.layers[vs]
    full, w_res = _layer_saved(x, selective=x.recompute == "selective")
    layer_in = sl * b * h * e // (t if x.distribute else 1)
    ws = _layer_backward_working_set(x)
    if x.recompute == "full":
        k = x.recompute_layers
        # One group is recomputed at a time; its activations are freed as its
        # backward proceeds, so they, not the gradients, set the working set.
        if x.method == "uniform":
            groups = -(-n // k)
            stored = groups * layer_in
            ws = max(ws, min(k, n) * full + s * b * h * e)
        else:
            kept = max(0, n - k)
            stored = min(k, n) * layer_in + kept * full
            ws = max(ws, full + s * b * h * e)
        w_total = n * w_res
    else:
        stored = n * full
        w_total = n * w_res
        # selective: the recomputed attention lives only inside its layer's
        # backward, within the attention working set counted above.
    if last:
        logits = s * b * x.vocab // t * 4  # fp32 logits kept by the cross-entropy
        head = sl * b * h * e + s * b * h * e + logits + (logits // 2 if x.act == 2 else 0)
        stored += head
        # The output layer's W keeps its input and the logits' gradient.
        w_total += s * b * h * e + s * b * x.vocab // t * e
        if x.mtp:
            # per depth: its layer, the two norms' inputs and statistics, the
            # projection's input [2h], and the same head (final norm, logits)
            norms = 2 * sl * b * h * e + 2 * sl * b * 4
            if x.rms:
                norms += 2 * sl * b * h * e + (2 * sl * b * h * 4 if e != 4 else 0)
            stored += x.mtp * (full + norms + 2 * sl * b * h * e + head)
            w_total += x.mtp * (w_res + s * b * h * e + s * b * x.vocab // t * e)
        # cross-entropy backward: the shifted logits, softmax, one-hot, their difference
        ws = max(ws, 4 * logits + s * b * h * e)
    else:
        stored += sl * b * h * e  # the stage output the executor keeps for backward
    if first:
        stored += 2 * b * s * 8  # token ids, labels
    # recv: the input arrives from the previous stage; grad_in: the output's
    # gradient arrives from the next one.
    return {"stored": stored, "w": w_total, "ws": ws, "recv": not first, "grad_in": not last}


def _schedule_peak(x: _Shape, stage: int, acts: list) -> tuple[int, float, int]:
    """Walks the stage's actions: (peak stored bytes + working set at it,
    peak in microbatch units, the working set)."""
    from ..pipeline import current_schedule, make_schedule

    if x.pp == 1:
        c = acts[0]
        return c["stored"], 1.0, c["ws"]
    sched = current_schedule(make_schedule(x.schedule, x.pp, x.microbatches, x.vpp,
                                           policy=x.policy, memory_limit=x.memory_limit))
    # Besides what autograd keeps: a posted receive's buffer lives from RECV
    # to its F/B, and a sent input gradient until the step ends (the executor
    # waits for gradient sends in finish(); activation sends are released
    # when their gradient comes back, and their tensor is the stored output).
    msg = (x.s // x.tp if x.sp else x.s) * x.b * x.h * x.act
    live, peak, at_peak_ws = 0, 0, 0
    for a in sched.actions(stage):
        c = acts[a.chunk]
        if a.type in ("RECV_ACT", "RECV_GRAD", "SEND_GRAD"):
            live += msg
        elif a.type == "F":
            live += c["stored"] - (msg if c["recv"] else 0)
            if live > peak:
                peak, at_peak_ws = live, c["ws"]
        elif a.type in ("B", "BI"):
            if live + c["ws"] > peak + at_peak_ws:
                peak, at_peak_ws = live, c["ws"]
            live -= msg if c["grad_in"] else 0
            live += (c["w"] if a.type == "BI" else 0) - c["stored"]
        elif a.type == "W":
            live -= c["w"]
    per_mb = sum(c["stored"] for c in acts)
    return peak, peak / per_mb if per_mb else 0.0, at_peak_ws


def _stage(x: _Shape, stage: int, data_bytes: int) -> Breakdown:
    vss = [c * x.pp + stage for c in range(x.vpp)]
    groups = [g for vs in vss for g in _chunk_params(x, vs)]
    n_params = sum(n for n, _ in groups)
    params = n_params * x.act
    grads = n_params * x.grad
    comm = 0
    if x.codec != "none":
        import torch

        from .. import _C  # noqa: F401  (registers torch.ops.mapp)

        lossy = sum(n for n, tp_sharded in groups if tp_sharded or x.tp == 1)
        shapes = torch.ops.mapp.codec_state_shapes(x.codec, lossy, x.dp * x.cp, [])
        comm = 4 * sum(int(v) for v in shapes)
    # optimizer state per parameter, averaged: Muon keeps one momentum for its matrices
    state = x.state_bytes
    if x.muon and n_params:
        muon = sum(_muon_matrices(x, vs) for vs in vss)
        state = (4 * muon + x.state_bytes * (n_params - muon)) / n_params
    if x.zero:  # gradients are reduced (and ZeRO-1 shards) over dp x cp
        shard = -(-n_params // (x.dp * x.cp))
        grads = shard * x.dp * x.cp * x.grad + shard * 4  # padded buckets, the reduce-scatter shard
        optimizer = int(shard * (4 + state))  # fp32 master + moments, this rank's part
    else:
        optimizer = int(n_params * (state + (4 if x.mixed else 0)))
    acts = [_chunk_activations(x, vs) for vs in vss]
    in_flight, units, ws = _schedule_peak(x, stage, acts)
    bd = Breakdown(stage=stage, parameters=params, gradients=grads, optimizer=optimizer,
                   communication=comm, data=data_bytes,
                   activations_per_microbatch=sum(c["stored"] for c in acts),
                   in_flight_activations=in_flight, peak_in_flight_microbatches=units,
                   transient=ws, pool_overhead=0, recompute=x.recompute or "none")
    bd.pool_overhead = int(bd.total * POOL_OVERHEAD)
    return bd


def estimate(config, world_size: int | None = None, *, stage: int | None = None,
             vocab_size: int | None = None, data_bytes: int | None = None) -> Breakdown:
    """Per-rank memory of the run `config` (a :class:`~megatronapp.training.Config`,
    the pretrain flags' namespace or a dict of them; valid: check it first) on
    `world_size` ranks (default tp x pp): the worst pipeline stage, or
    `stage`. `vocab_size` before padding (default: the byte-level
    tokenizer's 256); `data_bytes` the resident token stream (default: from
    --data-path or the bundled corpus)."""
    f = _flags(config)
    if world_size is None:
        world_size = f["tensor_model_parallel_size"] * f["pipeline_model_parallel_size"]
    x = _shape(f, world_size, vocab_size)
    if data_bytes is None:
        data_bytes = _resident_data_bytes(f.get("data_path"))
    stages = range(x.pp) if stage is None else [stage]
    return max((_stage(x, st, data_bytes) for st in stages), key=lambda bd: bd.total)


def _resident_data_bytes(data_path) -> int:
    """A text file is tokenized into memory (8 bytes a token, about one per
    byte); indexed datasets are memory-mapped (page cache, shared, not ours)."""
    from ..data import default_corpus
    from ..data.indexed import exists

    paths = [data_path] if isinstance(data_path, str) else list(data_path or [])
    if not paths:
        return 8 * os.path.getsize(default_corpus())
    if len(paths) == 1 and os.path.isfile(paths[0]) and not exists(paths[0]):
        return 8 * os.path.getsize(paths[0])
    return 0


def plan_recompute(config, world_size: int, limit_bytes: int, **kw):
    """--recompute-granularity auto: the least recomputation that fits
    `limit_bytes` per rank, in order none, selective, full block with 1..L
    layers per stage, full uniform with 1 layer per group. Returns
    (granularity, method, num_layers, Breakdown); raises MemoryLimitError."""
    f = _flags(config)
    layers = max(_shape(f, world_size, kw.get("vocab_size")).layers)
    tries = [(None, None, None), ("selective", None, None)]
    tries += [("full", "block", k) for k in range(1, layers + 1)]
    tries += [("full", "uniform", 1)]
    best = None
    for gran, method, k in tries:
        trial = dict(f, recompute_activations=False, recompute_granularity=gran,
                     recompute_method=method, recompute_num_layers=k)
        bd = estimate(trial, world_size, **kw)
        best = bd if best is None or bd.total < best.total else best
        if bd.total <= limit_bytes:
            return gran, method, k, bd
    tp = f["tensor_model_parallel_size"]
    raise MemoryLimitError(
        f"needs {best.total / 2**30:.3f} GiB per rank even with the most recomputation "
        f"({best.recompute}), limit {limit_bytes / 2**30:.3f} GiB; try more tensor or "
        f"pipeline parallelism (tp={2 * tp}, or a larger --pipeline-model-parallel-size), "
        f"--use-distributed-optimizer, --bf16, or a smaller --micro-batch-size")
