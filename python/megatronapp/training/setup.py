"""Building a run, one explicit function per piece.

    config = Config.from_args(args)
    install_memory_pool(config)                 # --memory-pool: before anything allocates
    init_distributed(config)
    plan = check_config(config)                 # every rank, before any collective
    state = build_parallel_state(config, install=True)
    gpt = gpt_config(config, state, tokenizer_vocab_size)
    chunks = build_model_chunks(config, plan, state, gpt, device)
    chunks = wrap_data_parallel(config, chunks, state)
    optimizer = build_optimizer(config, chunks, state)

:func:`build_run` does all of it but the pool and returns a :class:`Run`, the
one object the step, the loop and the hooks receive.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

import torch

from .. import _collectives, checkpoint, memory, packed_sequence
from .. import parallel_state as ps
from ..data import TextDataset, build_tokenizer, default_corpus, padded_vocab_size
from ..data.gpt_dataset import GPTData
from ..distributed.comm import Compression
from ..distributed.data_parallel import DistributedDataParallel
from ..models import GPTConfig, GPTModel
from ..models.mtp import AddToGradient, mtp_loss
from ..optimizer import DistributedOptimizer, FusedAdamW, MixedPrecisionOptimizer
from ..optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from ..packed_sequence import MaskedTarget
from ..parallel_state import ParallelState
from ..pipeline.fbd import fbd_parallel_state, parse_ratio
from ..pipeline.fbd import program as fbd_program
from ..pipeline.layout import virtual_stage
from ..tensor_parallel import vocab_parallel_cross_entropy
from ..tensor_parallel.overlap import enable as tp_overlap_enable
from ..tensor_parallel.random import model_parallel_seed
from .config import MLA_YARN_FIELDS, Config, ConfigError, Plan
from .step import schedule_for

__all__ = ["Run", "GPTTask", "GPT", "install_memory_pool", "init_distributed", "gpt_config", "check_config",
           "apply_memory_limit", "resolve_auto_recompute",
           "build_parallel_state", "build_model_chunks", "wrap_data_parallel", "grad_scaler",
           "build_optimizer",
           "build_run"]


@dataclass
class Run:
    """Everything one training run holds (built by :func:`build_run`)."""

    config: Config
    plan: Plan
    rank: int
    world: int
    state: ParallelState
    device: torch.device
    dataset: TextDataset | GPTData
    model_config: GPTConfig
    chunks: list  #: this rank's model chunks, DDP-wrapped
    optimizer: object
    schedule: object  #: Schedule or AdaptiveSchedule
    activation_shape: tuple  #: of the tensors between pipeline stages
    start_iteration: int = 0
    #: training samples consumed before iteration 0 of this process's count
    #: (a resumed run's checkpoint says how many; global batch k starts at
    #: sample_offset + k * global batch size)
    sample_offset: int = 0
    extra: dict = field(default_factory=dict)  #: hooks may keep their state here
    task: object = None  #: the model family (:class:`GPTTask` unless a script passes another)

    def checkpoint_model_config(self) -> dict:
        """The model fields a checkpoint must agree on."""
        keys = (self.task or GPT).checkpoint_keys
        cfg = {k: getattr(self.model_config, k, None) for k in keys}
        if getattr(self.model_config, "position_embedding_type", None) in ("rope", "yarn", "none"):
            cfg.pop("seq_length", None)  # no position table: any sequence length continues
        return cfg

    @property
    def is_logger(self) -> bool:
        return self.rank == 0


class GPTTask:
    """What the training edge asks of a model family; this one is the GPT.
    Another family (e.g. :class:`megatronapp.training.vision.ViTTask`)
    provides the same methods and is passed as ``train(args, task=...)``."""

    name = "gpt"
    #: the model-config fields a checkpoint must agree on
    checkpoint_keys = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                       "seq_length", "ffn_hidden_size", "share_embeddings_and_output_weights",
                       "num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
                       # the block (Llama / Qwen / Mixtral flags)
                       "normalization", "layernorm_epsilon", "swiglu", "position_embedding_type",
                       "rotary_base", "rotary_percent", "rotary_interleaved", "use_rope_scaling",
                       "rope_scaling_factor", "rope_scaling_low_freq_factor",
                       "rope_scaling_high_freq_factor", "rope_scaling_original_max_position",
                       "num_query_groups", "kv_channels", "add_bias_linear", "add_qkv_bias",
                       "qk_layernorm", "moe_router_topk", "moe_shared_expert_intermediate_size",
                       "moe_router_topk_scaling_factor", *MLA_YARN_FIELDS)

    def check(self, config: Config, plan: Plan) -> None:
        """Family-specific flag checks (every rank, before any collective)."""

    def adopt_checkpoint(self, config: Config) -> None:
        """--load DIR: the architecture flags not given come from the
        checkpoint's model config (an imported Hugging Face model needs none);
        a given flag that disagrees is an error naming both values."""
        if not config.checkpoint.load:
            return
        try:
            found = checkpoint.read_metadata(config.checkpoint.load)
        except checkpoint.CheckpointError as e:
            raise SystemExit(f"--load {config.checkpoint.load}: {e}") from None
        if found is None or not (found[1].get("config") or {}).get("hidden_size"):
            return
        path, meta = found
        try:
            adopted = config.adopt_checkpoint_architecture(meta["config"], path)
        except ConfigError as e:
            raise SystemExit(str(e)) from None
        config.checkpoint_vocab_size = meta["config"].get("vocab_size")
        if adopted and dist.get_rank() == 0:
            print(f"[megatronapp] from the checkpoint {path}: {' '.join(adopted)}", flush=True)

    def build_dataset(self, config: Config):
        return build_dataset(config)

    def model_config(self, config: Config, state: ParallelState, dataset):
        return gpt_config(config, state, dataset.vocab_size)

    def build_chunks(self, config: Config, plan: Plan, state: ParallelState, cfg,
                     device: torch.device) -> list:
        return build_model_chunks(config, plan, state, cfg, device)

    def activation_shape(self, config: Config, state: ParallelState, cfg) -> tuple:
        """Of the tensors between pipeline stages: [s, b, h]."""
        seq = cfg.seq_length // state.cp_size  # each context rank holds its zigzag chunks
        seq = seq // state.tp_size if cfg.sequence_parallel else seq
        return (seq, config.optim.micro_batch_size, cfg.hidden_size)

    def loss_fn(self, run, scale: float = 1.0):
        """``loss_fn(output, target)`` on the last stage: a scalar (times `scale`)."""
        state, device = run.state, run.device

        mtp = next((m for m in (getattr(c, "module", c) for c in run.chunks)
                    if getattr(m, "mtp", None) is not None), None)

        def on_device(depth_targets):
            return [tuple(t.to(device) if torch.is_tensor(t) else t for t in d)
                    for d in depth_targets]

        def with_mtp(loss, labels, depth_targets):
            """The MTP losses trained through the gradient, reported on their own."""
            extra, parts = mtp_loss(mtp, mtp.take_mtp_hidden(), labels, depth_targets)
            run.extra.setdefault("mtp_losses", []).append(torch.stack(parts))
            return AddToGradient.apply(loss, extra)

        def loss_fn(logits, target):  # logits [b, s, V/tp] on the last stage
            if isinstance(target, MaskedTarget):  # packed documents (training/step.py)
                labels = target.labels.to(device)
                ce = vocab_parallel_cross_entropy(
                    logits.transpose(0, 1).float(), labels.transpose(0, 1),
                    group=state.tensor_group)
                loss = (ce * target.mask.to(device).transpose(0, 1)).sum() / target.divisor
                if mtp is not None and torch.is_grad_enabled() and target.mtp is not None:
                    with packed_sequence.active(target.packed):  # the documents' attention
                        loss = with_mtp(loss, labels, on_device(target.mtp))
                return loss * scale if scale != 1.0 else loss
            depth_targets = None
            if isinstance(target, tuple):  # context parallelism with MTP (training/step.py)
                target, depth_targets = target
                depth_targets = on_device(depth_targets)
            # The cross-entropy runs in fp32 whatever the model's precision (as
            # Megatron without --fp16-lm-cross-entropy).
            loss = vocab_parallel_cross_entropy(
                logits.transpose(0, 1).float(), target.to(device).transpose(0, 1),
                group=state.tensor_group).mean()
            if mtp is not None and torch.is_grad_enabled():  # trained, reported on its own
                loss = with_mtp(loss, target.to(device), depth_targets)
            return loss * scale if scale != 1.0 else loss
        return loss_fn


GPT = GPTTask()


def init_distributed(config: Config) -> None:
    """Initializes the default process group (no-op if already done). A plain
    ``python script.py`` is a world of one."""
    if dist.is_initialized():
        return
    backend = config.backend()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=300))


def install_memory_pool(config: Config) -> None:
    """--memory-pool: serve this process's tensor memory from megatronapp's
    pool. Call it first, before anything allocates (CUDA cannot swap
    allocators later); :func:`~megatronapp.training.train` does."""
    if config.memory.memory_pool:
        memory.use_pool(config.device_type(), policy=config.memory.memory_pool_policy)


_FLAG_CHECKS = [0]


def check_config(config: Config) -> Plan:
    """Every rank, before any collective: the ranks' flags agree (compared
    through the rendezvous store, one message naming each differing flag and
    its ranks), then :meth:`Config.check`. Raises SystemExit with the reason."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > 1:
        _FLAG_CHECKS[0] += 1  # several runs may share one process group
        store = dist.PrefixStore(f"mapp_flags/{_FLAG_CHECKS[0]}/", _collectives.default_store())
        store.set(str(rank), json.dumps(config.flat(), sort_keys=True, default=str))
        everyone = [json.loads(store.get(str(r))) for r in range(world)]
        diffs = []
        for key in sorted(everyone[0]):
            values = {}
            for r, flags in enumerate(everyone):
                values.setdefault(json.dumps(flags.get(key)), []).append(r)
            if len(values) > 1:
                flag = "--" + key.replace("_", "-")
                diffs.append(f"{flag}: " + ", ".join(f"{v} on ranks {rs}"
                                                     for v, rs in values.items()))
        if diffs:
            raise SystemExit("the ranks were started with different flags; every rank must get "
                             "the same command line: " + "; ".join(diffs))
    try:
        plan = config.check(world)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    if config.memory.memory_limit_gb is not None:
        apply_memory_limit(config, world, verbose=rank == 0)
    return plan


