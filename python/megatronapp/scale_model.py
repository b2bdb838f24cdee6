"""Deprecated: moved to :mod:`megatronapp.tools.scale_model` (megatronapp._moved)."""

from ._moved import alias as _alias

_alias(__name__, stacklevel=3)
