"""The PyTorch-native baseline of the end-to-end benchmark.

The same GPT as ``megatronapp.models.GPTModel`` (pre-LayerNorm, fused QKV with
Megatron's [head, (q, k, v), head_dim] row order, tanh GELU, learned positions,
untied output layer), written as a plain ``nn.Module`` and parallelized the way
a PyTorch user would (torchtitan's recipe):

* tensor parallelism: DTensor ``parallelize_module`` — ColwiseParallel on QKV
  and fc1, RowwiseParallel on the attention projection and fc2, RowwiseParallel
  (vocabulary-sharded) word embeddings, ColwiseParallel output layer with
  replicated logits;
* data parallelism: ``torch.nn.parallel.DistributedDataParallel`` over the
  data-parallel group (DTensor parameters localized first with torch's
  ``_pre_dp_module_transform``), optionally with the PowerSGD hook; or FSDP2
  (``fully_shard`` on every block and the root, torchtitan's recipe), over
  all ranks;
* pipeline parallelism: ``torch.distributed.pipelining`` (PipelineStage +
  ScheduleGPipe / Schedule1F1B / ScheduleInterleavedZeroBubble).

The weights are loaded from megatronapp's single-process model for the same
seed, the data order and learning-rate schedule are pretrain's, so both stacks
train the same function on the same batches. Flags mirror pretrain_gpt.py.
"""

from __future__ import annotations

import argparse
import contextlib

import torch.distributed as dist
import torch.nn.functional as F

import common
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.head_dim = h // heads
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)

    def forward(self, x):  # [s, b, h]; under TP qkv holds whole local heads
        qkv = self.qkv(x)
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, -1, 3, self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(dim=3))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, -1))


class MLP(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, h, heads, f, eps):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.attn, self.mlp = Attention(h, heads), MLP(h, f)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TorchGPT(nn.Module):
    """Whole model, or one pipeline stage of it (embeddings only on the first
    stage, the final LayerNorm and output layer only on the last). Parameter
    names equal GPTModel's (layers are keyed by their global index)."""

    def __init__(self, cfg, layers: list[int] | None = None, pre: bool = True, post: bool = True):
        super().__init__()
        h = cfg.hidden_size
        self.pre, self.post = pre, post
        if pre:
            self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
            self.position_embeddings = nn.Embedding(cfg.seq_length, h)
        ids = list(range(cfg.num_layers)) if layers is None else layers
        self.layers = nn.ModuleDict({str(i): Block(h, cfg.num_attention_heads,
                                                   cfg.ffn_hidden_size, cfg.layernorm_epsilon)
                                     for i in ids})
        if post:
            self.final_layernorm = nn.LayerNorm(h, eps=cfg.layernorm_epsilon)
            self.output_layer = nn.Linear(h, cfg.vocab_size, bias=False)

    def forward(self, x):
        if self.pre:  # token ids [b, s] -> [s, b, h]
            pos = torch.arange(x.shape[1])
            x = (self.word_embeddings(x) + self.position_embeddings(pos)).transpose(0, 1).contiguous()
        for layer in self.layers.values():
            x = layer(x)
        if not self.post:
            return x
        return self.output_layer(self.final_layernorm(x)).transpose(0, 1)  # [b, s, V]


