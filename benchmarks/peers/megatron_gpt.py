"""Megatron-Core as its users run it, on CPU with Gloo: its own ``GPTModel``
with the local layer spec (``get_gpt_layer_local_spec``: Megatron-Core's own
ColumnParallel/RowParallel linears, its unfused DotProductAttention and
LayerNorm), its ``parallel_state`` grid and its pipeline schedules
(``get_forward_backward_func``: 1F1B without interleaving, or interleaved with
--num-layers-per-virtual-pipeline-stage).

Upstream has no CPU path; these redirections make it run unmodified
otherwise, and cost nothing measurable:

* ``torch.cuda.current_device()`` (buffers of the pipeline's P2P and the
  tensor-parallel gathers) -> the CPU device;
* ``torch.zeros(..., device="cuda")`` in the schedules (a token counter) -> CPU;
* the CUDA RNG tracker -> one whose ``fork()`` does nothing (all dropouts are 0,
  as in every stack of the benchmark, so no random numbers are drawn);
* ``batch_p2p_sync=False`` (no ``torch.cuda.synchronize``).

Megatron-Core's DDP (``param_and_grad_buffer`` uses CUDA streams), its fused
optimizers and its DistributedOptimizer do not run on CPU. So the gradients
are reduced over the data-parallel group after the schedule, by one coalesced
all-reduce of all gradients of a chunk (what its DDP does without overlap),
then clipped by the global norm (Megatron's: tensor-parallel duplicates counted
once, summed over the model-parallel group) and stepped by ``torch.optim.AdamW``
(the same update as its Adam with decoupled weight decay). RESULTS.md says so.

Weights are megatronapp's single-process GPT for the seed, sliced for each
tensor rank: the first loss equals ours and the other stacks' to float32
rounding. Flags mirror pretrain_gpt.py.
"""

from __future__ import annotations

import argparse
import contextlib
import types

import torch.distributed as dist
import torch.nn.functional as F

import common
import torch


