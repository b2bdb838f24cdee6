"""Data parallelism and its communication: the gradient reducer
(:class:`DistributedDataParallel`: buckets, fp32 main grads, expert buckets,
overlap), the gradient codecs (:mod:`.comm`: int8, 1-bit, top-k, PowerSGD,
bf16/fp16, with error feedback) and the ``mapp`` torch.distributed backend
(:mod:`.backend`: shared-memory collectives in the node, Gloo or NCCL
across)."""

from . import backend, comm
from .comm import Compression, parse_compression
from .data_parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel", "Compression", "parse_compression", "backend", "comm"]
