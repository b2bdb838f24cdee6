"""Deprecated: moved to :mod:`megatronapp.distributed.backend` (megatronapp._moved)."""

from ._moved import alias as _alias

_alias(__name__, stacklevel=3)
