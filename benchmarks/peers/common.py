"""What every peer trainer shares, so that the stacks differ only in how they
parallelize: the workload flags (Megatron-LM's names), the data (megatronapp's
``TextDataset``: the same batches, in the same order, on every stack), the
model's shape and its initial weights (megatronapp's single-process
``GPTModel`` for the seed), the learning-rate schedule (``lr_at``: linear
warm-up, cosine decay) and the loop's record of every iteration.

A trainer provides ``step(iteration, lr) -> (loss, grad_norm)`` and
``evaluate(batch_index) -> loss``; ``train_loop`` times the steps and returns
the history that ``run.py`` reads (the same records as ``pretrain.train``).
"""

from __future__ import annotations

import argparse
import math
import time

import torch.distributed as dist

import torch

# The workload's defaults (those of the benchmark, benchmarks/peers/run.py MODEL).
_INT_FLAGS = (("num-layers", 4), ("hidden-size", 128), ("num-attention-heads", 4),
              ("seq-length", 128), ("micro-batch-size", 4), ("global-batch-size", 16),
              ("train-iters", 100), ("eval-iters", 4), ("eval-interval", 0),
              ("lr-warmup-iters", 10), ("seed", 1234), ("make-vocab-size-divisible-by", 128))
_FLOAT_FLAGS = (("lr", 3e-3), ("min-lr", 3e-4), ("weight-decay", 0.01), ("clip-grad", 1.0))
ADAM_BETAS = (0.9, 0.95)  # pretrain's (Megatron-LM's GPT recipe)


def add_workload_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    # The optimizer's implementation: torch.optim.AdamW's default loop, or its
    # fused kernel (fused=True), which every stack can use (ours: FusedAdamW).
    p.add_argument("--optimizer-impl", default="torch", choices=("torch", "fused"))
    for name, default in _INT_FLAGS:
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in _FLOAT_FLAGS:
        p.add_argument(f"--{name}", type=float, default=default)
    p.add_argument("--data-path", default=None)
    # bf16 mixed precision (bf16 weights and activations, fp32 master weights and
    # optimizer state): each stack's own implementation (ours: pretrain's --bf16)
    p.add_argument("--bf16", action="store_true")
    # The block (Megatron-LM's flags; defaults: the GPT-2 block)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    p.add_argument("--norm-epsilon", type=float, default=1e-5)
    p.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=("learned_absolute", "rope"))
    p.add_argument("--rotary-base", type=int, default=10000)
    p.add_argument("--group-query-attention", action="store_true")
    p.add_argument("--num-query-groups", type=int, default=1)
    p.add_argument("--disable-bias-linear", action="store_true")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true", required=True,
                   help="required: the peers' pipelines have no tied embeddings across stages")
    return p


def reference_weights(cfg, seed: int) -> dict:
    """megatronapp's GPTModel for this seed, built in this process at TP=1 (no
    communication): the full, unsharded initial weights of every stack, keyed
    like ``torch_native.TorchGPT`` (``layers.{i}.attn.qkv.weight``, ...)."""
    from megatronapp import RankGrid
    from megatronapp.models import GPTModel
    from megatronapp.parallel_state import ParallelState

    state = ParallelState(grid=RankGrid(1), rank=0, tensor_group=None, data_group=None,
                          pipeline_group=None, model_group=None, embedding_group=None)
    return dict(GPTModel(cfg, parallel_state=state, seed=seed).state_dict())


class Workload:
    """The data set, the model's shape (vocabulary padded for ``tp``) and its
    initial weights."""

    def __init__(self, args, tp: int):
        from megatronapp.data import TextDataset, default_corpus, padded_vocab_size
        from megatronapp.models import GPTConfig

        self.args = args
        self.dataset = TextDataset(args.data_path or default_corpus(), args.seq_length)
        self.cfg = GPTConfig(
            vocab_size=padded_vocab_size(self.dataset.tokenizer.vocab_size, tp,
                                         args.make_vocab_size_divisible_by),
            hidden_size=args.hidden_size, num_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
            share_embeddings_and_output_weights=False, ffn_hidden_size=args.ffn_hidden_size,
            swiglu=args.swiglu, normalization=args.normalization,
            layernorm_epsilon=args.norm_epsilon,
            position_embedding_type=args.position_embedding_type,
            rotary_base=float(args.rotary_base),
            num_query_groups=args.num_query_groups if args.group_query_attention else None,
            add_bias_linear=not args.disable_bias_linear)
        self.weights = reference_weights(self.cfg, args.seed)

    def batch(self, split: str, iteration: int):
        """(tokens, labels) of the whole global batch, [global_batch, seq]."""
        return self.dataset.global_batch(split, iteration, self.args.global_batch_size,
                                         self.args.seed)

    def microbatches(self, split: str, iteration: int, dp_rank: int, dp: int):
        tokens, labels = self.batch(split, iteration)
        return self.dataset.microbatches(tokens, labels, self.args.micro_batch_size,
                                         dp_rank, dp)


def decay_groups(named_parameters, weight_decay: float) -> list:
    """AdamW groups as pretrain builds them: matrices decay, vectors do not."""
    named = list(named_parameters)
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def clip_by_global_norm(grads_sq_local: torch.Tensor, grads, max_norm: float, group=None) -> float:
    """Scales ``grads`` by max_norm / norm when the global norm exceeds it;
    ``grads_sq_local`` is this rank's share of the squared norm (float64, one
    element), summed over ``group`` (None: no other rank holds a share)."""
    if group is not None:
        dist.all_reduce(grads_sq_local, group=group)
    norm = math.sqrt(float(grads_sq_local))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def share_loss(value: float, holds_it: bool) -> float:
    """The loss that one set of ranks computed (the last pipeline stage, one
    tensor rank), made known to every rank: a sum over the world where the
    other ranks contribute 0."""
    t = torch.tensor([value if holds_it else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def train_loop(args, step, evaluate, callbacks=None) -> list:
    """Runs ``args.train_iters`` steps; evaluates every ``args.eval_interval``
    (and after the last step) on ``args.eval_iters`` validation batches.
    Records per iteration: loss, grad_norm, seconds (the step alone),
    train_seconds (cumulative, evaluation excluded), valid_loss when evaluated."""
    from megatronapp.training import lr_at

    history, train_seconds = [], 0.0
    for it in range(args.train_iters):
        if callbacks:
            callbacks.begin(it)
        t0 = time.perf_counter()
        loss, norm = step(it, lr_at(args, it))
        dt = time.perf_counter() - t0
        train_seconds += dt
        rec = {"iteration": it + 1, "loss": loss, "grad_norm": norm, "seconds": dt,
               "train_seconds": train_seconds}
        if callbacks:
            callbacks.end(it, rec)
        if args.eval_interval and ((it + 1) % args.eval_interval == 0
                                   or it + 1 == args.train_iters):
            rec["valid_loss"] = sum(evaluate(i) for i in range(args.eval_iters)) / args.eval_iters
        history.append(rec)
    return history


def adamw(groups, args):
    """The peers' AdamW as --optimizer-impl asks (fused: torch's fused kernel)."""
    return torch.optim.AdamW(groups, lr=args.lr, betas=ADAM_BETAS,
                             fused=True if args.optimizer_impl == "fused" else None)
