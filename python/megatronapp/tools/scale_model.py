"""A calibrated performance model for planning runs past this machine.

Predicts the iteration time of a Megatron-style GPT job (tensor x pipeline x
data parallelism) on a cluster described by :class:`Hardware`, by feeding
per-stage compute and communication times into the pipeline simulator
(:func:`megatronapp.pipeline.simulate`, the same event simulator the executor
is checked against) and adding the data-parallel gradient reduction and the
optimizer step.

Terms (per microbatch, per pipeline stage, per GPU of the tensor group):

* matrix multiplies: FLOPs / (peak x ``gemm_efficiency``). Forward of one layer
  ``2 b s (3 h^2 + h^2 + 2 h f) + 4 b s^2 h`` over t GPUs; the input gradient
  costs as much again, the weight gradient as much as the weight matmuls;
  full activation recomputation adds one forward to the backward; the output
  layer ``2 b s h V / t`` sits on the last stage;
* memory-bound element-wise work (LayerNorm, GELU, softmax, dropout, residual):
  the activation bytes of Korthikanti et al. 2022 (``s b h (10 + 24/t) + 5 a s^2
  b / t``) moved ``memory_passes`` times per pass at HBM bandwidth;
* tensor-parallel all-reduces (2 per layer per pass, ``s b h`` elements):
  ring over the node's links, ``2 (t-1) latency + 2 (t-1)/t bytes / bus_bw``;
* pipeline send/receive: ``latency + bytes / bw`` per microbatch and boundary
  (``s b h / t`` elements with Megatron's scatter-gather across the tensor
  group), on the inter-node link when consecutive stages sit on different nodes;
* data-parallel gradients: ring all-reduce (or reduce-scatter + all-gather for
  ZeRO-1, same bytes) of this GPU's parameters over d ranks on the inter-node
  link, at ``grad_bytes`` per element (a codec shrinks it: int8 ~ 1.02,
  onebit ~ 0.14 bytes); overlapped with the last backward passes when
  ``overlap_dp`` is set;
* optimizer: ``optimizer_bytes`` per parameter of this GPU's shard (distributed
  optimizer: the parameters of the stage divided over d) at HBM bandwidth;
* context parallelism (``cp``): every term above sees ``s / cp`` tokens of a
  sequence (core attention: ``s / cp`` queries against all ``s`` keys, balanced
  by the zigzag split); the ring (p2p) passes K and V (``2 s/cp b kv/t``
  elements) ``cp - 1`` times per layer, each step hidden behind that step's
  block of attention (backward: dK and dV as well, against twice the compute);
  Ulysses (a2a) moves q, k, v and the output across the cp group, 4 all-to-alls
  per pass that nothing hides; gradients are reduced, and ZeRO-1 shards, over
  ``d x cp`` ranks. :func:`memory_per_gpu` says which recomputation fits.

``calibrate`` fits ``gemm_efficiency`` so that one published run is reproduced;
the others are then predictions. Inputs and anchors are documented in
docs/performance.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..pipeline.schedules import Schedule, costs, simulate


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  #: dense half-precision matmul rate per GPU, FLOP/s
    hbm_bandwidth: float  #: bytes/s per GPU
    gpus_per_node: int
    intra_bus_bandwidth: float  #: NCCL all-reduce bus bandwidth inside a node, bytes/s
    intra_latency: float  #: seconds per ring step inside a node
    inter_bandwidth: float  #: per-GPU network bandwidth between nodes, bytes/s (one direction)
    inter_latency: float  #: seconds per message / ring step between nodes
    gemm_efficiency: float = 0.8  #: achieved fraction of peak in matmuls (calibrated)
    memory_passes: float = 2.0  #: activation bytes read+written per element-wise pass
    memory_bytes: float = 80e9  #: HBM capacity per GPU


@dataclass(frozen=True)
class Job:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    tp: int
    pp: int
    dp: int
    global_batch_size: int
    micro_batch_size: int = 1
    ffn_hidden_size: int | None = None
    vpp: int = 1  #: model chunks per stage (interleaved)
    schedule: str = "1f1b"  #: 1f1b (interleaved when vpp > 1), zero-bubble, gpipe, dynamic
    memory_limit: int | None = None  #: dynamic: live (microbatch x chunk) activations per stage
    #: activation recomputation: True or "full" (whole layers), "selective"
    #: (core attention only), False or None (none)
    recompute: bool | str | None = True
    sequence_parallel: bool = False  #: element-wise work sharded over the tensor group
    act_bytes: int = 2  #: activations / TP and PP messages (bf16)
    grad_bytes: float = 2.0  #: bytes per gradient element on the data-parallel wire
    overlap_dp: bool = False  #: reduce gradients during the last backward passes
    optimizer_bytes: float = 36.0  #: Adam with fp32 master weights, moved per step
    cp: int = 1  #: context-parallel size (the sequence split over cp GPUs)
    cp_comm_type: str = "p2p"  #: p2p (ring attention) or a2a (Ulysses)
    num_query_groups: int | None = None  #: K/V heads (GQA; default: the attention heads)
    # ---- mixture of experts and attention variants (defaults: a dense GPT) ----
    num_experts: int | None = None  #: routed experts per MoE layer
    moe_topk: int = 2
    moe_ffn_hidden_size: int | None = None  #: per expert (default ffn_hidden_size)
    moe_shared_experts: int = 0  #: always-active experts of moe_ffn_hidden_size
    moe_dense_layers: int = 0  #: the first N layers keep a dense MLP (DeepSeek-V3: 3)
    ep: int = 1  #: expert-parallel size, carved out of dp (and tp / etp)
    etp: int | None = None  #: expert-tensor-parallel size (default tp; divides it)
    #: multi-token prediction depths (DeepSeek-V3: 1): each a layer (MoE when
    #: the model's last is), a 2h -> h projection and another pass of the
    #: shared output head, on the last pipeline stage
    mtp_layers: int = 0
    gated_mlp: bool = False  #: SwiGLU: three matrices per MLP instead of two
    attention_params: int | None = None  #: weights of one attention block (default 4 h^2)
    qk_head_dim: int | None = None  #: core attention head dims (default hidden / heads)
    v_head_dim: int | None = None
    fp8: bool = False  #: weight matmuls at twice the bf16 rate (core attention stays bf16)
    expert_imbalance: float = 1.0  #: the busiest GPU's routed expert rows over the mean
    a2a_bytes: float = 4.0  #: bytes per element of dispatch + combine (bf16 + bf16)
    #: copies of a token crossing the node boundary per MoE layer (None: top-k
    #: experts spread uniformly over the ep ranks)
    a2a_node_copies: float | None = None
    #: how much of a MoE layer's compute time can hide its all-to-all (0: none;
    #: 1: all of it, DeepSeek-V3's DualPipe claim)
    a2a_overlap: float = 0.0
    #: layers placed so that every stage costs the same, the output layer
    #: included (Megatron's --decoder-last-pipeline-num-layers; fractional)
    balance_stages: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.moe_dense_layers if self.num_experts else 0

    @property
    def per_token_terms(self) -> bool:
        """Whether the per-token layer terms replace the dense closed forms."""
        return bool(self.num_experts or self.gated_mlp or self.attention_params
                    or self.qk_head_dim or self.v_head_dim or self.mtp_layers)

    def layer_terms(self) -> dict:
        """Forward FLOPs per token of one layer's parts, and parameter counts."""
        h, a, s = self.hidden_size, self.num_attention_heads, self.seq_length
        mats = 3 if self.gated_mlp else 2
        attn_p = self.attention_params or 4 * h * h
        dqk = self.qk_head_dim or h // a
        dv = self.v_head_dim or h // a
        fm = self.moe_ffn_hidden_size or self.ffn
        expert_p = mats * h * fm
        return {"attn_w": 2 * attn_p, "core": 2 * s * a * (dqk + dv),
                "dense_mlp": 2 * mats * h * self.ffn,
                "moe_mlp": 2 * expert_p * (self.moe_topk + self.moe_shared_experts)
                + 2 * h * (self.num_experts or 0),
                "attn_params": attn_p, "dense_mlp_params": mats * h * self.ffn,
                "expert_params": expert_p, "shared_params": expert_p * self.moe_shared_experts,
                "router_params": h * (self.num_experts or 0)}

    def parameters(self) -> float:
        h, f, n, v = self.hidden_size, self.ffn, self.num_layers, self.vocab_size
        if not self.per_token_terms:
            return n * (4 * h * h + 2 * h * f + 9 * h + f) + v * h + self.seq_length * h
        return self.dense_parameters() + self.expert_parameters()

    @property
    def _mtp_moe(self) -> int:
        """MTP layers that are MoE layers (those of a model whose last layer is)."""
        return self.mtp_layers if self.moe_layers else 0

    def expert_parameters(self) -> float:
        """Routed experts' weights (sharded over ep, reduced over dp / ep)."""
        return ((self.moe_layers + self._mtp_moe) * (self.num_experts or 0)
                * self.layer_terms()["expert_params"])

    def dense_parameters(self) -> float:
        t, h, n = self.layer_terms(), self.hidden_size, self.num_layers + self.mtp_layers
        moe = self.moe_layers + self._mtp_moe
        per = (n * t["attn_params"] + (n - moe) * t["dense_mlp_params"]
               + moe * (t["shared_params"] + t["router_params"]))
        return per + self.vocab_size * h + self.seq_length * h + self.mtp_layers * 2 * h * h

    def mtp_parameters(self) -> float:
        """The MTP depths' own weights (embedding and output head shared)."""
        if not self.mtp_layers:
            return 0.0
        return self.parameters() - dataclasses.replace(self, mtp_layers=0).parameters()

    def forward_flops_per_token(self) -> float:
        t, n = self.layer_terms(), self.num_layers
        mlp = (n - self.moe_layers) * t["dense_mlp"] + self.moe_layers * t["moe_mlp"]
        head = 2 * self.vocab_size * self.hidden_size
        mtp = 0.0
        if self.mtp_layers:  # layer + projection + head, per depth
            mtp_mlp = t["moe_mlp"] if self._mtp_moe else t["dense_mlp"]
            mtp = self.mtp_layers * (t["attn_w"] + t["core"] + mtp_mlp
                                     + 4 * self.hidden_size ** 2 + head)
        return n * (t["attn_w"] + t["core"]) + mlp + head + mtp

    @property
    def recompute_granularity(self) -> str | None:
        if self.recompute is True or self.recompute == "full":
            return "full"
        if self.recompute == "selective":
            return "selective"
        if self.recompute in (False, None):
            return None
        raise ValueError(f"Job.recompute must be True/'full', 'selective' or False/None, "
                         f"got {self.recompute!r}")

    def model_flops(self) -> float:
        """Megatron's FLOPs per iteration as executed (Narayanan et al. 2021,
        eq. 3): with full recomputation 96 B s l h^2 (1 + s/6h + V/16lh);
        without, 72 B s l h^2 (1 + s/6h + V/12lh); selective adds the
        recomputed attention scores and values, 4 B s^2 h per layer."""
        b, s, n, h = self.global_batch_size, self.seq_length, self.num_layers, self.hidden_size
        gran = self.recompute_granularity
        if self.per_token_terms:
            extra = {"full": self.forward_flops_per_token(),
                     "selective": n * self.layer_terms()["core"]}.get(gran, 0.0)
            return self.useful_flops() + b * s * extra
        if gran == "full":
            return 96 * b * s * n * h * h * (1 + s / (6 * h) + self.vocab_size / (16 * n * h))
        extra = 4 * b * s * s * h * n if gran == "selective" else 0.0
        return self.useful_flops() + extra

    def useful_flops(self) -> float:
        """The model's FLOPs per iteration without any recomputation, 72 B s l
        h^2 (1 + s/6h + V/12lh): the numerator of model FLOPs utilization
        (Korthikanti et al. 2022's MFU; hardware FLOPs utilization uses
        :meth:`model_flops`)."""
        b, s, n, h = self.global_batch_size, self.seq_length, self.num_layers, self.hidden_size
        if self.per_token_terms:  # forward + backward (2x forward) of every token
            return 3 * b * s * self.forward_flops_per_token()
        return 72 * b * s * n * h * h * (1 + s / (6 * h) + self.vocab_size / (12 * n * h))


