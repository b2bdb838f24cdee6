"""One training step, and evaluation, through the pipeline executor.

There is one path for every layout: with pipeline parallelism the configured
schedule runs; with one stage the step is the one-stage 1F1B schedule
(forward, backward per microbatch), so the loss is computed, averaged and
reported the same way whatever the layout.

    result = train_step(run, iteration)     # loss, grad norm, lr
    losses = evaluate(run)                  # per validation batch
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

import torch

from .. import packed_sequence
from .. import trace as tracing
from ..models.context_parallel import zigzag_split
from ..models.mtp import mtp_targets
from ..pipeline import AdaptiveSchedule, current_schedule, fbd, forward_backward, make_schedule, to_device
from ..tensor_parallel.random import model_parallel_seed
from .grads import finish_gradients
from .lr_schedule import lr_at

__all__ = ["StepResult", "schedule_for", "lr_at", "train_step", "evaluate"]


@dataclass
class StepResult:
    loss: float  #: mean over the global batch
    grad_norm: float  #: before clipping
    lr: float
    mtp_losses: list | None = None  #: --mtp-num-layers: each depth's mean loss


def schedule_for(config, p: int, m: int, v: int = 1, parallel_state=None):
    """The pipeline schedule the flags of `config` ask for (see
    :func:`megatronapp.pipeline.make_schedule`)."""
    par = config.parallel
    return make_schedule(par.pipeline_schedule, p, m, v, policy=par.pipeline_dynamic_policy,
                         memory_limit=par.pipeline_memory_limit,
                         replan_interval=par.pipeline_replan_interval,
                         parallel_state=parallel_state)


def _moe_layers(run) -> list:
    """The MoE layers of this rank's chunks (megatronapp.moe.moe_layers; not
    imported here, so the training edge does not depend on the MoE package)."""
    if run.config.moe.num_experts is None:
        return []
    return [m for c in run.chunks for m in c.modules() if getattr(m, "is_moe_layer", False)]


def _global_batch_loss(run, split: str, it: int, backward: bool, metric=None) -> float:
    """Runs one global batch through this rank's part of the schedule; returns
    the mean loss over the global batch (the same on every rank)."""
    cfg, state = run.config, run.state
    if getattr(state, "is_forward", False):  # FBD forward ranks: evaluation is the backward's
        return _world_mean([], state, cfg.optim.global_batch_size // cfg.optim.micro_batch_size,
                           run.device)
    with tracing.scope("data", "data", lane=0):
        gbs = cfg.optim.global_batch_size
        first = run.sample_offset + it * gbs if split == "train" else None
        tokens, labels = run.dataset.global_batch(split, it, gbs, cfg.optim.seed,
                                                  first_sample=first)
        micro = run.dataset.microbatches(tokens, labels, cfg.optim.micro_batch_size,
                                         state.dp_rank, state.dp_size)
        if cfg.packing():
            micro = _packed_microbatches(run, tokens, micro, backward)
        elif state.cp_size > 1:  # this context rank's zigzag chunks of every sequence
            cp, r = state.cp_size, state.cp_rank
            depths = cfg.model.mtp_num_layers if backward else None

            def target(y):  # MTP's shifted tokens cross the chunks: from the whole sequences
                part = zigzag_split(y, cp, r, 1)
                return (part, mtp_targets(y, depths, cp, r)) if depths else part

            micro = [(zigzag_split(x, cp, r, 1), target(y)) for x, y in micro]
    device = run.device
    # fp16: the loss is scaled before backward (the optimizer unscales the
    # gradients); the reported losses are divided back.
    scale = getattr(run.optimizer, "loss_scale", 1.0) if backward else 1.0
    for layer in _moe_layers(run):  # the routers' aux losses: scaled as the main loss
        layer.aux_loss_scale = scale / len(micro)
    loss_fn = run.task.loss_fn(run, scale) if metric is None else metric
    schedule = current_schedule(run.schedule)
    if isinstance(schedule, fbd.FBDProgram):  # evaluation: the backward pipelines' forward
        schedule = make_schedule("1f1b", state.pp_size, len(micro))
    res = forward_backward(schedule, run.chunks,
                           iter([(to_device(x, device), *rest) for x, *rest in micro]), loss_fn,
                           tensor_shape=run.activation_shape, dtype=cfg.precision.dtype(),
                           parallel_state=state, forward_only=not backward,
                           scatter_gather=(cfg.parallel.scatter_gather_tensors_in_pipeline
                                           and not cfg.parallel.sequence_parallel))
    if backward:
        run.extra["pipeline_last"] = res  # measured action times (benchmarks, planners)
        if isinstance(run.schedule, AdaptiveSchedule):
            run.schedule.observe(res)
    # (each context rank's loss is the mean over its equal share of the tokens)
    return _world_mean(res.losses, state, len(micro) * state.dp_size * state.cp_size * scale,
                       device)


def _packed_microbatches(run, tokens, micro, backward: bool = False) -> list:
    """(tokens, MaskedTarget, {"packed": PackedSeq}) per microbatch (Megatron-
    LM's get_ltor_masks_and_position_ids), this context rank's zigzag chunks
    of each. The loss divisor makes the global batch's loss Megatron-LM's: the
    mean over the microbatches of each one's unmasked-token mean, or with
    --calculate-per-token-loss the mean over every unmasked token of the
    global batch (every rank holds the global batch, so the count needs no
    collective)."""
    cfg, state = run.config, run.state
    eod = getattr(getattr(run.dataset, "tokenizer", None), "eod", None)
    if eod is None:
        raise SystemExit("--reset-position-ids/--reset-attention-mask/--eod-mask-loss need a "
                         "text dataset with an end-of-document token")
    data, cp, r = cfg.data, state.cp_size, state.cp_rank

    def mask_of(x):
        return packed_sequence.loss_mask(x, eod) if data.eod_mask_loss else torch.ones(x.shape)

    per_token = cfg.optim.calculate_per_token_loss
    if per_token:
        share = max(float(mask_of(tokens).sum()), 1.0) / (len(micro) * state.dp_size * cp)

    def split(t):
        return zigzag_split(t, cp, r, 1) if cp > 1 else t

    # MTP's depths predict further ahead: under --eod-mask-loss or
    # --reset-attention-mask none predicts a token of another document.
    depths = cfg.model.mtp_num_layers if backward else 0
    apart = data.eod_mask_loss or data.reset_attention_mask
    out = []
    for x, y in micro:
        mask = mask_of(x)
        divisor = share if per_token else max(float(mask.sum()), 1.0) / cp
        packed = packed_sequence.PackedSeq(
            segment_ids=packed_sequence.document_ids(x, eod) if data.reset_attention_mask else None,
            position_ids=split(packed_sequence.reset_positions(x, eod)) if data.reset_position_ids else None)
        packed = packed.to(run.device)
        mtp = None
        if depths:
            docs = packed_sequence.document_ids(torch.cat([x, y[:, -1:]], 1), eod) if apart \
                else None
            mtp = mtp_targets(y, depths, cp, r, documents=docs)
        out.append((split(x), packed_sequence.MaskedTarget(split(y), split(mask), divisor, mtp,
                                                           packed), {"packed": packed}))
    return out


def _world_mean(losses, state, divisor: float, device, extra: float | None = None):
    """Last stage: the sum of its microbatch losses; every tensor rank holds
    the same value, so only tensor rank 0 contributes. One all-reduce over the
    world adds the data-parallel ranks' shares (and `extra`, a value one rank
    contributes); one host sync reads it."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    if losses and state.tp_rank == 0:
        total[0] += torch.stack(losses).double().sum()
    total[1] = extra or 0.0
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    if extra is None:
        return float(total[0]) / divisor
    return float(total[0]) / divisor, float(total[1])


