"""Old import paths of the modules the 2026-12 regroup moved (issue 44).

The package is laid out where Megatron-Core users look: ``distributed``
(DDP, gradient codecs, the mapp backend), ``optimizer`` (ZeRO-1, the loss
scaler, clipping, Muon), ``resilience`` (fault injection, the watchdog),
``tools`` (the scale model), and ``models`` (with the fusions, context-parallel
attention and MegaScope's taps). Each old path still imports, for one
release, as the new module itself (the same object: attributes set on one are
seen through the other), with a DeprecationWarning naming the new path.
"""

from __future__ import annotations

import importlib
import sys
import warnings

#: old module -> new module
MOVED = {
    "megatronapp.data_parallel": "megatronapp.distributed.data_parallel",
    "megatronapp.comm": "megatronapp.distributed.comm",
    "megatronapp.distributed_backend": "megatronapp.distributed.backend",
    "megatronapp.grad_scaler": "megatronapp.optimizer.grad_scaler",
    "megatronapp.gradients": "megatronapp.optimizer.clip_grads",
    "megatronapp.muon": "megatronapp.optimizer.muon",
    "megatronapp.faults": "megatronapp.resilience.faults",
    "megatronapp.watchdog": "megatronapp.resilience.watchdog",
    "megatronapp.scale_model": "megatronapp.tools.scale_model",
    "megatronapp.fusions": "megatronapp.models.fusions",
    "megatronapp.context_parallel": "megatronapp.models.context_parallel",
    "megatronapp.scope_taps": "megatronapp.models.scope_taps",
}


def alias(old: str, stacklevel: int = 2):
    """Makes `old` name the module it moved to (warning once per import)."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; the old import path is deprecated and will be "
                  "removed in the next release", DeprecationWarning, stacklevel=stacklevel)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