def _ring_all_reduce(nbytes, n, bw, lat):
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw


def stage_times(job: Job, hw: Hardware) -> dict:
    """Per microbatch, per virtual stage: forward, backward-input and
    backward-weight seconds (recomputation counted in backward-input), the
    point-to-point message time, and the output layer's extra time on the last
    stage."""
    b, seq, h, f, a, t = (job.micro_batch_size, job.seq_length, job.hidden_size, job.ffn,
                          job.num_attention_heads, job.tp)
    s = seq / job.cp  # this GPU's tokens of each sequence
    layers_per_chunk = job.num_layers / (job.pp * job.vpp)
    rate = hw.peak_flops * hw.gemm_efficiency
    weight_flops = 2 * b * s * (4 * h * h + 2 * h * f) / t
    attn_flops = 4 * b * s * seq * h / t
    a2a = 0.0
    if job.per_token_terms:  # per-token terms, averaged over the layers (MoE or dense)
        terms, n = job.layer_terms(), job.num_layers
        moe_frac = job.moe_layers / n
        routed = (terms["moe_mlp"] - 2 * terms["expert_params"] * job.moe_topk
                  * (1.0 - job.expert_imbalance))  # the busiest GPU sets the pace
        mlp = (1 - moe_frac) * terms["dense_mlp"] + moe_frac * routed
        weight_flops = b * s * (terms["attn_w"] + mlp) / t
        attn_flops = b * s * terms["core"] / t
        if job.num_experts:
            a2a = moe_frac * _moe_all_to_all(job, hw, b * s / t)
    matmul_rate = rate * (2.0 if job.fp8 else 1.0)
    # Element-wise bytes per layer (Korthikanti et al. 2022, 16-bit): the
    # LayerNorm/dropout/residual part is sharded over t with sequence
    # parallelism; 5 a s^2 b / t is core attention (softmax, dropout).
    scale = job.act_bytes / 2
    dense = s * b * h * (34 / t if job.sequence_parallel else 10 + 24 / t) * scale
    core = 5 * a * s * seq * b / t * scale
    mem = hw.memory_passes * (dense + core) / hw.hbm_bandwidth
    tp_ar = _ring_all_reduce(s * b * h * job.act_bytes, t, hw.intra_bus_bandwidth,
                             hw.intra_latency)
    cp_f, cp_b = _context_parallel_exposed(job, hw, b * s, attn_flops / rate)
    fwd_layer = weight_flops / matmul_rate + attn_flops / rate + mem + 2 * tp_ar + cp_f
    bi_layer = weight_flops / matmul_rate + 2 * attn_flops / rate + 2 * mem + 2 * tp_ar + cp_b
    w_layer = weight_flops / matmul_rate
    # The all-to-all of the MoE layers: what the layer's compute cannot hide.
    fwd_layer += max(0.0, a2a - job.a2a_overlap * fwd_layer)
    bi_layer += max(0.0, a2a - job.a2a_overlap * (bi_layer + w_layer))
    gran = job.recompute_granularity
    if gran == "full":
        bi_layer += fwd_layer
    elif gran == "selective":  # core attention again: its matmuls and element-wise passes
        bi_layer += attn_flops / rate + hw.memory_passes * core / hw.hbm_bandwidth
    head_f = 2 * b * s * h * job.vocab_size / t / rate
    msg = s * b * h * job.act_bytes / t
    # Megatron's rank order (tp fastest, then dp, then pp): consecutive stages are
    # tp * dp ranks apart, on different nodes once that fills a node.
    cross_node = t * job.cp * job.dp >= hw.gpus_per_node
    bw, lat = ((hw.inter_bandwidth, hw.inter_latency) if cross_node
               else (hw.intra_bus_bandwidth, hw.intra_latency))
    # MTP: per depth one more (average) layer and another pass of the head,
    # after the main model on the last stage
    mtp = job.mtp_layers
    return {"forward": layers_per_chunk * fwd_layer, "backward_input": layers_per_chunk * bi_layer,
            "backward_weight": layers_per_chunk * w_layer, "p2p": lat + msg / bw,
            "head": {"forward": (1 + mtp) * head_f + mtp * fwd_layer,
                     "backward_input": (1 + mtp) * head_f + mtp * bi_layer,
                     "backward_weight": (1 + mtp) * head_f + mtp * w_layer}}


