"""Megatron-style GPT pretraining on the bundled corpus (examples/pretrain_gpt.py).

Launch with torchrun; every flag has a small CPU-friendly default:

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --train-iters 200

Each iteration draws one global batch (identical on every rank for a given
seed), splits it into this data-parallel rank's microbatches, accumulates
gradients, finalizes them over the tensor and data groups, clips and steps.
Rank 0 shows a progress bar (loss, tokens/s), prints a summary, and writes the
loss curve as CSV and PNG into --output-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import time
from datetime import timedelta

import torch.distributed as dist

import torch

from . import checkpoint, faults, memory, watchdog
from . import parallel_state as ps
from . import trace as tracing
from .comm import Compression
from .data import TextDataset, default_corpus, padded_vocab_size
from .data_parallel import DistributedDataParallel
from .models import GPTConfig, GPTModel
from .optimizer import DistributedOptimizer
from .pipeline import SCHEDULES, AdaptiveSchedule, Schedule, forward_backward
from .pipeline.layout import layer_layout, parse_layout
from .tensor_parallel import vocab_parallel_cross_entropy
from .training import clip_grad_norm_, finalize_model_grads


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline stage (interleaved / dynamic schedules)")
    g.add_argument("--pipeline-schedule", choices=list(SCHEDULES), default="1f1b",
                   help="1f1b becomes interleaved 1F1B with a virtual pipeline size")
    g.add_argument("--pipeline-dynamic-policy", choices=["dfc", "bfc", "auto", "adaptive"],
                   default="adaptive", help="planner policy of --pipeline-schedule dynamic")
    g.add_argument("--pipeline-memory-limit", type=int, default=None, metavar="N",
                   help="dynamic schedule: live activations per stage (microbatch x chunk)")
    g.add_argument("--pipeline-replan-interval", type=int, default=20,
                   help="dynamic adaptive schedule: re-plan from measured times every N iters")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--pipeline-layer-layout", default=None, metavar="N,N,...",
                   help="layers per virtual stage (chunk-major: chunk 0 of every stage first)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["auto", "gloo", "nccl"], default="auto")
    g = p.add_argument_group("data parallelism")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1: shard optimizer state over data-parallel ranks")
    g.add_argument("--grad-compression", default="none", metavar="SPEC",
                   help="none, bf16, fp16, int8[:block], onebit[:block], topk:<ratio>, "
                        "powersgd:<rank>")
    g.add_argument("--grad-compression-start-iter", type=int, default=0,
                   help="run uncompressed for the first N iterations")
    g.add_argument("--bucket-size-mb", type=float, default=25.0)
    g.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="reduce gradients at the end of backward instead of during it")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=4, help="validation batches per evaluation")
    g.add_argument("--eval-interval", type=int, default=0, metavar="N",
                   help="also evaluate every N iterations (0: only at the end); the loss curve "
                        "records validation loss and training-only wall time at each")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("data and output")
    g.add_argument("--data-path", default=None, help="text file (default: bundled KJV excerpt)")
    g.add_argument("--output-dir", default="runs/gpt", help="loss curve CSV/PNG and summary")
    g.add_argument("--no-progress", action="store_true", help="plain log lines instead of a bar")
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, metavar="DIR", help="save checkpoints here")
    g.add_argument("--save-interval", type=int, default=None, metavar="N",
                   help="save every N iterations (and at the end)")
    g.add_argument("--async-save", action="store_true",
                   help="copy the state to host memory and write the checkpoint in the background")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="resume from DIR/latest (any tp/pp/dp layout)")
    g.add_argument("--watchdog-timeout", type=float, default=30.0, metavar="S",
                   help="declare a rank dead after S seconds without heartbeat; exit non-zero")
    g.add_argument("--no-watchdog", action="store_true")
    g = p.add_argument_group("tracing")
    g.add_argument("--trace", action="store_true",
                   help="record a Chrome trace per rank (python -m megatronapp.trace aggregate)")
    g.add_argument("--trace-dir", default="runs/trace")
    g.add_argument("--trace-interval", type=int, default=1, metavar="N",
                   help="trace --trace-iterations of every N iterations")
    g.add_argument("--trace-iterations", type=int, default=None, metavar="K")
    g.add_argument("--trace-granularity", choices=["full", "coarse"], default="full")
    g.add_argument("--trace-detect-interval", type=int, default=0, metavar="N",
                   help="online slow-rank detection every N traced iterations (0: off)")
    g = p.add_argument_group("memory")
    g.add_argument("--memory-pool", action="store_true",
                   help="serve tensor memory from megatronapp's caching pool; prints its summary")
    g.add_argument("--memory-pool-policy", choices=["ours", "torch-like"], default="ours")
    g.add_argument("--record-alloc-trace", default=None, metavar="FILE",
                   help="record the CPU pool's allocation trace ('{rank}' in FILE is replaced; "
                        "otherwise .rankN is appended when there are several ranks)")
    return p


def _lr_at(args, it: int) -> float:
    if it < args.lr_warmup_iters:
        return args.lr * (it + 1) / args.lr_warmup_iters
    span = max(1, args.train_iters - args.lr_warmup_iters)
    frac = min(1.0, (it - args.lr_warmup_iters) / span)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * frac))


def _init_distributed(args) -> None:
    if dist.is_initialized():
        return
    backend = args.distributed_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=300))


def _validate(args, world: int) -> list[int]:
    """Checks the configuration before any collective; returns the layers per
    virtual pipeline stage."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    v = args.virtual_pipeline_model_parallel_size or 1
    if world % (tp * pp) != 0:
        raise SystemExit(f"world size {world} is not divisible by --tensor-model-parallel-size "
                         f"{tp} x --pipeline-model-parallel-size {pp}")
    if v > 1 and pp == 1:
        raise SystemExit("--virtual-pipeline-model-parallel-size needs "
                         "--pipeline-model-parallel-size > 1")
    dp = world // (tp * pp)
    if args.global_batch_size % (args.micro_batch_size * dp) != 0:
        raise SystemExit(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    try:
        layout = layer_layout(
            args.num_layers, pp, v, first=args.decoder_first_pipeline_num_layers,
            last=args.decoder_last_pipeline_num_layers,
            layout=parse_layout(args.pipeline_layer_layout) if args.pipeline_layer_layout else None)
        if pp > 1:  # the schedule itself checks m against p (e.g. interleaved)
            _schedule(args, args.global_batch_size // (args.micro_batch_size * dp))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return layout


def _schedule(args, m: int):
    pp, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size or 1
    if args.pipeline_schedule == "dynamic":
        if args.pipeline_dynamic_policy == "adaptive":
            return AdaptiveSchedule(pp, m, v, args.pipeline_memory_limit,
                                    interval=args.pipeline_replan_interval)
        return Schedule.dynamic(pp, m, v, args.pipeline_dynamic_policy, args.pipeline_memory_limit)
    return Schedule.by_name(args.pipeline_schedule, pp, m, v)


_FLAG_CHECKS = [0]


def _check_flags_agree(args, rank: int, world: int) -> None:
    """Every rank must run with the same flags: compared through the
    rendezvous store, before any collective, with one message naming the
    differing flags and ranks."""
    if world == 1:
        return
    from torch.distributed import distributed_c10d as c10d

    _FLAG_CHECKS[0] += 1  # several train() calls may share one process group
    store = dist.PrefixStore(f"mapp_flags/{_FLAG_CHECKS[0]}/", c10d._get_default_store())
    mine = json.dumps(vars(args), sort_keys=True, default=str)
    store.set(str(rank), mine)
    everyone = [json.loads(store.get(str(r))) for r in range(world)]
    diffs = []
    for key in sorted(everyone[0]):
        values = {}
        for r, a in enumerate(everyone):
            values.setdefault(json.dumps(a.get(key)), []).append(r)
        if len(values) > 1:
            flag = "--" + key.replace("_", "-")
            diffs.append(f"{flag}: " + ", ".join(f"{v} on ranks {rs}" for v, rs in values.items()))
    if diffs:
        raise SystemExit("the ranks were started with different flags; every rank must get the "
                         "same command line: " + "; ".join(diffs))


def _memory_device(args) -> str:
    backend = args.distributed_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return "cuda" if backend == "nccl" else "cpu"


def train(args, callbacks=None) -> dict:
    """Runs the whole job; returns the summary (also written as summary.json).

    ``callbacks`` (optional, every rank): an object with ``begin(iteration)``
    and ``end(iteration, record)``, called around each training iteration
    (outside evaluation) — benchmarks use it to sample counters per step."""
    if args.record_alloc_trace and not args.memory_pool:
        raise SystemExit("--record-alloc-trace needs --memory-pool")
    mem_device = _memory_device(args)
    if args.memory_pool:  # before anything allocates (CUDA cannot swap later)
        memory.use_pool(mem_device, policy=args.memory_pool_policy)
    _init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    _check_flags_agree(args, rank, world)
    if args.record_alloc_trace:
        if mem_device != "cpu":
            raise SystemExit("--record-alloc-trace records the CPU pool; run on CPU (gloo)")
        memory.start_recording()
    layout = _validate(args, world)
    state = ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size)
    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(args.seed)  # same on every rank: the master weights agree

    dataset = TextDataset(args.data_path or default_corpus(), args.seq_length)
    cfg = GPTConfig(
        vocab_size=padded_vocab_size(dataset.tokenizer.vocab_size, state.tp_size,
                                     args.make_vocab_size_divisible_by),
        hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
        ffn_hidden_size=args.ffn_hidden_size, sequence_parallel=args.sequence_parallel,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    pp, v = state.pp_size, args.virtual_pipeline_model_parallel_size or 1
    offsets = [sum(layout[:k]) for k in range(len(layout))]
    gpts = []
    for c in range(v):  # this rank's model chunks: virtual stages c * pp + stage
        vs = c * pp + state.pp_rank
        gpts.append(GPTModel(cfg, parallel_state=state, pre_process=vs == 0,
                             post_process=vs == pp * v - 1,
                             layer_numbers=list(range(offsets[vs], offsets[vs] + layout[vs])),
                             seed=args.seed).to(device))
    if args.trace:
        c = state.grid.coord(rank)
        tracing.start(args.trace_dir, rank, interval=args.trace_interval,
                      iterations=args.trace_iterations, granularity=args.trace_granularity,
                      metadata={"tp": c.tp, "pp": c.pp, "dp": c.dp, "tp_size": state.tp_size,
                                "pp_size": state.pp_size, "dp_size": state.dp_size,
                                "world": world}, device=device.type)
    faults.apply_slowdown([m for g in gpts for m in g.layers], rank)
    compression = None
    if args.grad_compression != "none":
        compression = Compression(args.grad_compression, args.grad_compression_start_iter)
    chunks = [DistributedDataParallel(
        g, process_group=state.data_group, bucket_size_mb=args.bucket_size_mb,
        compression=compression, overlap_grad_reduce=not args.no_overlap_grad_reduce)
        for g in gpts]
    model = chunks[0]
    all_params = [p for g in gpts for p in g.parameters()]
    decay = [p for p in all_params if p.dim() >= 2]
    no_decay = [p for p in all_params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if args.use_distributed_optimizer:
        opt = DistributedOptimizer(chunks, torch.optim.AdamW, groups, parallel_state=state,
                                   lr=args.lr, betas=(0.9, 0.95))
    else:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    m = args.global_batch_size // (args.micro_batch_size * state.dp_size)
    sched = _schedule(args, m) if pp > 1 else None
    seq_shard = args.seq_length // state.tp_size if cfg.sequence_parallel else args.seq_length
    if cfg.sequence_parallel and args.seq_length % state.tp_size:
        raise SystemExit(f"--seq-length {args.seq_length} must be divisible by the tensor-parallel "
                         f"size {state.tp_size} with --sequence-parallel")

    def pipeline_loss(logits, labels):  # logits [b, s, V/tp] on the last stage
        return vocab_parallel_cross_entropy(
            logits.transpose(0, 1), labels.to(device).transpose(0, 1), group=state.tensor_group
        ).mean()

    def batch_loss(split: str, it: int, backward: bool) -> float:
        with tracing.scope("data", "data", lane=0):
            tokens, labels = dataset.global_batch(split, it, args.global_batch_size, args.seed)
            micro = dataset.microbatches(tokens, labels, args.micro_batch_size,
                                         state.dp_rank, state.dp_size)
        total = torch.zeros(1, dtype=torch.float64)
        if pp > 1:
            schedule = sched.schedule if isinstance(sched, AdaptiveSchedule) else sched
            data = iter([(x.to(device), y) for x, y in micro])
            res = forward_backward(schedule, chunks, data, pipeline_loss,
                                   tensor_shape=(seq_shard, args.micro_batch_size,
                                                 args.hidden_size),
                                   parallel_state=state, forward_only=not backward)
            if backward and isinstance(sched, AdaptiveSchedule):
                sched.observe(res)
            for loss in res.losses:  # last stage only
                total += loss.double().cpu() / len(micro)
            if state.tp_rank != 0:
                total.zero_()  # every tensor rank holds the same loss: count it once
            torch.distributed.all_reduce(total, group=state.model_group)
            torch.distributed.all_reduce(total, group=state.data_group)
            return float(total) / state.dp_size
        for i, (x, y) in enumerate(micro):
            # Accumulate locally; only the last microbatch's backward syncs.
            sync = not backward or i == len(micro) - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                with tracing.scope("forward", "compute", lane=0, mb=i):
                    loss = model(x.to(device), y.to(device)).mean() / len(micro)
                if backward:
                    with tracing.scope("backward", "compute", lane=0, mb=i):
                        loss.backward()
            total += loss.detach().double().cpu()
        torch.distributed.all_reduce(total, group=state.data_group)  # SUM; divide below
        return float(total) / state.dp_size

    def evaluate(per_batch: bool = False):
        for c in chunks:
            c.eval()
        with torch.no_grad():
            valid = [batch_loss("valid", i, backward=False) for i in range(args.eval_iters)]
        for c in chunks:
            c.train()
        return valid if per_batch else sum(valid) / max(1, len(valid))

    is_logger = rank == 0
    bar = None
    if is_logger and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.train_iters, desc="train", unit="it", dynamic_ncols=True)
    if is_logger:
        print(f"[megatronapp] {state.describe()}; model {cfg.num_parameters() / 1e6:.2f}M "
              f"parameters, vocab {cfg.vocab_size}, "
              f"{args.global_batch_size * args.seq_length} tokens per iteration", flush=True)

    history = []
    tokens_per_iter = args.global_batch_size * args.seq_length
    start = time.perf_counter()
    model_config = {k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "seq_length",
        "ffn_hidden_size", "share_embeddings_and_output_weights")}
    start_iter = 0
    if args.load:
        try:
            info = checkpoint.load(args.load, chunks, opt, config=model_config,
                                   parallel_state=state)
        except checkpoint.CheckpointError as e:
            raise SystemExit(f"--load {args.load}: {e}") from None
        if info is None:
            if is_logger:
                print(f"[megatronapp] no checkpoint in {args.load}; starting from scratch",
                      flush=True)
        else:
            start_iter = info["iteration"]
            if is_logger:
                print(f"[megatronapp] resumed from {info['path']} at iteration {start_iter}"
                      + ("" if info["same_layout"] else " (resharded)"), flush=True)

    dog = None
    if world > 1 and not args.no_watchdog:
        dog = watchdog.Watchdog(timeout=args.watchdog_timeout).start()
    preempted = {"flag": False}

    def on_sigterm(signum, frame):  # preemption: save at the end of this iteration
        preempted["flag"] = True

    import signal

    try:
        previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: no preemption handling
        previous_sigterm = None

    def save_checkpoint(iteration: int) -> None:
        watchdog.set_phase(f"saving checkpoint at iteration {iteration}")
        checkpoint.save(args.save, iteration, chunks, opt, config=model_config,
                        extra={"consumed_samples": iteration * args.global_batch_size,
                               "seed": args.seed}, parallel_state=state,
                        async_save=args.async_save)

    detector = None
    if args.trace and args.trace_detect_interval > 0:
        from .trace.online import OnlineDetector

        detector = OnlineDetector(args.trace_dir, args.trace_detect_interval, world)
    stopped_at = None
    train_seconds = 0.0  # training only: excludes evaluation and checkpointing
    for it in range(start_iter, args.train_iters):
        faults.maybe_kill(rank, it)
        watchdog.set_phase(f"iteration {it + 1}")
        if callbacks is not None:
            callbacks.begin(it)
        t0 = time.perf_counter()
        traced = tracing.begin_iteration(it)
        with tracing.scope("iteration", "iteration", lane=0):
            for group in opt.param_groups:
                group["lr"] = _lr_at(args, it)
            opt.zero_grad(set_to_none=True)
            loss = batch_loss("train", it, backward=True)
            with tracing.scope("optimizer", "optimizer", lane=0):
                finalize_model_grads(chunks, state)
                if args.use_distributed_optimizer:
                    grad_norm = opt.clip_grad_norm_(args.clip_grad)
                else:
                    grad_norm = clip_grad_norm_(all_params, args.clip_grad, state)
                opt.step()
        if detector is not None and traced:
            detector.after_traced_iteration(it)
        dt = time.perf_counter() - t0
        train_seconds += dt
        record = {"iteration": it + 1, "loss": loss, "lr": _lr_at(args, it),
                  "grad_norm": grad_norm, "seconds": dt, "tokens_per_s": tokens_per_iter / dt,
                  "train_seconds": train_seconds}
        if callbacks is not None:
            callbacks.end(it, record)
        if args.eval_interval and (it + 1) % args.eval_interval == 0 and it + 1 < args.train_iters:
            watchdog.set_phase(f"evaluation after iteration {it + 1}")
            record["valid_loss"] = evaluate()
        if args.save and args.save_interval and (it + 1) % args.save_interval == 0:
            save_checkpoint(it + 1)
        if world > 1:  # did any rank get SIGTERM? (one tiny all-reduce per iteration)
            flag = torch.tensor([1.0 if preempted["flag"] else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            preempted["flag"] = bool(flag.item())
        if preempted["flag"]:
            stopped_at = it + 1
            if args.save and not (args.save_interval and (it + 1) % args.save_interval == 0):
                save_checkpoint(it + 1)
            if is_logger:
                print(f"[megatronapp] SIGTERM: stopped after iteration {it + 1}"
                      + (f", checkpoint in {args.save}" if args.save else ""), flush=True)
            break
        history.append(record)
        if is_logger:
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_iter / dt:,.0f}")
                bar.update(1)
            elif (it + 1) % args.log_interval == 0 or it == 0:
                print(f"iteration {it + 1:6d}/{args.train_iters} | loss {loss:.4f} | "
                      f"lr {_lr_at(args, it):.2e} | grad norm {grad_norm:.3f} | "
                      f"{tokens_per_iter / dt:,.0f} tokens/s", flush=True)
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    if args.save and stopped_at is None and not (
            args.save_interval and args.train_iters % args.save_interval == 0):
        save_checkpoint(args.train_iters)
    checkpoint.wait_pending()  # an asynchronous save must be durable before we go on
    if previous_sigterm is not None:
        signal.signal(signal.SIGTERM, previous_sigterm)
    watchdog.set_phase("validation")

    if args.trace:
        stats = tracing.stats()
        tracing.stop()
        summary_trace = {"path": stats.get("path"), "events": stats.get("recorded"),
                         "dropped": stats.get("dropped")}
    valid = evaluate(per_batch=True)
    if history and args.eval_interval:
        history[-1]["valid_loss"] = sum(valid) / len(valid) if valid else None
    if args.record_alloc_trace:
        path = args.record_alloc_trace
        path = path.replace("{rank}", str(rank)) if "{rank}" in path else (
            f"{path}.rank{rank}" if world > 1 else path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        n = memory.stop_recording(path)
        if is_logger:
            print(f"[megatronapp] allocation trace: {n} events -> {path}", flush=True)
    summary = {
        "world_size": world, "tp": state.tp_size, "dp": state.dp_size, "pp": state.pp_size,
        "vpp": v, "layer_layout": layout,
        "parameters": cfg.num_parameters(), "iterations": args.train_iters,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "valid_loss": sum(valid) / len(valid) if valid else None,
        "wall_seconds": wall,
        "train_seconds": train_seconds,  # wall minus evaluation and checkpoint saves
        "tokens_per_s": tokens_per_iter * len(history) / train_seconds if train_seconds > 0 else 0.0,
        "losses": [h["loss"] for h in history],
        "history": history,
    }
    if args.memory_pool:
        summary["memory"] = memory.stats(mem_device)
    if args.trace:
        summary["trace"] = summary_trace
        if detector is not None:
            summary["trace"]["detections"] = detector.reports
    summary["comm"] = {k: sum(c.comm_stats()["step"][k] for c in chunks)
                       for k in ("raw_bytes", "sent_bytes")}
    if pp > 1:
        summary["pipeline_schedule"] = (sched.schedule if isinstance(sched, AdaptiveSchedule)
                                        else sched).name
    if is_logger:
        _write_outputs(args.output_dir, history, summary)
        if history:
            print(f"[megatronapp] done: {len(history)} iterations in {wall:.1f}s, loss "
                  f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f} (validation "
                  f"{summary['valid_loss']:.3f}), {summary['tokens_per_s']:,.0f} tokens/s; "
                  f"loss curve in {args.output_dir}/loss.csv and loss.png", flush=True)
        else:
            print(f"[megatronapp] nothing to train: already at iteration {args.train_iters} "
                  f"(validation {summary['valid_loss']:.3f})", flush=True)
        comm = summary["comm"]
        if state.dp_size > 1 and comm["raw_bytes"]:
            print(f"[megatronapp] data-parallel traffic per step: "
                  f"{comm['sent_bytes'] / 1e6:.2f} MB sent ({args.grad_compression}; "
                  f"{100 * comm['sent_bytes'] / comm['raw_bytes']:.0f}% of uncompressed)",
                  flush=True)
        if args.memory_pool:
            print(memory.summary(mem_device), end="", flush=True)
    if stopped_at is not None:
        summary["preempted_at"] = stopped_at
    if dog is not None:
        dog.stop()
    ps.destroy_model_parallel()
    return summary


def _write_outputs(out_dir: str, history: list, summary: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "loss.csv"), "w", newline="") as f:
        fields = list(dict.fromkeys(k for h in history for k in h)) or ["iteration"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(history)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({k: v for k, v in summary.items() if k not in ("losses", "history")}, f,
                  indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["iteration"] for h in history], [h["loss"] for h in history], label="train")
    evals = [h for h in history if h.get("valid_loss") is not None]
    if len(evals) > 1:
        ax.plot([h["iteration"] for h in evals], [h["valid_loss"] for h in evals], "o-",
                label="validation")
    elif summary.get("valid_loss") is not None:
        ax.axhline(summary["valid_loss"], color="tab:orange", ls="--", label="validation (end)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"GPT {summary['parameters'] / 1e6:.2f}M, tp={summary['tp']} "
                 f"pp={summary['pp']} dp={summary['dp']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        train(args)
    except Exception:
        if watchdog.Watchdog.current is not None:  # a dead peer? name it, then exit 1
            watchdog.Watchdog.current.explain_failure()
        raise
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
