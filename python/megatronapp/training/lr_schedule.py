"""The learning-rate schedule: warm-up, then one of Megatron-LM's decay styles.

``--lr-decay-style constant|linear|cosine|inverse-square-root|WSD`` with
Megatron-LM's flags and meanings (its ``OptimizerParamScheduler``), counted in
iterations (``--train-iters``, ``--lr-decay-iters``, ``--lr-warmup-iters``,
``--lr-wsd-decay-iters``) or in samples (``--train-samples``,
``--lr-decay-samples``, ``--lr-warmup-samples``, ``--lr-wsd-decay-samples``;
one iteration consumes ``--global-batch-size`` samples). With the defaults
(cosine, decay over the whole run) it is the schedule this runtime always had.

At iteration ``it`` (0-based), with W warm-up and D decay steps (iterations,
or samples, where step ``it`` is ``it x global batch``):

* warm-up (``it < W``): ``init + (lr - init) (it + 1) / W`` — the step being
  taken counts, so the first iteration already learns (Megatron-LM's first
  step runs at ``--lr-warmup-init``, 0 by default);
* then, with ``r = (it - W) / (D - W)`` clipped to [0, 1] and
  ``lr(c) = min_lr + c (lr - min_lr)``:
  constant ``lr``; linear ``c = 1 - r``; cosine ``c = (1 + cos(pi r)) / 2``;
  inverse-square-root ``lr sqrt(max(W, 1) / max(it, 1))``, at least
  ``min_lr``; WSD: ``c = 1`` until ``D - D_wsd``, then annealed over the last
  ``D_wsd`` steps (``--lr-wsd-decay-style``: exponential ``2 * 0.5^q - 1``,
  linear ``1 - q``, cosine ``(1 + cos(pi q)) / 2``, minus_sqrt
  ``1 - sqrt(q)``, with q the fraction of the anneal done);
* after D steps every decaying style holds ``min_lr``.

The rate is a function of the iteration and the flags alone, so a resumed run
takes the same rates (checkpoints store the iteration; the flags are checked
against the checkpoint's).
"""

from __future__ import annotations

import math

__all__ = ["DECAY_STYLES", "WSD_STYLES", "lr_at", "check_lr_schedule", "resolve_train_iters",
           "schedule_state", "schedule_changes"]

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def _in_samples(optim) -> bool:
    return getattr(optim, "train_samples", None) is not None


def _steps(optim) -> tuple[float, float, float, float]:
    """(per iteration, warm-up, decay, WSD anneal) in the schedule's unit."""
    if _in_samples(optim):
        per = optim.global_batch_size
        decay = optim.lr_decay_samples or optim.train_samples
        warm = optim.lr_warmup_samples or 0
        wsd = optim.lr_wsd_decay_samples or 0
    else:
        per = 1
        decay = getattr(optim, "lr_decay_iters", None) or optim.train_iters
        warm = optim.lr_warmup_iters
        wsd = getattr(optim, "lr_wsd_decay_iters", None) or 0
    fraction = getattr(optim, "lr_warmup_fraction", None)
    if fraction is not None:
        warm = fraction * decay
    return per, warm, decay, wsd


def lr_at(optim, it: int, consumed_samples: int | None = None) -> float:
    """The learning rate of iteration ``it`` (0-based) under ``optim``'s flags
    (an :class:`~megatronapp.training.config.OptimConfig` or any object with
    its fields; fields it lacks take their defaults). Counted in samples, the
    step is ``consumed_samples`` (the samples trained before this iteration;
    default ``it x global batch``) as Megatron-LM's scheduler counts them, so a
    run resumed with another global batch size goes on from where it was."""
    per, warm, decay, wsd = _steps(optim)
    peak, low = optim.lr, optim.min_lr
    init = getattr(optim, "lr_warmup_init", 0.0)
    style = getattr(optim, "lr_decay_style", "cosine")
    step = it * per
    if per != 1 and consumed_samples is not None:
        step = consumed_samples
    if step < warm:
        return init + (peak - init) * (step + per) / warm
    if style == "constant":
        return peak
    if step > decay:
        return low
    if style == "inverse-square-root":
        return max(low, peak * math.sqrt(max(warm, 1)) / math.sqrt(max(step, 1)))
    frac = min(1.0, (step - warm) / max(per, decay - warm))
    if style == "linear":
        coeff = 1.0 - frac
    elif style == "cosine":  # (this order of the products: the rates of earlier releases)
        return low + 0.5 * (peak - low) * (1 + math.cos(math.pi * frac))
    elif style == "WSD":
        start = decay - wsd
        if step <= start:  # the stable phase: the peak itself (not min + 1 x (peak - min))
            return peak
        else:
            q = min(1.0, (step - start) / wsd)
            kind = getattr(optim, "lr_wsd_decay_style", "exponential")
            coeff = {"exponential": lambda: 2.0 * 0.5 ** q - 1.0,
                     "linear": lambda: 1.0 - q,
                     "cosine": lambda: 0.5 * (1 + math.cos(math.pi * q)),
                     "minus_sqrt": lambda: 1.0 - math.sqrt(q)}[kind]()
    else:
        raise ValueError(f"unknown --lr-decay-style {style!r}; use one of {DECAY_STYLES}")
    return low + coeff * (peak - low)


