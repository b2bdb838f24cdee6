"""Deprecated: moved to :mod:`megatronapp.distributed.data_parallel` (megatronapp._moved)."""

from ._moved import alias as _alias

_alias(__name__, stacklevel=3)
