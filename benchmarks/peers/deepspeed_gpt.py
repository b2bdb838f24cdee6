"""DeepSpeed as its users run it, on CPU (``DS_ACCELERATOR=cpu``, Gloo):

* ZeRO stage 1 or 2 over all ranks (data parallel), with the settings of
  DeepSpeed's ZeRO tutorial (contiguous gradients, overlapped and bucketed
  reduction, 5e8-element buckets, reduce-scatter for stage 2);
* ``PipelineModule`` (its 1F1B ``TrainSchedule``) over --pipeline-model-
  parallel-size stages times data parallelism, layers partitioned by type so
  that every stage holds the same number of transformer blocks (ZeRO stage 1
  across the data-parallel replicas, as Megatron-DeepSpeed runs it).

The optimizer is DeepSpeed's AdamW with ``torch_adam`` (its fused CPU Adam is
a JIT-built C++ op; the update is the same), gradient clipping by DeepSpeed
(``gradient_clipping``), the learning rate set per step from the shared
schedule. The model is ``torch_native.TorchGPT`` (the same function as ours,
layer by layer) with megatronapp's weights for the seed, so the first loss
equals ours. DeepSpeed has no tensor parallelism for training GPT layers
written as plain modules (its AutoTP targets Hugging Face models), so there
is none here: the grid is DP or PP x DP. Flags mirror pretrain_gpt.py.
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist
import torch.nn.functional as F

import common
import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="DeepSpeed GPT training (peer benchmark)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--bucket-size", type=float, default=5e8,
                   help="ZeRO reduce/allgather bucket size in elements (DeepSpeed's default)")
    return common.add_workload_flags(p)


class _Embed(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.word_embeddings, self.position_embeddings = (model.word_embeddings,
                                                         model.position_embeddings)

    def forward(self, tokens):  # [b, s] -> [s, b, h]
        pos = torch.arange(tokens.shape[1])
        return (self.word_embeddings(tokens) + self.position_embeddings(pos)).transpose(
            0, 1).contiguous()


class _Head(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.final_layernorm, self.output_layer = model.final_layernorm, model.output_layer

    def forward(self, x):  # [s, b, h] -> [b, s, V]
        return self.output_layer(self.final_layernorm(x)).transpose(0, 1)


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _config(args, dp: int) -> dict:
    zero = {"stage": args.zero_stage, "contiguous_gradients": True, "overlap_comm": True,
            "reduce_bucket_size": args.bucket_size, "allgather_bucket_size": args.bucket_size}
    if args.zero_stage == 2:
        zero["reduce_scatter"] = True
    gas = args.global_batch_size // (args.micro_batch_size * dp)
    return {"train_micro_batch_size_per_gpu": args.micro_batch_size,
            "gradient_accumulation_steps": gas,
            "train_batch_size": args.global_batch_size,
            "gradient_clipping": args.clip_grad,
            "optimizer": {"type": "AdamW", "params": {
                "lr": args.lr, "betas": list(common.ADAM_BETAS), "eps": 1e-8,
                "weight_decay": args.weight_decay, "torch_adam": True}},
            "zero_optimization": zero,
            "steps_per_print": 10**9, "wall_clock_breakdown": False,
            # DeepSpeed's mixed precision: bf16 model, fp32 master copy in its optimizer
            **({"bf16": {"enabled": True}} if args.bf16 else {})}


def train(args, callbacks=None) -> dict:
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from torch_native import TorchGPT

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    pp = args.pipeline_model_parallel_size
    if world % pp:
        raise SystemExit(f"world size {world} is not divisible by pp {pp}")
    dp = world // pp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not divisible by "
                         f"micro-batch {args.micro_batch_size} x dp {dp}")
    work = common.Workload(args, 1)
    full = TorchGPT(work.cfg)
    full.load_state_dict(work.weights)
    if args.bf16:  # (DeepSpeed's engine casts the model itself too)
        full = full.to(torch.bfloat16)
    m = args.global_batch_size // (args.micro_batch_size * dp)
    if pp > 1:
        from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

        layers = [_Embed(full), *full.layers.values(), _Head(full)]
        net = PipelineModule(layers=layers, loss_fn=_loss,
                             topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
                             partition_method="type:Block", activation_checkpoint_interval=0)
    else:
        net = full
    groups = common.decay_groups(net.named_parameters(), args.weight_decay)
    config = _config(args, dp)
    if args.optimizer_impl == "fused":  # DeepSpeed's torch_adam passes no fused=: a client one
        config.pop("optimizer")
        engine, _, _, _ = deepspeed.initialize(model=net, optimizer=common.adamw(groups, args),
                                               config=config)
    else:
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=groups, config=config)
    if pp > 1:
        dp_rank = engine.grid.get_data_parallel_rank()
    else:
        dp_rank = dist.get_rank()

    def step(it, lr):
        for g in engine.optimizer.param_groups:
            g["lr"] = lr
        micro = work.microbatches("train", it, dp_rank, dp)
        if pp > 1:  # DeepSpeed averages over micro-batches and data-parallel ranks
            loss = float(engine.train_batch(iter(micro)))
        else:
            total = torch.zeros(1, dtype=torch.float64)
            for x, y in micro:
                loss = engine(x)
                loss = _loss(loss, y)
                engine.backward(loss)
                engine.step()  # applies the update at the accumulation boundary only
                total += loss.detach().double() / m
            dist.all_reduce(total)
            loss = float(total) / dp
        return loss, float(engine.get_global_grad_norm() or 0.0)

    def evaluate(i):
        micro = work.microbatches("valid", i, dp_rank, dp)
        if pp > 1:
            return float(engine.eval_batch(iter(micro)))
        engine.eval()
        with torch.no_grad():
            total = torch.zeros(1, dtype=torch.float64)
            for x, y in micro:
                total += _loss(engine(x), y).double() / m
        engine.train()
        dist.all_reduce(total)
        return float(total) / dp

    engine.train()
    history = common.train_loop(args, step, evaluate, callbacks)
    return {"history": history, "parameters": work.cfg.num_parameters(), "pp": pp, "dp": dp,
            "zero_stage": args.zero_stage}
