"""Optimizers: mixed precision with fp32 main weights and the ZeRO-1
distributed optimizer (:mod:`.optimizer`), the fp16 loss scalers
(:mod:`.grad_scaler`), the global gradient norm and clipping
(:mod:`.clip_grads`) and Muon (:mod:`.muon`)."""

from .optimizer import DistributedOptimizer, FusedAdamW, MixedPrecisionOptimizer, Shard

__all__ = ["MixedPrecisionOptimizer", "DistributedOptimizer", "Shard", "FusedAdamW"]