def parallelize_tp(model: TorchGPT, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    if model.pre:
        plan["word_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Replicate())
    for i in model.layers:
        plan.update({f"layers.{i}.attn.qkv": ColwiseParallel(),
                     f"layers.{i}.attn.proj": RowwiseParallel(),
                     f"layers.{i}.mlp.fc1": ColwiseParallel(),
                     f"layers.{i}.mlp.fc2": RowwiseParallel()})
    if model.post:
        plan["output_layer"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, tp_mesh, plan)


def _sharded_dims(p) -> tuple:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return ()
    return tuple(name for name, pl in zip(p.device_mesh.mesh_dim_names, p.placements,
                                          strict=True) if pl.is_shard())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="PyTorch-native GPT training (peer benchmark)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-schedule", choices=["gpipe", "1f1b", "zero-bubble"],
                   default="1f1b")
    p.add_argument("--data-parallel", choices=["ddp", "fsdp2"], default="ddp",
                   help="torch DDP, or FSDP2 (fully_shard: parameters, gradients and "
                        "optimizer state sharded over the data-parallel group)")
    p.add_argument("--ddp-comm-hook", choices=["none", "powersgd"], default="none")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start-iter", type=int, default=2)
    p.add_argument("--bucket-size-mb", type=float, default=25.0)
    return common.add_workload_flags(p)


def train(args, callbacks=None) -> dict:
    """Trains on an initialized default process group; returns per-rank results
    (history of losses and timings) like pretrain.train's summary."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world % (tp * pp):
        raise SystemExit(f"world size {world} is not divisible by tp {tp} x pp {pp}")
    dp = world // (tp * pp)
    if pp > 1 and dp > 1:
        raise SystemExit("the baseline combines pipelining with TP only (dp must be 1)")
    fsdp = args.data_parallel == "fsdp2"
    if fsdp and (pp > 1 or tp > 1 or args.ddp_comm_hook != "none"):
        raise SystemExit("--data-parallel fsdp2 runs alone here (no tp, pp or comm hook): its "
                         "2-D mesh with DTensor TP gave a different gradient norm")
    outer = "pp" if pp > 1 else "dp"
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=(outer, "tp"))
    tp_mesh, outer_group = mesh["tp"], mesh.get_group(outer)
    tp_rank, outer_rank = mesh.get_local_rank("tp"), mesh.get_local_rank(outer)

    work = common.Workload(args, tp)
    cfg = work.cfg
    if pp > 1:
        if cfg.num_layers % pp:
            raise SystemExit(f"--num-layers {cfg.num_layers} not divisible by pp {pp}")
        per = cfg.num_layers // pp
        ids = list(range(outer_rank * per, (outer_rank + 1) * per))
        model = TorchGPT(cfg, ids, pre=outer_rank == 0, post=outer_rank == pp - 1)
    else:
        model = TorchGPT(cfg)
    model.load_state_dict({k: v for k, v in work.weights.items() if k in model.state_dict()})
    if tp > 1:
        parallelize_tp(model, tp_mesh)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["dp"]
        for layer in model.layers.values():
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    # The mesh dimensions each parameter is sharded on (its squared norm is
    # summed over them; replicated dimensions hold copies), by name: DDP's
    # bridge below swaps DTensor parameters for local ones.
    sharded_on = {n: _sharded_dims(p) for n, p in model.named_parameters()}
    wrapped = model
    if not fsdp and pp == 1 and dp > 1:
        if tp > 1:  # torch's own bridge between DTensor TP and DDP
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

            _pre_dp_module_transform(model)  # same names, local tensors
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=outer_group,
                                                      bucket_cap_mb=args.bucket_size_mb)
        if args.ddp_comm_hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            state = psgd.PowerSGDState(process_group=outer_group,
                                       matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=args.powersgd_start_iter,
                                       use_error_feedback=True, warm_start=True)
            wrapped.register_comm_hook(state, psgd.powerSGD_hook)
    named = list(model.named_parameters())
    opt = common.adamw(common.decay_groups(named, args.weight_decay), args)

    m = args.global_batch_size // (args.micro_batch_size * dp)
    sched = None
    if pp > 1:
        from torch.distributed import pipelining

        stage = pipelining.PipelineStage(model, outer_rank, pp, torch.device("cpu"),
                                         group=outer_group)
        cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
               "zero-bubble": pipelining.ScheduleInterleavedZeroBubble}[args.pipeline_schedule]
        sched = cls([stage] if args.pipeline_schedule == "zero-bubble" else stage, m,
                    loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1).float(),
                                                              y.flatten()))

    def local_value(p):
        return p.to_local() if isinstance(p, DTensor) else p

    plan = {}
    for n, p in named:
        plan.setdefault(sharded_on[n], []).append(p)

    def clip(max_norm: float) -> float:
        """Global norm: each parameter's squares summed over the mesh dimensions
        it is sharded on, copies counted once, all stages summed."""
        total = torch.zeros(1, dtype=torch.float64)
        for dims, params in plan.items():
            sq = torch.zeros(1, dtype=torch.float64)
            for p in params:
                if p.grad is not None:
                    sq += local_value(p.grad).double().square().sum()
            for d in dims:
                dist.all_reduce(sq, group=mesh.get_group(d))
            total += sq
        grads = [local_value(p.grad) for _, p in named if p.grad is not None]
        return common.clip_by_global_norm(total, grads, max_norm,
                                          group=outer_group if pp > 1 else None)

    def batch_loss(split, it, backward):
        if pp > 1:
            tokens, labels = work.batch(split, it)
            kw = {}
            first, last = outer_rank == 0, outer_rank == pp - 1
            if last:
                kw["target"], kw["losses"] = labels, []
            if backward:
                sched.step(tokens, **kw) if first else sched.step(**kw)
            else:
                with torch.no_grad():
                    out = sched.eval(tokens, **kw) if first else sched.eval(**kw)
                    del out
            value = sum(float(x) for x in kw["losses"]) / m if last else 0.0
            return common.share_loss(value, last and tp_rank == 0)
        total = torch.zeros(1, dtype=torch.float64)
        micro = work.microbatches(split, it, outer_rank, dp)
        for i, (x, y) in enumerate(micro):
            ctx = wrapped.no_sync() if backward and dp > 1 and not fsdp and i < len(micro) - 1 \
                else (torch.no_grad() if not backward else contextlib.nullcontext())
            if fsdp and backward and dp > 1:  # reduce-scatter at the last micro-batch only
                model.set_requires_gradient_sync(i == len(micro) - 1)
            with ctx:
                logits = wrapped(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / len(micro)
                if backward:
                    loss.backward()
            total += loss.detach().double()
        if dp > 1:
            dist.all_reduce(total, group=outer_group)
        return float(total) / dp

    def step(it, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = batch_loss("train", it, True)
        norm = clip(args.clip_grad)
        opt.step()
        return loss, norm

    def evaluate(i):
        wrapped.eval()
        value = batch_loss("valid", i, False)
        wrapped.train()
        return value

    history = common.train_loop(args, step, evaluate, callbacks)
    return {"history": history, "parameters": cfg.num_parameters(), "tp": tp, "pp": pp,
            "dp": dp}
