"""What training needs to know about experts."""

from __future__ import annotations

import torch

from .. import _collectives


def is_expert(param: torch.Tensor) -> bool:
    """Whether `param` belongs to one expert (sharded over the expert-parallel
    group, reduced over the expert-data-parallel group)."""
    return getattr(param, "expert_parallel", False)


def moe_layers(model) -> list:
    from .layer import MoELayer
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if isinstance(m, MoELayer)]


@torch.no_grad()
def update_expert_biases(model, data_group=None) -> None:
    """After a step: the aux-loss-free bias update of every router with
    ``moe_router_enable_expert_bias``, from the step's load summed over the
    data-parallel group (every tensor rank saw the same tokens)."""
    for layer in moe_layers(model):
        r = layer.router
        if r.expert_bias is None:
            continue
        load = r.local_tokens_per_expert.clone()
        if data_group is not None and data_group.size() > 1:
            _collectives.all_reduce_sum_(load, data_group)
        r.update_expert_bias(load)