def _context_parallel_exposed(job: Job, hw: Hardware, tokens: float, attn_s: float):
    """(forward, backward) seconds of one layer's context-parallel exchange
    that compute does not hide, for `tokens` tokens of this GPU whose core
    attention takes `attn_s` seconds forward. The cp ranks are tp apart
    (Megatron's order tp, cp, dp, pp): inside a node while tp x cp fits."""
    cp = job.cp
    if cp == 1:
        return 0.0, 0.0
    intra = job.tp * cp <= hw.gpus_per_node
    bw, lat = ((hw.intra_bus_bandwidth, hw.intra_latency) if intra
               else (hw.inter_bandwidth, hw.inter_latency))
    if job.cp_comm_type == "a2a":  # q, k, v in, the output back: nothing to overlap with
        kv = (job.num_query_groups or job.num_attention_heads) / job.num_attention_heads
        elems = tokens * job.hidden_size / job.tp * (2 + 2 * kv)
        one = (cp - 1) / cp * elems * job.act_bytes / bw + (cp - 1) * lat
        return one, one
    if job.cp_comm_type != "p2p":
        raise ValueError(f"Job.cp_comm_type must be 'p2p' or 'a2a', got {job.cp_comm_type!r}")
    head_dim = job.hidden_size / job.num_attention_heads
    kv_elems = 2 * tokens * (job.num_query_groups or job.num_attention_heads) * head_dim / job.tp
    step = lat + kv_elems * job.act_bytes / bw
    block = attn_s / cp  # the zigzag split gives every step the same work
    fwd = (cp - 1) * max(0.0, step - block)
    bwd = (cp - 1) * max(0.0, 2 * step - 2 * block)  # K, V and dK, dV; backward's 2x compute
    return fwd, bwd


