"""Reference models built from megatronapp's parallel layers."""

from .gpt import GPTConfig, GPTModel

__all__ = ["GPTConfig", "GPTModel"]