def redirect_cuda_to_cpu() -> None:
    """The four redirections of the module docstring."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")

    class _CpuZerosTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*size, device=None, **kw):
            return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kw)

    schedules.torch = _CpuZerosTorch("torch")

    class _NoDropoutRngTracker(mrandom.CudaRNGStatesTracker):
        @contextlib.contextmanager
        def fork(self, name=None):
            yield

    mrandom._CUDA_RNG_STATE_TRACKER = _NoDropoutRngTracker()  # noqa: SLF001
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True  # noqa: SLF001


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Megatron-Core GPT training (peer benchmark)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved 1F1B with num_layers / (pp x this) chunks per rank")
    return common.add_workload_flags(p)


# Megatron-Core's parameter names (local spec) -> the reference's (TorchGPT's).
_LAYER_NAMES = {
    "input_layernorm": "ln1", "pre_mlp_layernorm": "ln2",
    "self_attention.linear_qkv": "attn.qkv", "self_attention.linear_proj": "attn.proj",
    "mlp.linear_fc1": "mlp.fc1", "mlp.linear_fc2": "mlp.fc2",
}
_TOP_NAMES = {
    "embedding.word_embeddings": "word_embeddings",
    "embedding.position_embeddings": "position_embeddings",
    "decoder.final_layernorm": "final_layernorm", "output_layer": "output_layer",
}


def _reference_name(chunk, name: str) -> str:
    if name.startswith("decoder.layers."):
        _, _, local, rest = name.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        layer = chunk.decoder.layers[int(local)].layer_number - 1  # global, 0-based
        return f"layers.{layer}.{_LAYER_NAMES[module]}.{leaf}"
    module, leaf = name.rsplit(".", 1)
    return f"{_TOP_NAMES[module]}.{leaf}"


def load_reference(chunk, weights: dict, tp_rank: int, tp: int, gated: bool = False) -> None:
    """Copies the full weights into this chunk, sliced along the one dimension
    where Megatron's tensor-parallel shard is smaller than the full tensor
    (a gated fc1, [gate; up], is sliced in each half: Megatron's rank holds
    [gate_r; up_r], as ours does)."""
    with torch.no_grad():
        for name, p in chunk.named_parameters():
            full = weights[_reference_name(chunk, name)]
            if gated and "mlp.linear_fc1" in name and tp > 1:
                halves = full.chunk(2, dim=0)
                n = halves[0].shape[0] // tp
                p.copy_(torch.cat([hf[tp_rank * n:(tp_rank + 1) * n] for hf in halves]))
                continue
            if full.shape != p.shape:
                dims = [d for d in range(full.dim()) if full.shape[d] != p.shape[d]]
                if len(dims) != 1 or full.shape[dims[0]] != p.shape[dims[0]] * tp:
                    raise SystemExit(f"{name}: shard {tuple(p.shape)} of {tuple(full.shape)} "
                                     f"is not a 1/{tp} slice along one dimension")
                full = full.narrow(dims[0], tp_rank * p.shape[dims[0]], p.shape[dims[0]])
            p.copy_(full)


def train(args, callbacks=None) -> dict:
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    redirect_cuda_to_cpu()
    world = dist.get_world_size()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world % (tp * pp):
        raise SystemExit(f"world size {world} is not divisible by tp {tp} x pp {pp}")
    vp = None
    if args.num_layers_per_virtual_pipeline_stage:
        per = args.num_layers_per_virtual_pipeline_stage
        if args.num_layers % (pp * per):
            raise SystemExit(f"--num-layers {args.num_layers} is not divisible by pp {pp} x "
                             f"--num-layers-per-virtual-pipeline-stage {per}")
        vp = args.num_layers // (pp * per)
    mps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vp)
    try:
        return _train(args, callbacks, tp, pp, vp, GPTModel, get_gpt_layer_local_spec,
                      get_forward_backward_func, TransformerConfig, mps)
    finally:
        mps.destroy_model_parallel()


def all_reduce_data_parallel(chunks, dp: int, group) -> None:
    """Gradients averaged over the data-parallel group: one coalesced
    all-reduce per model chunk (Megatron's DDP without overlap; its own needs
    CUDA streams)."""
    for c in chunks:
        gs = [p.grad for p in c.parameters()]
        flat = torch._utils._flatten_dense_tensors(gs)  # noqa: SLF001
        dist.all_reduce(flat, group=group)
        flat.div_(dp)
        for g, f in zip(gs, torch._utils._unflatten_dense_tensors(flat, gs),  # noqa: SLF001
                        strict=True):
            g.copy_(f)


def global_grad_sq(named, tp_rank: int) -> torch.Tensor:
    """This rank's share of the squared gradient norm (float64): tensor-parallel
    duplicates counted on tensor rank 0 only."""
    sq = torch.zeros(1, dtype=torch.float64)
    for _, p in named:
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            sq += p.grad.double().square().sum()
    return sq


def _train(args, callbacks, tp, pp, vp, GPTModel, local_spec, get_fb, TransformerConfig, mps):
    work = common.Workload(args, tp)
    cfg = work.cfg
    tp_rank = mps.get_tensor_model_parallel_rank()
    dp, dp_rank = mps.get_data_parallel_world_size(), mps.get_data_parallel_rank()
    config = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=cfg.layernorm_epsilon,
        init_method_std=cfg.init_method_std,
        # the block: GPT-2's by default, Llama's with the flags (as pretrain_gpt's)
        normalization=cfg.normalization, gated_linear_unit=cfg.swiglu,
        add_bias_linear=cfg.add_bias_linear, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        activation_func=F.silu if cfg.swiglu else (lambda x: F.gelu(x, approximate="tanh")),
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, batch_p2p_sync=False,
        # Megatron-LM's defaults: interleaved overlaps its P2P with compute
        # (--overlap-p2p-communication) and then posts the ops one by one
        # (batch_p2p_comm = not overlap), in an order that pairs a stage's
        # sends and receives even when its previous and next rank coincide
        # (pp = 2); 1F1B batches them.
        overlap_p2p_comm=vp is not None, batch_p2p_comm=vp is None)
    spec = local_spec(normalization=cfg.normalization)
    chunks = []
    for v in range(vp or 1):
        stage = v if vp else None
        chunk = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                         max_sequence_length=cfg.seq_length,
                         pre_process=mps.is_pipeline_first_stage(ignore_virtual=False,
                                                                 vp_stage=stage),
                         post_process=mps.is_pipeline_last_stage(ignore_virtual=False,
                                                                 vp_stage=stage),
                         share_embeddings_and_output_weights=False,
                         position_embedding_type=cfg.position_embedding_type,
                         rotary_base=int(cfg.rotary_base), vp_stage=stage)
        load_reference(chunk, work.weights, tp_rank, tp, gated=cfg.swiglu)
        chunks.append(chunk)
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    opt = common.adamw(common.decay_groups(named, args.weight_decay), args)
    m = args.global_batch_size // (args.micro_batch_size * dp)
    forward_backward = get_fb()
    positions = torch.arange(args.seq_length).unsqueeze(0)
    # pretrain_gpt's left-to-right mask (True = masked), [1, 1, s, s].
    causal = torch.triu(torch.ones(args.seq_length, args.seq_length, dtype=torch.bool),
                        diagonal=1)[None, None]
    last = mps.is_pipeline_last_stage(ignore_virtual=True)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        out = model(tokens, positions.expand_as(tokens), causal, labels=labels)  # [b, s]

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides loss in place
        return out, loss_func

    def run(split, it, forward_only):
        micro = work.microbatches(split, it, dp_rank, dp)
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(micro) for _ in chunks] if vp else iter(micro),
            model=chunks if vp else chunks[0], num_microbatches=m,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            forward_only=forward_only)
        value = sum(float(x["lm loss"]) for x in losses) / m if last else 0.0
        # Mean over data-parallel ranks, known to everyone (Megatron averages
        # the reported loss over the data-parallel group).
        return common.share_loss(value / dp, last and tp_rank == 0)

    dp_group = mps.get_data_parallel_group()
    model_group = mps.get_model_parallel_group()

    def step(it, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=False)
        for c in chunks:
            c.zero_grad(set_to_none=False)
        loss = run("train", it, False)
        if dp > 1:
            all_reduce_data_parallel(chunks, dp, dp_group)
        norm = common.clip_by_global_norm(global_grad_sq(named, tp_rank),
                                          [p.grad for _, p in named], args.clip_grad,
                                          group=model_group)
        opt.step()
        return loss, norm

    def evaluate(i):
        for c in chunks:
            c.eval()
        with torch.no_grad():
            value = run("valid", i, True)
        for c in chunks:
            c.train()
        return value

    for c in chunks:
        c.train()
    history = common.train_loop(args, step, evaluate, callbacks)
    return {"history": history, "parameters": cfg.num_parameters(), "tp": tp, "pp": pp,
            "dp": dp, "vp": vp}