def data_vocab_size(config: Config) -> int:
    """The vocabulary (before padding) the model will have: the tokenizer's,
    or more if an indexed dataset's recorded tokenizer says so."""
    from ..data.gpt_dataset import covering_vocab_size, parse_data_path

    d = config.data
    vocab = build_tokenizer(**d.tokenizer_kwargs()).vocab_size
    return covering_vocab_size(parse_data_path(d.paths())[1], vocab) if d.is_indexed() else vocab


def resolve_auto_recompute(config: Config, world: int):
    """--recompute-granularity auto: sets config.recompute to the least
    recomputation the planner finds fits --memory-limit-gb and returns its
    Breakdown (None when the granularity is not auto). Raises
    megatronapp.memory.MemoryLimitError when nothing fits."""
    from ..memory import plan_recompute

    rc = config.recompute
    if rc.granularity() != "auto":
        return None
    gran, method, k, bd = plan_recompute(config.flat(), world,
                                         int(config.memory.memory_limit_gb * 2**30),
                                         vocab_size=data_vocab_size(config))
    rc.recompute_activations, rc.recompute_granularity = False, gran
    rc.recompute_method, rc.recompute_num_layers = method, k
    return bd


def apply_memory_limit(config: Config, world: int, verbose: bool = False) -> None:
    """--memory-limit-gb, with the planner (:mod:`megatronapp.memory.plan`):
    resolves --recompute-granularity auto into the least recomputation that
    fits, gives the dynamic schedule its live-activation limit when none was
    set, and stops (SystemExit) when the run cannot fit. No collective: every
    rank decides the same."""
    from ..memory import MemoryLimitError, estimate

    limit = int(config.memory.memory_limit_gb * 2**30)
    try:
        bd = resolve_auto_recompute(config, world)
        if bd is not None and verbose:
            rc = config.recompute
            how = f" ({rc.recompute_method}, {rc.recompute_num_layers} layers)" \
                if rc.recompute_method else ""
            print(f"[memory] --recompute-granularity auto: {bd.recompute}{how}; planned peak "
                  f"{bd.total / 2**30:.3f} GiB per rank (stage {bd.stage}) of "
                  f"{config.memory.memory_limit_gb} GiB", flush=True)
        bd = estimate(config, world, vocab_size=data_vocab_size(config))
    except (MemoryLimitError, ValueError) as e:  # does not fit, or not modelled
        raise SystemExit(f"--memory-limit-gb {config.memory.memory_limit_gb}: {e}") from None
    par = config.parallel
    if (par.pipeline_schedule == "dynamic" and par.pipeline_memory_limit is None
            and par.pipeline_model_parallel_size > 1):
        per_unit = bd.activations_per_microbatch / (par.virtual_pipeline_model_parallel_size or 1)
        room = limit - bd.static - bd.transient
        if per_unit > 0 and room >= per_unit:
            par.pipeline_memory_limit = int(room // per_unit)
            bd = estimate(config, world, vocab_size=data_vocab_size(config))
            if verbose:
                print(f"[memory] dynamic schedule: at most {par.pipeline_memory_limit} live "
                      "microbatch-chunks per stage", flush=True)
    if bd.total > limit:
        tp = par.tensor_model_parallel_size
        raise SystemExit(
            f"--memory-limit-gb {config.memory.memory_limit_gb}: needs "
            f"{bd.total / 2**30:.3f} GiB per rank (stage {bd.stage}: static "
            f"{bd.static / 2**30:.3f}, activations {bd.in_flight_activations / 2**30:.3f}, "
            f"working set {bd.transient / 2**30:.3f}), limit "
            f"{config.memory.memory_limit_gb} GiB; try --recompute-granularity full (or auto) "
            f"or tp={2 * tp}")


def build_parallel_state(config: Config, *, install: bool = False) -> ParallelState:
    """The (tp, dp, pp) grid and its groups (collective). With ``install`` it
    also becomes the default of the Megatron-style ``parallel_state`` getters."""
    par = config.parallel
    make = ps.initialize_model_parallel if install else ps.create_parallel_state
    return make(tensor_model_parallel_size=par.tensor_model_parallel_size,
                pipeline_model_parallel_size=par.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
                expert_model_parallel_size=config.moe.expert_model_parallel_size,
                context_parallel_size=par.context_parallel_size,
                expert_tensor_parallel_size=config.moe.expert_tensor_parallel_size)


def gpt_config(config: Config, state: ParallelState, tokenizer_vocab: int) -> GPTConfig:
    m = config.model
    vocab = padded_vocab_size(tokenizer_vocab, state.tp_size, m.make_vocab_size_divisible_by)
    saved = getattr(config, "checkpoint_vocab_size", None)  # --load: the checkpoint's table
    if saved is not None and saved != vocab:
        if saved < tokenizer_vocab or saved % state.tp_size:
            raise SystemExit(
                f"--load: the checkpoint's vocabulary has {saved} rows, which "
                + (f"cannot hold the tokenizer's {tokenizer_vocab} ids" if saved < tokenizer_vocab
                   else f"does not divide over --tensor-model-parallel-size {state.tp_size}")
                + " (use the tokenizer the checkpoint was trained with)")
        vocab = saved
    return GPTConfig(
        vocab_size=vocab,
        hidden_size=m.hidden_size, num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, seq_length=m.seq_length,
        ffn_hidden_size=m.ffn_hidden_size, sequence_parallel=config.parallel.sequence_parallel,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        attention_backend=m.attention_backend,
        recompute_granularity=config.recompute.granularity(),
        recompute_method=config.recompute.recompute_method,
        recompute_num_layers=config.recompute.recompute_num_layers,
        distribute_saved_activations=config.recompute.distribute_saved_activations,
        cp_comm_type=config.parallel.cp_comm_type,
        **m.block_kwargs(), **config.moe_model_kwargs())


def build_model_chunks(config: Config, plan: Plan, state: ParallelState, cfg: GPTConfig,
                       device: torch.device, model_class=GPTModel) -> list:
    """This rank's model chunks: chunk c is virtual stage ``c * pp + pp_rank``
    (zb-v's wave: ``c * pp + pp - 1 - pp_rank`` on odd chunks) with the
    layers the plan gives it, in the --bf16/--fp16 dtype (weights are drawn in
    fp32 and rounded, so every precision starts from the same model).
    `model_class` takes the same stage arguments as GPTModel (ViTModel does)."""
    layout, pp = plan.layer_layout, state.pp_size
    offsets = [sum(layout[:k]) for k in range(len(layout))]
    chunks = []
    for c in range(plan.vpp):
        vs = virtual_stage(state.pp_rank, c, pp, plan.placement)
        chunks.append(model_class(cfg, parallel_state=state, pre_process=vs == 0,
                               post_process=vs == pp * plan.vpp - 1,
                               layer_numbers=list(range(offsets[vs], offsets[vs] + layout[vs])),
                               seed=config.optim.seed).to(device, config.precision.dtype()))
    return chunks


def wrap_data_parallel(config: Config, chunks: list, state: ParallelState) -> list:
    """Each chunk in megatronapp's DDP (bucketed, overlapped, compressed)."""
    dp = config.data_parallel
    compression = (None if dp.grad_compression == "none" else
                   Compression(dp.grad_compression, dp.grad_compression_start_iter))
    pr = config.precision
    return [DistributedDataParallel(c, bucket_size_mb=dp.bucket_size_mb, compression=compression,
                                    overlap_grad_reduce=not dp.no_overlap_grad_reduce,
                                    gradient_accumulation_fusion=(
                                        not dp.no_gradient_accumulation_fusion),
                                    grad_reduce_in_fp32=(pr.bf16 or pr.fp16
                                                         or pr.accumulate_allreduce_grads_in_fp32),
                                    parallel_state=state)
            for c in chunks]


def grad_scaler(config: Config):
    """--fp16: the loss scaler its flags ask for (None otherwise)."""
    pr = config.precision
    if not pr.fp16:
        return None
    if pr.loss_scale is not None:
        return ConstantGradScaler(pr.loss_scale)
    return DynamicGradScaler(initial_scale=pr.initial_loss_scale, min_scale=pr.min_loss_scale,
                             growth_interval=pr.loss_scale_window, hysteresis=pr.hysteresis)


def inner_optimizer(optim) -> tuple:
    """(torch optimizer class, its keyword arguments) of --optimizer: AdamW
    (--adam-beta1/2, --adam-eps; --optimizer-impl fused: FusedAdamW) or SGD
    (--sgd-momentum)."""
    if optim.optimizer == "sgd":
        return torch.optim.SGD, {"lr": optim.lr, "momentum": optim.sgd_momentum}
    cls = FusedAdamW if optim.optimizer_impl == "fused" else torch.optim.AdamW
    return cls, {"lr": optim.lr, "betas": (optim.adam_beta1, optim.adam_beta2),
                 "eps": optim.adam_eps}


def build_optimizer(config: Config, chunks: list, state: ParallelState):
    """--optimizer (AdamW by default, betas 0.9, 0.95) with weight decay on
    matrices only; ZeRO-1 sharded with --use-distributed-optimizer; over fp32
    master weights with --bf16/--fp16 (and fp32 main gradients)."""
    params = [p for c in chunks for p in c.parameters()]
    groups = [{"params": [p for p in params if p.dim() >= 2],
               "weight_decay": config.optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if config.optim.optimizer == "muon":
        cls, groups, kwargs = _muon(config.optim, chunks, state)
    else:
        cls, kwargs = inner_optimizer(config.optim)
    if config.data_parallel.use_distributed_optimizer:
        return DistributedOptimizer(chunks, cls, groups, parallel_state=state,
                                    grad_scaler=grad_scaler(config),
                                    overlap_param_gather=config.data_parallel.overlap_param_gather,
                                    **kwargs)
    if config.precision.bf16 or config.precision.fp16:
        return MixedPrecisionOptimizer(chunks, cls, groups, parallel_state=state,
                                       grad_scaler=grad_scaler(config), **kwargs)
    return cls(groups, **kwargs)


def _muon(optim, chunks: list, state: ParallelState):
    """--optimizer muon: (class, groups, options) with the linear layers'
    matrices in Muon's group, the embeddings and the output layer (matrices
    too) and every vector in AdamW's (megatronapp.optimizer.muon)."""
    from ..optimizer.muon import Muon

    matrices, others, vectors = [], [], []
    for c in chunks:
        for name, p in getattr(c, "module", c).named_parameters():
            excluded = "embeddings" in name or name.split(".")[-2:-1] == ["output_layer"]
            (vectors if p.dim() < 2 else others if excluded or p.dim() != 2
             else matrices).append(p)
    groups = [{"params": matrices, "weight_decay": optim.weight_decay, "muon": True},
              {"params": others, "weight_decay": optim.weight_decay},
              {"params": vectors, "weight_decay": 0.0}]
    return Muon, [g for g in groups if g["params"]], dict(
        lr=optim.lr, momentum=optim.muon_momentum, nesterov=optim.muon_nesterov,
        ns_steps=optim.muon_num_ns_steps, scale_mode=optim.muon_scale_mode,
        extra_scale_factor=optim.muon_extra_scale_factor, tp_mode=optim.muon_tp_mode,
        split_qkv=not optim.no_muon_split_qkv, tp_group=state.tensor_group,
        betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps)


def build_dataset(config: Config):
    """--data-path: indexed datasets (GPTData: blends, splits, cached indices,
    identical on every rank) or one text file / the bundled corpus
    (TextDataset), tokenized by the --tokenizer-type flags."""
    d, o = config.data, config.optim
    tokenizer = build_tokenizer(**d.tokenizer_kwargs())
    if d.is_indexed():
        return GPTData(d.paths(), d.split, config.model.seq_length, o.seed,
                       train_samples=o.train_iters * o.global_batch_size,
                       eval_samples=o.eval_iters * o.global_batch_size, tokenizer=tokenizer,
                       cache_dir=d.data_cache_path)
    return TextDataset((d.paths() or [default_corpus()])[0], config.model.seq_length,
                       tokenizer=tokenizer)


def build_run(config: Config, hooks=(), task=None) -> Run:
    """Process group, checks, grid, data, model, DDP, optimizer, schedule (the
    memory pool, if wanted, is installed before: :func:`install_memory_pool`).
    `hooks` see the grid (``on_setup``) and the bare model chunks (``on_model``)."""
    task = task or GPT
    init_distributed(config)
    if hasattr(task, "adopt_checkpoint"):
        task.adopt_checkpoint(config)
    plan = check_config(config)
    try:
        task.check(config, plan)
    except (ValueError, ConfigError) as e:
        raise SystemExit(str(e)) from None
    state = build_parallel_state(config, install=True)
    if config.parallel.forward_backward_disaggregating:  # the role split of the dp ranks
        state = fbd_parallel_state(state, *parse_ratio(config.parallel.fbd_ratio))
    device = torch.device(config.device_type())
    rank, world = dist.get_rank(), dist.get_world_size()
    for h in hooks:
        h.on_setup(config, state, rank, world, device)
    torch.manual_seed(config.optim.seed)  # same on every rank: the master weights agree
    dataset = task.build_dataset(config)
    cfg = task.model_config(config, state, dataset)
    modules = task.build_chunks(config, plan, state, cfg, device)
    tp_overlap = config.parallel.tp_overlap()
    if tp_overlap is not None:
        tp_overlap_enable(modules, tp_overlap)
    recipe = config.precision.fp8()
    if recipe is not None:  # before resume: its scales and amax history are checkpointed
        from .. import fp8

        fp8.enable(modules, recipe)
    # Dropout: the default generator alike over the tensor group, the tracked
    # tensor-parallel state per tensor rank, both per stage (Megatron's
    # seed + 100 x pipeline rank). After the model: its weights do not move.
    model_parallel_seed(config.optim.seed + 100 * state.pp_rank, state, device.type)
    for h in hooks:
        h.on_model(modules, rank)
    if getattr(state, "is_forward", False):
        # FBD forward ranks: weights only (no gradients, no optimizer state);
        # the backward ranks broadcast new weights after every step.
        for p in (p for c in modules for p in c.parameters()):
            p.requires_grad_(False)
        chunks, optimizer = modules, None
    else:
        chunks = wrap_data_parallel(config, modules, state)
        optimizer = build_optimizer(config, chunks, state)
    if config.parallel.forward_backward_disaggregating:
        f, b = parse_ratio(config.parallel.fbd_ratio)
        schedule = fbd_program(state.fbd, state.pp_size, (f + b) * plan.microbatches)
    else:
        schedule = schedule_for(config, state.pp_size, plan.microbatches, plan.vpp, state)
    return Run(config=config, plan=plan, rank=rank, world=world,
               state=state, device=device, dataset=dataset, model_config=cfg, chunks=chunks,
               optimizer=optimizer, schedule=schedule,
               activation_shape=task.activation_shape(config, state, cfg), task=task)
