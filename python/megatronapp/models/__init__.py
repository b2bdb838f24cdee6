"""Reference models built from megatronapp's parallel layers."""

from .gpt import GPTConfig, GPTModel
from .vit import ViTConfig, ViTModel
from .vlm import VLM, VLMConfig

__all__ = ["GPTConfig", "GPTModel", "ViTConfig", "ViTModel", "VLM", "VLMConfig"]
