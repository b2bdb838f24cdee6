"""Reference models built from megatronapp's parallel layers."""

from . import mla, mtp  # noqa: F401  (register multi-latent attention and MTP with the GPT)
from .gpt import GPTConfig, GPTModel
from .vit import ViTConfig, ViTModel
from .vlm import VLM, VLMConfig

__all__ = ["GPTConfig", "GPTModel", "ViTConfig", "ViTModel", "VLM", "VLMConfig"]