def resolve_train_iters(optim) -> None:
    """--train-samples: the run's iterations, ``train_samples // global batch``
    (Megatron-LM's rule; the remainder is not trained)."""
    if _in_samples(optim):
        optim.train_iters = optim.train_samples // optim.global_batch_size


def check_lr_schedule(optim, explicit, error=ValueError) -> None:
    """Raises ``error`` naming the flag for a schedule that cannot run: iteration
    and sample counts mixed, WSD without its anneal length, negative lengths.
    ``explicit``: the flags the command line gave (None: unknown, from Python)."""
    given = (lambda flag: flag in explicit) if explicit is not None else (lambda flag: False)
    samples = ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples")
    iters = ("lr_decay_iters", "lr_wsd_decay_iters")
    for name in samples + iters + ("train_samples",):
        value = getattr(optim, name)
        if value is not None and value < 0:
            raise error(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if optim.min_lr < 0 or optim.lr_warmup_init < 0:
        raise error("--min-lr and --lr-warmup-init must be >= 0")
    if _in_samples(optim):
        if given("train_iters"):
            raise error("--train-iters and --train-samples both given: count the run in "
                        "iterations or in samples, not both")
        if optim.train_samples < optim.global_batch_size:
            raise error(f"--train-samples {optim.train_samples} is less than one global batch "
                        f"(--global-batch-size {optim.global_batch_size})")
        wrong = [n for n in iters if getattr(optim, n) is not None]
        wrong += ["lr_warmup_iters"] if given("lr_warmup_iters") else []
        if wrong:
            flags = ", ".join("--" + n.replace("_", "-") for n in wrong)
            raise error(f"{flags}: with --train-samples the schedule is counted in samples; "
                        "use --lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples")
    else:
        wrong = [n for n in samples if getattr(optim, n) is not None]
        if wrong:
            flags = ", ".join("--" + n.replace("_", "-") for n in wrong)
            raise error(f"{flags} count the schedule in samples: give --train-samples, or use "
                        "--lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters")
    fraction = optim.lr_warmup_fraction
    if fraction is not None:
        if not 0.0 <= fraction <= 1.0:
            raise error(f"--lr-warmup-fraction must be in [0, 1], got {fraction}")
        if given("lr_warmup_iters") or optim.lr_warmup_samples is not None:
            raise error("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples both "
                        "given: give one warm-up length")
    _, warm, decay, wsd = _steps(optim)
    if optim.lr_decay_style == "WSD":
        unit = "samples" if _in_samples(optim) else "iters"
        if not wsd:
            raise error(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}: the length of the "
                        "final anneal")
        if wsd > decay - warm:
            raise error(f"--lr-wsd-decay-{unit} {wsd:g} is longer than the decay after the "
                        f"warm-up ({decay:g} - {warm:g}); shorten it or lengthen the decay")
    elif wsd:
        raise error(f"--lr-wsd-decay-* is the anneal of --lr-decay-style WSD, not of "
                    f"{optim.lr_decay_style}")


def schedule_state(optim) -> dict:
    """What a checkpoint records of the schedule (Megatron-LM's
    ``opt_param_scheduler`` state): the rates, the style and the lengths in
    the schedule's unit."""
    _, warm, decay, wsd = _steps(optim)
    return {"unit": "samples" if _in_samples(optim) else "iterations", "lr": optim.lr,
            "min_lr": optim.min_lr, "lr_warmup_init": optim.lr_warmup_init,
            "lr_decay_style": optim.lr_decay_style, "warmup": warm, "decay": decay,
            "lr_wsd_decay_style": optim.lr_wsd_decay_style, "wsd_decay": wsd}


def schedule_changes(saved: dict, optim) -> list[str]:
    """``name: saved -> now`` for each value of the schedule that differs from a
    checkpoint's (empty: the same schedule; a checkpoint without one: empty)."""
    if not saved:
        return []
    now = schedule_state(optim)
    return [f"{k} {saved[k]!r} in the checkpoint, {now[k]!r} here" for k in now
            if k in saved and saved[k] != now[k]]