def _moe_all_to_all(job: Job, hw: Hardware, tokens: float) -> float:
    """Seconds of one MoE layer's dispatch + combine for `tokens` tokens of
    this GPU: the copies that leave the node over the network, the rest over
    NVLink (both directions in parallel; the slower bounds)."""
    per_node = max(1, hw.gpus_per_node // (job.etp or job.tp))
    local_ep = min(job.ep, per_node)
    remote = (job.a2a_node_copies if job.a2a_node_copies is not None
              else job.moe_topk * (1.0 - local_ep / job.ep))
    local = job.moe_topk * (local_ep - 1) / job.ep
    elem = tokens * job.hidden_size * job.a2a_bytes
    inter = remote * elem / hw.inter_bandwidth + 2 * hw.inter_latency if remote else 0.0
    intra = local * elem / hw.intra_bus_bandwidth + 2 * hw.intra_latency if local else 0.0
    return max(inter, intra)


def _schedule(job: Job, fwd, bi, bw, p2p) -> Schedule:
    m = job.microbatches
    if job.schedule == "dynamic":  # the adaptive planner, given the modelled costs
        return Schedule.dynamic(job.pp, m, job.vpp, "adaptive", job.memory_limit,
                                costs=costs(job.pp, fwd, bi, bw, p2p))
    if job.schedule == "zb-v":  # planned for the modelled costs too (as the trainer may)
        return Schedule.zb_v(job.pp, m, costs(job.pp, fwd, bi, bw, p2p))
    return Schedule.by_name(job.schedule, job.pp, m, job.vpp)


def predict(job: Job, hw: Hardware) -> dict:
    """Iteration time and throughput of `job` on `hw` (see module docstring)."""
    if job.global_batch_size % (job.micro_batch_size * job.dp):
        raise ValueError(f"global batch {job.global_batch_size} is not divisible by micro-batch "
                         f"{job.micro_batch_size} x dp {job.dp}")
    st = stage_times(job, hw)
    p, v = job.pp, job.vpp
    # Per-stage costs; the output layer adds to the last stage (its last chunk
    # under interleaving is averaged over its chunks, as the executor's costs are).
    fwd = [st["forward"]] * p
    bi = [st["backward_input"]] * p
    bw = [st["backward_weight"]] * p
    # The output layer: on the last stage, or spread over all of them when the
    # layers are placed to balance it.
    share = [1.0 / p] * p if job.balance_stages else [0.0] * (p - 1) + [1.0]
    for i in range(p):
        fwd[i] += share[i] * st["head"]["forward"] / v
        bi[i] += share[i] * st["head"]["backward_input"] / v
        bw[i] += share[i] * st["head"]["backward_weight"] / v
    sched = _schedule(job, fwd, bi, bw, st["p2p"])
    sim = simulate(sched, fwd, bi, bw, st["p2p"])
    params_per_gpu = job.parameters() / (job.tp * job.pp)
    dpc = job.dp * job.cp  # gradients are reduced (and ZeRO-1 shards) over dp x cp
    dp_time = _ring_all_reduce(params_per_gpu * job.grad_bytes, dpc, hw.inter_bandwidth,
                               hw.inter_latency)
    opt_params = params_per_gpu / dpc
    if job.num_experts:  # experts: 1/ep of them per GPU, in etp shards, reduced over edp
        etp = job.etp or job.tp
        dense_pg = job.dense_parameters() / (job.tp * job.pp)
        expert_pg = job.expert_parameters() / (etp * job.pp * job.ep)
        edp = max(1, job.tp // etp * dpc // job.ep)
        params_per_gpu = dense_pg + expert_pg
        dp_time = (_ring_all_reduce(dense_pg * job.grad_bytes, dpc, hw.inter_bandwidth,
                                    hw.inter_latency)
                   + _ring_all_reduce(expert_pg * job.grad_bytes, edp, hw.inter_bandwidth,
                                      hw.inter_latency))
        opt_params = dense_pg / dpc + expert_pg / edp
    exposed_dp = dp_time
    if job.overlap_dp:  # buckets start during the last backward passes of each chunk
        window = v * (st["backward_input"] + st["backward_weight"])
        exposed_dp = max(0.0, dp_time - window)
    opt = opt_params * job.optimizer_bytes / hw.hbm_bandwidth
    total = sim.makespan + exposed_dp + opt
    flops = job.model_flops()
    per_gpu = flops / total / job.gpus
    useful = job.useful_flops() / total / job.gpus
    return {"model_flops_utilization": useful / hw.peak_flops,
            "hardware_flops_utilization": per_gpu / hw.peak_flops,
            "iteration_s": total, "pipeline_s": sim.makespan, "bubble_fraction": sim.bubble_fraction,
            "dp_s": dp_time, "dp_exposed_s": exposed_dp, "optimizer_s": opt,
            "tflops_per_gpu": per_gpu / 1e12, "aggregate_pflops": flops / total / 1e15,
            # hardware FLOPs over peak (with recomputation counted), as before
            "mfu": per_gpu / hw.peak_flops, "schedule": sched.name,
            # live activations at the peak, in layers' worth of one microbatch
            "peak_activation_layers": max(sim.peak_activations) * job.num_layers / (p * v),
            "peak_activation_chunks": max(sim.peak_activations)}


def memory_per_gpu(job: Job, hw: Hardware) -> dict:
    """Bytes one GPU of the first pipeline stage holds at its peak: bf16
    weights, fp32 main gradients, the distributed optimizer's fp32 master
    weights and Adam moments (over dp x cp), and the activations the schedule
    keeps in flight. Per layer and microbatch, with flash attention (no s^2
    scores) and ``s / cp`` tokens (Korthikanti et al. 2022): ``s b h (10 +
    24/t)`` bytes, ``34 s b h / t`` with sequence parallelism; full
    recomputation keeps only each layer's input (``2 s b h``, ``/t`` with
    sequence parallelism) plus one layer's activations while it runs
    backward."""
    s = job.seq_length / job.cp
    b, h, t = job.micro_batch_size, job.hidden_size, job.tp
    scale = job.act_bytes / 2
    layer = s * b * h * (34 / t if job.sequence_parallel else 10 + 24 / t) * scale
    if job.num_experts:
        etp = job.etp or t
        dense = job.dense_parameters() / (t * job.pp)
        experts = job.expert_parameters() / (etp * job.pp * job.ep)
        params = dense + experts
        master = dense / (job.dp * job.cp) + experts / max(1, t // etp * job.dp * job.cp // job.ep)
    else:
        params = job.parameters() / (t * job.pp)
        master = params / (job.dp * job.cp)
    states = params * (2 + 4) + master * 12
    in_flight = predict(job, hw)["peak_activation_layers"]
    if job.recompute_granularity == "full":
        kept = 2 * s * b * h * scale / (t if job.sequence_parallel else 1)
        activations = in_flight * kept + layer
    else:
        activations = in_flight * layer
    return {"states": states, "activations": activations, "total": states + activations,
            "fits": states + activations <= hw.memory_bytes}


def least_recompute(job: Job, hw: Hardware) -> Job:
    """`job` with no recomputation if it fits `hw`'s memory, else full."""
    none = dataclasses.replace(job, recompute=None)
    return none if memory_per_gpu(none, hw)["fits"] else dataclasses.replace(job, recompute="full")


def calibrate(job: Job, hw: Hardware, tflops_per_gpu: float) -> Hardware:
    """Returns `hw` with the matmul efficiency that makes `job` reach the
    measured per-GPU throughput (bisection; throughput rises with efficiency)."""
    lo, hi = 0.05, 1.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        got = predict(job, dataclasses.replace(hw, gemm_efficiency=mid))["tflops_per_gpu"]
        lo, hi = (mid, hi) if got < tflops_per_gpu else (lo, mid)
    eff = 0.5 * (lo + hi)
    if not 0.06 < eff < 0.99:
        raise ValueError(f"cannot reach {tflops_per_gpu} TFLOP/s per GPU on {hw.name} with any "
                         f"matmul efficiency (got {eff:.3f}); check the job and hardware")
    return dataclasses.replace(hw, gemm_efficiency=eff)


# Hardware descriptions (vendor datasheets; NCCL bus bandwidth as typically
# measured by nccl-tests on DGX systems). See docs/performance.md for sources.
A100_SELENE = Hardware(
    name="DGX A100 (Selene): A100-SXM4-80GB, NVLink3, 8x HDR 200 Gb/s per node",
    peak_flops=312e12, hbm_bandwidth=2.039e12, gpus_per_node=8,
    intra_bus_bandwidth=230e9, intra_latency=8e-6,
    inter_bandwidth=25e9, inter_latency=10e-6)
H100_EOS = Hardware(
    name="DGX H100: H100-SXM5-80GB, NVLink4, 8x NDR 400 Gb/s per node",
    peak_flops=989e12, hbm_bandwidth=3.35e12, gpus_per_node=8,
    intra_bus_bandwidth=450e9, intra_latency=6e-6,
    inter_bandwidth=50e9, inter_latency=8e-6)

#: H800-SXM (DeepSeek-V3's cluster): H100 silicon with NVLink cut to 400 GB/s;
#: 8 x 400 Gb/s InfiniBand per node (DeepSeek-V3 technical report, section 3.1).
H800_DEEPSEEK = Hardware(
    name="H800-SXM5-80GB, NVLink 400 GB/s, 8x 400 Gb/s IB per node",
    peak_flops=989e12, hbm_bandwidth=3.35e12, gpus_per_node=8,
    intra_bus_bandwidth=160e9, intra_latency=6e-6,
    inter_bandwidth=50e9, inter_latency=8e-6)

# Published runs (configuration, measured throughput).
GPT3_175B_1024 = Job(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                     vocab_size=51200, tp=8, pp=16, dp=8, global_batch_size=1536)
GPT_1T_3072 = Job(num_layers=128, hidden_size=25600, num_attention_heads=160, seq_length=2048,
                  vocab_size=51200, tp=8, pp=64, dp=6, global_batch_size=3072)
#: MT-NLG 530B on 2,240 A100 (Korthikanti et al. 2022, Table 5): 54.2% model
#: FLOPs utilization with selective recomputation and sequence parallelism,
#: 42.1% with full recomputation.
MT_NLG_530B_2240 = Job(num_layers=105, hidden_size=20480, num_attention_heads=128,
                       seq_length=2048, vocab_size=51200, tp=8, pp=35, dp=8,
                       global_batch_size=2240, recompute="selective", sequence_parallel=True)


#: DeepSeek-V3 pre-training (technical report, arXiv 2412.19437): 61 layers,
#: hidden 7168, MLA (128 heads, q/k head dim 192, v 128, q rank 1536, kv rank
#: 512), first 3 layers dense (SwiGLU 18432), then 1 shared + 256 routed
#: SwiGLU experts of 2048, top-8, vocabulary 129,280, sequence 4096, global
#: batch 15,360 (after the ramp), 2,048 H800 as PP16 x EP64 x ZeRO-1 DP128,
#: no TP, FP8 GEMMs, FP8 dispatch / BF16 combine, each token sent to at most
#: 4 nodes (once per node), DualPipe hiding the all-to-all. Published cost:
#: 180K H800 GPU-hours per trillion tokens, 2.664M for 14.8T tokens
#: (2.788M with context extension and post-training).
_MLA_PARAMS = (7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * (128 + 128)
               + 128 * 128 * 7168)
DEEPSEEK_V3_2048 = Job(num_layers=61, hidden_size=7168, num_attention_heads=128, seq_length=4096,
                       vocab_size=129280, tp=1, pp=16, dp=128, global_batch_size=15360,
                       micro_batch_size=1, ffn_hidden_size=18432, schedule="zero-bubble",
                       recompute=None, overlap_dp=True, num_experts=256, moe_topk=8,
                       moe_ffn_hidden_size=2048, moe_shared_experts=1, moe_dense_layers=3,
                       ep=64, gated_mlp=True, attention_params=_MLA_PARAMS, qk_head_dim=192,
                       v_head_dim=128, fp8=True, a2a_bytes=1.0 + 2.0, mtp_layers=1,
                       a2a_node_copies=4 * 7 / 8, a2a_overlap=1.0, balance_stages=True)


#: Llama 3 405B pre-training (Llama 3 paper, arXiv 2407.21783, section 3.3 and
#: Table 4): 126 layers, hidden 16384, 128 heads with 8 key/value groups
#: (head dim 128), SwiGLU 53248, vocabulary 128,256, sequence 8192, BF16;
#: batch 16M tokens (2,048 sequences); 8,192 H100 as TP8 x PP16 x DP64 with
#: the interleaved schedule (published 430 TFLOP/s per GPU, 43% MFU), and
#: 16,384 as DP128 (400 TFLOP/s). Assumed where the paper is silent: one
#: layer per virtual stage (vpp 8, the first and last stages one layer short,
#: ``balance_stages``), no activation recomputation, sequence parallelism,
#: gradients overlapped with backward.
_LLAMA3_405B_ATTN = 16384 * (16384 + 2 * 8 * 128) + 16384 * 16384
LLAMA3_405B_8192 = Job(num_layers=126, hidden_size=16384, num_attention_heads=128,
                       seq_length=8192, vocab_size=128256, tp=8, pp=16, dp=64,
                       global_batch_size=2048, micro_batch_size=1, ffn_hidden_size=53248,
                       gated_mlp=True, num_query_groups=8, attention_params=_LLAMA3_405B_ATTN,
                       vpp=8, recompute=None, sequence_parallel=True, overlap_dp=True,
                       balance_stages=True)


#: GPT-3 175B at a long sequence (Megatron-Core's context-parallel guide
#: compares TP+CP layouts of it with TP8CP1 under full recomputation at 16K
#: and 32K, published 1.25x for TP8CP2 at 16K and 1.20x for TP8CP4 at 32K):
#: 512 GPUs as TP8 x PP8 x DP8, sequence parallelism, 16 microbatches per
#: pipeline. Use ``dataclasses.replace(job, seq_length=...)``.
GPT3_175B_LONG_512 = Job(num_layers=96, hidden_size=12288, num_attention_heads=96,
                         seq_length=16384, vocab_size=51200, tp=8, pp=8, dp=8,
                         global_batch_size=128, sequence_parallel=True, overlap_dp=True)


def context_parallel(job: Job, cp: int, hw: Hardware, comm: str = "p2p") -> Job:
    """`job` with each sequence split over `cp` of its data-parallel ranks:
    the same GPUs and microbatches per pipeline (the global batch shrinks by
    cp), and the least recomputation that fits `hw`."""
    if job.dp % cp:
        raise ValueError(f"cp {cp} does not divide the job's data-parallel size {job.dp}")
    return least_recompute(dataclasses.replace(job, cp=job.cp * cp, dp=job.dp // cp,
                                               global_batch_size=job.global_batch_size // cp,
                                               cp_comm_type=comm), hw)


def tokens_per_s(job: Job, hw: Hardware) -> float:
    return job.global_batch_size * job.seq_length / predict(job, hw)["iteration_s"]


def gpu_hours_per_trillion_tokens(job: Job, hw: Hardware) -> float:
    return 1e12 / tokens_per_s(job, hw) * job.gpus / 3600


def job_from_flags(argv: list, world_size: int, **fields) -> Job:
    """The Job that ``pretrain_gpt.py`` with the flags `argv` runs on
    `world_size` GPUs: the architecture (the block, MLA's ranks and head dims,
    the experts and dense-first layers, SwiGLU, GQA), the parallel layout, the
    batch, the schedule and the recomputation come from the flags, parsed and
    checked by the trainer's own parser; `fields` set what the flags do not
    say (the vocabulary, FP8, the all-to-all's overlap, stage balancing...).
    Multi-token prediction is not modelled (its one extra layer per step)."""
    from ..models.gpt import moe_layer_pattern
    from ..pretrain import build_parser
    from ..training import Config

    cfg = Config.from_args(build_parser().parse_args(list(argv)))
    m, par, o, moe = cfg.model, cfg.parallel, cfg.optim, cfg.moe
    tp, pp, cp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                  par.context_parallel_size)
    if world_size % (tp * pp * cp):
        raise ValueError(f"{world_size} GPUs is not a multiple of tp x pp x cp = {tp * pp * cp}")
    h, a = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        qd, pe, vd, r = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank
        rq = m.q_lora_rank
        q = h * a * (qd + pe) if rq is None else h * rq + rq * a * (qd + pe)
        attn = dict(attention_params=q + h * (r + pe) + r * a * (qd + vd) + a * vd * h,
                    qk_head_dim=qd + pe, v_head_dim=vd)
    else:
        d = m.kv_channels or h // a
        g = m.num_query_groups if m.group_query_attention else a
        attn = dict(attention_params=h * (a + 2 * g) * d + a * d * h, qk_head_dim=d, v_head_dim=d,
                    num_query_groups=g)
    experts = {}
    if moe.num_experts:
        freq = moe_layer_pattern(moe.layer_freq(), m.num_layers)
        dense = freq.index(1) if 1 in freq else m.num_layers
        if freq != [0] * dense + [1] * (m.num_layers - dense):
            raise ValueError(f"--moe-layer-freq {freq}: the scale model takes dense layers first, "
                             "then MoE layers")
        f = moe.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * h
        experts = dict(num_experts=moe.num_experts, moe_topk=moe.moe_router_topk,
                       moe_ffn_hidden_size=f, moe_dense_layers=dense,
                       moe_shared_experts=(moe.moe_shared_expert_intermediate_size or 0) // f,
                       ep=moe.expert_model_parallel_size,
                       etp=moe.expert_tensor_parallel_size)
    v = par.virtual_pipeline_model_parallel_size or (2 if par.pipeline_schedule == "zb-v" else 1)
    job = dict(num_layers=m.num_layers, hidden_size=h, num_attention_heads=a,
               seq_length=m.seq_length, vocab_size=fields.pop("vocab_size", 50304), tp=tp,
               pp=pp, dp=world_size // (tp * pp * cp), cp=cp,
               global_batch_size=o.global_batch_size, micro_batch_size=o.micro_batch_size,
               ffn_hidden_size=m.ffn_hidden_size, vpp=v, schedule=par.pipeline_schedule,
               recompute=cfg.recompute.granularity(), sequence_parallel=par.sequence_parallel,
               gated_mlp=m.swiglu, cp_comm_type=par.cp_comm_type,
               mtp_layers=m.mtp_num_layers or 0, **attn, **experts)
    job.update(fields)
    return Job(**job)


def gpus_for(job: Job, gpus: int) -> Job:
    """`job` strong-scaled to `gpus` by data parallelism (same tp, pp, global batch)."""
    d = gpus // (job.tp * job.pp)
    if d < 1 or d * job.tp * job.pp != gpus:
        raise ValueError(f"{gpus} GPUs is not a multiple of tp x pp = {job.tp * job.pp}")
    return dataclasses.replace(job, dp=d)