def _fbd_train_step(run, it: int, lr: float) -> StepResult:
    """One FBD step (:mod:`megatronapp.pipeline.fbd`): this rank's role in
    the group program, the backward ranks' optimizer step, the new weights to
    the forward ranks."""
    cfg, state, device = run.config, run.state, run.device
    gbs, mbs = cfg.optim.global_batch_size, cfg.optim.micro_batch_size
    lay = state.fbd
    with tracing.scope("data", "data", lane=0):
        tokens, labels = run.dataset.global_batch("train", it, gbs, cfg.optim.seed,
                                                  first_sample=run.sample_offset + it * gbs)
        micro = []  # the microbatches of the group's data-parallel ranks, in order
        for d in range(lay.group_size):
            micro += run.dataset.microbatches(tokens, labels, mbs,
                                              state.fbd_group * lay.group_size + d, lay.dp)
    scale = 1.0 if state.is_forward else getattr(run.optimizer, "loss_scale", 1.0)
    reseed = None
    if cfg.model.hidden_dropout > 0 or cfg.model.attention_dropout > 0:
        # A forward rank's stage output and the backward rank's recomputation
        # draw the same dropout masks: both seed from (iteration, microbatch, stage).
        def reseed(j):
            model_parallel_seed(cfg.optim.seed + 100 * state.pp_rank
                                + 7919 * (it * len(micro) + j + 1), state, device.type)
    if not state.is_forward:
        run.optimizer.zero_grad(set_to_none=True)
    res = fbd.run_step(run.schedule, state, run.chunks, micro.__getitem__,
                       run.task.loss_fn(run, scale),
                       tensor_shape=run.activation_shape, dtype=cfg.precision.dtype(),
                       device=device, grad_scale=scale, reseed=reseed)
    run.extra["pipeline_last"] = res
    grad_norm = 0.0
    if not state.is_forward:
        with tracing.scope("optimizer", "optimizer", lane=0):
            grad_norm = finish_gradients(run.chunks, run.optimizer, state, cfg.optim.clip_grad)
            run.optimizer.step()
    fbd.broadcast_weights(run.chunks, state)
    reporter = not state.is_forward and state.dp_rank == 0 and state.tp_rank == 0 \
        and state.pp_rank == 0
    loss, grad_norm = _world_mean(res.losses, state, len(micro) * lay.groups, device,
                                  extra=grad_norm if reporter else 0.0)
    return StepResult(loss, grad_norm, lr)


