"""Vision models on the training edge: the ViT image classifier and the
LLaVA-style VLM as tasks.

    from megatronapp.training import train
    from megatronapp.training.vision import ViTTask, AccuracyHook
    summary = train(args, task=ViTTask(), hooks=[AccuracyHook()])
    summary["valid_accuracy"]

Everything else — TP, SP, pipeline schedules, DDP / ZeRO-1 / codecs,
checkpoints with resharding, tracing, the memory pool, MegaFBD — is the
GPT's machinery unchanged: the task only says how to build the data, the
model and the loss. Data: :class:`megatronapp.data.shapes.ShapesData`
(generated coloured shapes, 12 classes), sized by Megatron's ``--img-h``,
``--img-w``, ``--patch-dim`` and ``--num-channels``.

    summary = train(args, task=VLMTask())            # captions of two shapes
    baseline = train(args, task=VLMTask(text_only=True))

The VLM (:class:`megatronapp.models.VLM`) learns the generated captions of
:class:`megatronapp.data.shapes.CaptionData`; ``--seq-length`` is its
decoder's combined sequence (image tokens + text), ``--encoder-num-layers``
and ``--disable-vision-class-token`` shape the encoder (Megatron's flags).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
import torch.nn.functional as F

import torch

from ..data.shapes import (
    BOS_ID,
    CAPTION_VOCAB,
    EOS_ID,
    IMAGE_ID,
    MAX_CAPTION_TOKENS,
    PAD_ID,
    CaptionData,
    ShapesData,
)
from ..models import GPTModel, ViTConfig, ViTModel
from ..models.vlm import IGNORE_INDEX, VLM, VLMConfig, masked_token_loss
from .config import ConfigError
from .hooks import Hook
from .setup import GPTTask, build_model_chunks, gpt_config
from .step import evaluate

__all__ = ["ViTTask", "VLMTask", "AccuracyHook", "CaptionHook", "accuracy", "caption"]


def _check_images(config) -> None:
    """What every vision task needs of the image flags and the layout."""
    v, par = config.vision, config.parallel
    if v.img_h != v.img_w:
        raise ConfigError(f"the shapes images are square: --img-h {v.img_h} and --img-w "
                          f"{v.img_w} must be equal")
    if v.img_h % v.patch_dim:
        raise ConfigError(f"--img-h {v.img_h} is not divisible by --patch-dim {v.patch_dim}")
    if par.context_parallel_size > 1:
        raise ConfigError("the vision models do not run with --context-parallel-size > 1")
    if config.moe.num_experts is not None:
        raise ConfigError("--num-experts: the vision models have no MoE layers")
    if config.memory.memory_limit_gb is not None:
        raise ConfigError("--memory-limit-gb: the memory planner models the GPT only; "
                          "leave it out for the vision models")


class ViTTask(GPTTask):
    """A ViT with a classification head, trained with cross-entropy."""

    name = "vit"
    checkpoint_keys = ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                       "img_h", "img_w", "patch_dim", "num_channels", "num_classes")

    def check(self, config, plan) -> None:
        _check_images(config)
        v, par = config.vision, config.parallel
        seq = (v.img_h // v.patch_dim) * (v.img_w // v.patch_dim) + 1
        tp = par.tensor_model_parallel_size
        if par.sequence_parallel and tp > 1 and seq % tp:
            raise ConfigError(f"--sequence-parallel splits the {seq} tokens (patches + class "
                              f"token) over {tp} tensor ranks; choose --img-h / --patch-dim so "
                              "that they divide")

    def build_dataset(self, config):
        return ShapesData(img_size=config.vision.img_h, num_channels=config.vision.num_channels)

    def model_config(self, config, state, dataset):
        m, v, rc = config.model, config.vision, config.recompute
        return ViTConfig(
            hidden_size=m.hidden_size, num_layers=m.num_layers,
            num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
            img_h=v.img_h, img_w=v.img_w, patch_dim=v.patch_dim, num_channels=v.num_channels,
            num_classes=v.num_classes or dataset.num_classes,
            sequence_parallel=config.parallel.sequence_parallel,
            hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
            attention_backend=m.attention_backend, recompute_granularity=rc.granularity(),
            recompute_method=rc.recompute_method, recompute_num_layers=rc.recompute_num_layers)

    def build_chunks(self, config, plan, state, cfg, device) -> list:
        return build_model_chunks(config, plan, state, cfg, device, model_class=ViTModel)

    def loss_fn(self, run, scale: float = 1.0):
        device = run.device

        def loss_fn(logits, target):  # logits [b, classes] on the last stage
            loss = F.cross_entropy(logits.float(), target.to(device))
            return loss * scale if scale != 1.0 else loss
        return loss_fn

    def accuracy_metric(self, run):
        """The fraction of correct top-1 classes."""
        device = run.device
        return lambda logits, target: (logits.argmax(-1) == target.to(device)).float().mean()


class VLMTask(GPTTask):
    """The LLaVA-style VLM on generated captions; with ``text_only`` the
    same decoder (a GPT) on the same caption text without the image."""

    checkpoint_keys = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                       "seq_length", "ffn_hidden_size", "encoder_num_layers", "img_h", "img_w",
                       "patch_dim", "num_image_tokens")

    def __init__(self, text_only: bool = False):
        self.text_only = text_only
        self.name = "vlm-text-only" if text_only else "vlm"

    @staticmethod
    def image_tokens(config) -> int:
        v = config.vision
        return (v.img_h // v.patch_dim) ** 2 + (0 if v.disable_vision_class_token else 1)

    def text_length(self, config) -> int:
        return config.model.seq_length - self.image_tokens(config) + 1

    def check(self, config, plan) -> None:
        _check_images(config)
        p, t = self.image_tokens(config), self.text_length(config)
        need = MAX_CAPTION_TOKENS + 1  # the image token, up to 8 words, <eos>
        if t < need:
            raise ConfigError(f"--seq-length {config.model.seq_length} is the decoder's sequence: "
                              f"{p} image tokens and {t} text tokens; captions need {need}: use "
                              f"--seq-length >= {p + need - 1}")
        if config.vision.encoder_num_layers is not None and config.vision.encoder_num_layers < 1:
            raise ConfigError(f"--encoder-num-layers must be >= 1, got "
                              f"{config.vision.encoder_num_layers}")

    def build_dataset(self, config):
        return CaptionData(img_size=config.vision.img_h, num_image_tokens=self.image_tokens(config),
                           text_length=self.text_length(config), text_only=self.text_only)

    def model_config(self, config, state, dataset):
        language = gpt_config(config, state, dataset.vocab_size)
        if self.text_only:  # the text rows alone
            return dataclasses.replace(language, seq_length=self.text_length(config))
        m, v, rc = config.model, config.vision, config.recompute
        vision = ViTConfig(
            hidden_size=m.hidden_size, num_layers=v.encoder_num_layers or m.num_layers,
            num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
            img_h=v.img_h, img_w=v.img_w, patch_dim=v.patch_dim, num_channels=v.num_channels,
            hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
            attention_backend=m.attention_backend, recompute_granularity=rc.granularity(),
            recompute_method=rc.recompute_method, recompute_num_layers=rc.recompute_num_layers)
        return VLMConfig(language=language, vision=vision, image_token_id=IMAGE_ID,
                         drop_vision_class_token=v.disable_vision_class_token)

    def build_chunks(self, config, plan, state, cfg, device) -> list:
        return build_model_chunks(config, plan, state, cfg, device,
                                  model_class=GPTModel if self.text_only else VLM)

    def loss_fn(self, run, scale: float = 1.0):
        group = run.state.tensor_group

        def loss_fn(logits, target):  # [b, S, V/tp]: the mean over text targets
            loss = masked_token_loss(logits, target, group)
            return loss * scale if scale != 1.0 else loss
        return loss_fn

    def accuracy_metric(self, run):
        """The fraction of text targets whose logit is the largest of the
        whole vocabulary (the vocabulary-parallel max and target logit
        reduced over the tensor group)."""
        state, device = run.state, run.device

        def token_accuracy(logits, target):  # [b, S, V/tp], [b, S]
            target = target.to(device)
            keep = target != IGNORE_INDEX
            n = logits.shape[-1]
            local = target - state.tp_rank * n
            mine = (local >= 0) & (local < n)
            top = logits.max(-1).values
            picked = logits.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) * mine
            if state.tp_size > 1:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=state.tensor_group)
                dist.all_reduce(picked, group=state.tensor_group)
            return ((picked >= top) & keep).sum().float() / keep.sum().clamp(min=1)
        return token_accuracy


def accuracy(run):
    """``metric(logits, target)`` of the run's task: the fraction of correct
    top-1 classes (the ViT) or of text targets whose logit is the largest
    of the whole vocabulary (the VLM)."""
    return run.task.accuracy_metric(run)


class AccuracyHook(Hook):
    """Validation accuracy after each evaluation and at the end
    (``summary["valid_accuracy"]``, also printed by rank 0): of the classes
    (the ViT) or of the caption tokens (the VLM, top-1 over the vocabulary)."""

    def on_evaluate(self, run, iteration, valid_loss):
        acc = evaluate(run, accuracy(run))
        if acc and run.is_logger:
            print(f"[megatronapp] validation accuracy after iteration {iteration}: "
                  f"{sum(acc) / len(acc):.1%}", flush=True)

    def on_train_end(self, run):  # before the summary is built (and written)
        acc = evaluate(run, accuracy(run))
        value = sum(acc) / len(acc) if acc else None
        run.extra.setdefault("summary", {})["valid_accuracy"] = value
        if run.is_logger and acc:
            print(f"[megatronapp] validation accuracy {value:.1%} over "
                  f"{len(acc) * run.config.optim.global_batch_size} images", flush=True)


def caption(run, images) -> torch.Tensor:
    """Greedy captions of `images` [b, C, H, W] by a one-stage run of
    :class:`VLMTask` (every rank of the job calls it with the same images):
    text rows [b, T] from ``<image>`` (``<bos>`` text-only) to ``<eos>``.
    The next word is the argmax over the whole caption vocabulary (the
    vocabulary-parallel logits gathered over the tensor group)."""
    state, device = run.state, run.device
    if state.pp_size != 1:
        raise ValueError("caption() runs a one-stage model: use --pipeline-model-parallel-size 1")
    text_only = run.task.text_only
    data = run.dataset
    b, t = images.shape[0], data.text_length
    tokens = torch.full((b, t), PAD_ID, dtype=torch.int64, device=device)
    tokens[:, 0] = BOS_ID if text_only else IMAGE_ID
    done = torch.zeros(b, dtype=torch.bool, device=device)
    model = run.chunks[0]
    images = images.to(device)
    model.eval()
    try:
        with torch.no_grad():
            for i in range(1, t):
                logits = model(tokens if text_only else (images, tokens))
                # the prediction of text position i: at text position i - 1, which
                # follows the image's P embeddings in the combined sequence
                at = i - 1 if text_only else data.num_image_tokens + i - 2
                local = logits[:, at].float()  # [b, V/tp]
                if state.tp_size > 1:
                    parts = [torch.empty_like(local) for _ in range(state.tp_size)]
                    dist.all_gather(parts, local.contiguous(), group=state.tensor_group)
                    local = torch.cat(parts, dim=-1)
                word = local[:, :len(CAPTION_VOCAB)].argmax(-1)
                tokens[:, i] = torch.where(done, torch.full_like(word, PAD_ID), word)
                done |= word == EOS_ID
                if bool(done.all()):
                    break
    finally:
        model.train()
    return tokens.cpu()


class CaptionHook(Hook):
    """At the end of a one-stage VLM run: greedy captions of the first `n`
    validation images against their true captions, printed by rank 0 (the
    first `show`) and kept as ``summary["captions"]`` (pairs) and
    ``summary["caption_accuracy"]``: the share of captions exactly right,
    either way round (:meth:`CaptionData.other_way`)."""

    def __init__(self, n: int = 4, show: int = 4):
        self.n, self.show = n, show

    def on_train_end(self, run):
        if run.state.pp_size != 1 or not isinstance(run.task, VLMTask):
            return  # (generation runs one stage; with pipelines, evaluate the loss)
        (images, truth), _ = _valid_rows(run, self.n)
        made = caption(run, images)
        pairs = [(CaptionData.describe(a), CaptionData.describe(g))
                 for a, g in zip(truth, made, strict=True)]
        exact = sum(g in (a, CaptionData.other_way(a)) for a, g in pairs) / len(pairs)
        run.extra.setdefault("summary", {}).update(captions=pairs, caption_accuracy=exact)
        if run.is_logger:
            for want, got in pairs[:self.show]:
                print(f"[megatronapp] caption: {got!r} (true: {want!r})", flush=True)
            print(f"[megatronapp] {exact:.1%} of {len(pairs)} validation captions right "
                  "(either shape first)", flush=True)


def _valid_rows(run, n: int):
    """((images, tokens), labels) of the first `n` validation samples; the
    images of a text-only run are drawn the same way (its rows hold none)."""
    data, seed = run.dataset, run.config.optim.seed
    if not data.text_only:
        return data.global_batch("valid", 0, n, seed)
    pairs = [data.sample("valid", k, seed) for k in range(n)]
    tokens, labels = data.global_batch("valid", 0, n, seed)
    return (torch.stack([p[0] for p in pairs]), tokens), labels
