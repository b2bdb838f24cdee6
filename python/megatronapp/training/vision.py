"""Vision models on the training edge: the ViT image classifier as a task.

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
"""

from __future__ import annotations

import torch.nn.functional as F

from ..data.shapes import ShapesData
from ..models import ViTConfig, ViTModel
from .config import ConfigError
from .hooks import Hook
from .setup import GPTTask, build_model_chunks
from .step import evaluate

__all__ = ["ViTTask", "AccuracyHook", "accuracy"]


class ViTTask(GPTTask):
    """A ViT with a classification head, trained with cross-entropy."""

    name = "vit"
    checkpoint_keys = ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                       "img_h", "img_w", "patch_dim", "num_channels", "num_classes")

    def check(self, config, plan) -> None:
        v, par = config.vision, config.parallel
        if v.img_h != v.img_w:
            raise ConfigError(f"the shapes images are square: --img-h {v.img_h} and --img-w "
                              f"{v.img_w} must be equal")
        if v.img_h % v.patch_dim:
            raise ConfigError(f"--img-h {v.img_h} is not divisible by --patch-dim {v.patch_dim}")
        if par.context_parallel_size > 1:
            raise ConfigError("the ViT does not run with --context-parallel-size > 1")
        if config.moe.num_experts is not None:
            raise ConfigError("--num-experts: the ViT has no MoE layers")
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


def accuracy(run):
    """``metric(logits, target)``: the fraction of correct top-1 classes."""
    device = run.device
    return lambda logits, target: (logits.argmax(-1) == target.to(device)).float().mean()


class AccuracyHook(Hook):
    """Validation accuracy after each evaluation and at the end
    (``summary["valid_accuracy"]``, also printed by rank 0)."""

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