def train_step(run, it: int) -> StepResult:
    """Iteration `it` (0-based): forward and backward of the global batch,
    gradients finished (:mod:`.grads`), optimizer step."""
    optim = run.config.optim
    lr = lr_at(optim, it, consumed_samples=run.sample_offset + it * optim.global_batch_size)
    for group in getattr(run.optimizer, "param_groups", ()):
        group["lr"] = lr
    if run.config.parallel.forward_backward_disaggregating:
        return _fbd_train_step(run, it, lr)
    run.optimizer.zero_grad(set_to_none=True)
    run.extra["mtp_losses"] = []
    loss = _global_batch_loss(run, "train", it, backward=True)
    mtp = _mtp_losses(run)
    recipe = run.config.precision.fp8()
    if recipe is not None:  # delayed scaling: this iteration's amaxes make the next scales
        from .. import fp8

        st = run.state
        fp8.update(run.chunks, recipe, (st.tensor_group, st.data_context_group or st.data_group))
    with tracing.scope("optimizer", "optimizer", lane=0):
        grad_norm = finish_gradients(run.chunks, run.optimizer, run.state,
                                     run.config.optim.clip_grad)
        run.optimizer.step()
        for layer in _moe_layers(run):  # the load of every token: the data x context ranks'
            layer.update_expert_bias(run.state.data_context_group or run.state.data_group)
    return StepResult(loss, grad_norm, lr, mtp)


def _mtp_losses(run) -> list | None:
    """--mtp-num-layers: each depth's loss, the mean over the global batch
    (one all-reduce; the last stage's tensor rank 0 contributes)."""
    depths = run.config.model.mtp_num_layers
    if not depths:
        return None
    state = run.state
    total = torch.zeros(depths, dtype=torch.float64, device=run.device)
    parts = run.extra.pop("mtp_losses", [])
    if parts and state.tp_rank == 0:
        total += torch.stack(parts).double().sum(0)
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    micro = run.config.optim.global_batch_size // run.config.optim.micro_batch_size
    # (each context rank's share is its part of the mean, times cp)
    return (total / (micro * state.cp_size)).tolist()


def evaluate(run, metric=None) -> list:
    """Validation loss of each of the ``--eval-iters`` validation batches (none
    when ``--split`` gives the validation split no documents). `metric`
    (``metric(output, target) -> scalar`` on the last stage, e.g. accuracy)
    replaces the loss; its mean over each global batch is returned."""
    if not run.dataset.has_split("valid"):
        return []
    for c in run.chunks:
        c.eval()
    try:
        with torch.no_grad():
            return [_global_batch_loss(run, "valid", i, backward=False, metric=metric)
                    for i in range(run.config.optim.eval_iters)]
    finally:
        for c in run.chunks:
            c.train()
