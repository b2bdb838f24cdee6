"""Deprecated: moved to :mod:`megatronapp.optimizer.muon` (megatronapp._moved)."""

from ._moved import alias as _alias

_alias(__name__, stacklevel=3)
