"""Deprecated: moved to :mod:`megatronapp.models.scope_taps` (megatronapp._moved)."""

from ._moved import alias as _alias

_alias(__name__, stacklevel=3)
