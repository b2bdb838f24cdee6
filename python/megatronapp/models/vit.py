"""A Vision Transformer built from the same tensor-parallel layers as the GPT.

Megatron-Core's ``CLIPViTModel`` layout: a patch embedding (a convolution
with stride = kernel = patch size, no bias), a class token, learned
position embeddings, ``ln_pre``, then pre-LayerNorm transformer layers with
bidirectional attention (``attn_mask_type="no_mask"``) and no final norm.
Megatron's reference configuration (2 layers, hidden 64, 4 heads, 336-px
images, patch 14) has 577 tokens and exactly 174,720 parameters, which
this model reproduces. With ``num_classes`` a classification head (final
LayerNorm + linear on the class token) follows.

Activations use the [sequence, batch, hidden] layout, so sequence
parallelism shards dim 0 as in the GPT, and pipeline stages split the
layers the same way (``pre_process`` holds the embedding, ``post_process``
the head). Every component is drawn from its own seed, so the model is the
same function at every tensor- and pipeline-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..parallel_state import ParallelState
from ..tensor_parallel import mappings
from ..tensor_parallel.utils import resolve_state
from .gpt import GPTConfig, TransformerLayer, activation_dropout, forward_layers, seeded

__all__ = ["ViTConfig", "ViTModel"]


@dataclass
class ViTConfig:
    """Shape of the ViT (Megatron's flags where they exist)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  #: default 4 * hidden_size
    img_h: int = 336
    img_w: int = 336
    patch_dim: int = 14
    num_channels: int = 3
    num_classes: int | None = None  #: None: the encoder only (CLIPViTModel)
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    sequence_parallel: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_backend: str = "auto"
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    def __post_init__(self):
        for name, size in (("img_h", self.img_h), ("img_w", self.img_w)):
            if size % self.patch_dim:
                raise ValueError(f"{name} ({size}) is not divisible by patch_dim "
                                 f"({self.patch_dim})")
        if self.num_classes is not None and self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")

    @property
    def seq_length(self) -> int:
        """Patches plus the class token."""
        return (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim) + 1

    def transformer_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=1, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads, seq_length=self.seq_length,
            ffn_hidden_size=self.ffn_hidden_size, init_method_std=self.init_method_std,
            layernorm_epsilon=self.layernorm_epsilon, sequence_parallel=self.sequence_parallel,
            hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
            attention_backend=self.attention_backend, attn_mask_type="no_mask",
            recompute_granularity=self.recompute_granularity,
            recompute_method=self.recompute_method,
            recompute_num_layers=self.recompute_num_layers)

    def num_parameters(self) -> int:
        h, s = self.hidden_size, self.seq_length
        f = self.ffn_hidden_size or 4 * h
        layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        embed = self.num_channels * self.patch_dim ** 2 * h + h + s * h + 2 * h
        head = 0 if self.num_classes is None else 2 * h + h * self.num_classes + self.num_classes
        return embed + self.num_layers * layer + head


class ViTModel(nn.Module):
    """``forward(images [b, C, H, W], labels [b] | None)``. Without a head:
    the encoder's output [b, s, h] (s = patches + 1). With ``num_classes``:
    the class logits [b, classes], or with labels the per-sample loss [b].

    A stage without ``pre_process`` takes the hidden states [s, b, h]
    (sequence-sharded under sequence parallelism); one without
    ``post_process`` returns them."""

    def __init__(self, config: ViTConfig, *, parallel_state: ParallelState | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 layer_numbers: list[int] | None = None, seed: int | None = None):
        super().__init__()
        state = resolve_state(parallel_state)
        self.config = config
        cfg = self.transformer = config.transformer_config()
        if cfg.sequence_parallel and state.tp_size == 1:
            cfg.sequence_parallel = False
        if cfg.sequence_parallel and config.seq_length % state.tp_size:
            raise ValueError(f"sequence parallelism splits the {config.seq_length} tokens "
                             f"(patches + class token) over {state.tp_size} tensor-parallel "
                             "ranks: choose an image/patch size that divides")
        if state.cp_size > 1:
            raise ValueError("the ViT does not support context parallelism")
        self.group = state.tensor_group
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = list(range(config.num_layers) if layer_numbers is None
                                  else layer_numbers)
        base = torch.initial_seed() if seed is None else seed
        h, std = config.hidden_size, config.init_method_std
        if pre_process:
            with seeded(base, 0):
                self.conv1 = nn.Conv2d(config.num_channels, h, kernel_size=config.patch_dim,
                                       stride=config.patch_dim, bias=False)
                nn.init.normal_(self.conv1.weight, 0.0, std)
                self.class_token = nn.Parameter(torch.randn(1, 1, h) * std)
                self.position_embeddings = nn.Embedding(config.seq_length, h)
                nn.init.normal_(self.position_embeddings.weight, 0.0, std)
                self.ln_pre = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        layers = []
        for i in self.layer_numbers:
            with seeded(base, 1 + i):
                layers.append(TransformerLayer(cfg, state, i))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = self.head = None
        if post_process and config.num_classes is not None:
            with seeded(base, 1 + config.num_layers):
                self.final_layernorm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
                self.head = nn.Linear(h, config.num_classes)
                nn.init.normal_(self.head.weight, 0.0, std)
                nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        cfg = self.config
        sp = self.transformer.sequence_parallel
        if self.pre_process:
            if x.dim() != 4 or x.shape[1:] != (cfg.num_channels, cfg.img_h, cfg.img_w):
                raise ValueError(f"expected images [b, {cfg.num_channels}, {cfg.img_h}, "
                                 f"{cfg.img_w}], got {list(x.shape)}")
            x = self.conv1(x.to(self.conv1.weight.dtype))  # images in the model's precision
            x = x.flatten(2).transpose(1, 2)  # [b, patches, h]
            x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
            x = self.ln_pre(x + self.position_embeddings.weight)
            x = x.transpose(0, 1).contiguous()  # [s, b, h]
            if sp:
                x = mappings.scatter_to_sequence_parallel_region(x, self.group)
            x = activation_dropout(x, cfg.hidden_dropout, self.training, sharded=sp)
        x = forward_layers(self.layers, x, self.transformer, self.group, self.training)
        if not self.post_process:
            return x
        if sp:
            x = mappings.gather_from_sequence_parallel_region(x, False, self.group)
        if self.head is None:
            return x.transpose(0, 1)  # [b, s, h]
        logits = self.head(self.final_layernorm(x[0]))  # the class token
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.float(), labels, reduction="none")
