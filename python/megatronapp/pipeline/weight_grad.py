"""Moved to :mod:`megatronapp.autograd` (the layers own it); kept as an alias."""

from ..autograd import WeightGradStore, defer, deferring, is_deferred, linear, run

__all__ = ["linear", "deferring", "defer", "is_deferred", "run", "WeightGradStore"]
