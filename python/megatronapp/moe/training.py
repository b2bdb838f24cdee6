"""What training needs to know about experts."""

from __future__ import annotations

import torch


def is_expert(param: torch.Tensor) -> bool:
    """Whether `param` belongs to one expert (sharded over the expert-parallel
    group, reduced over the expert-data-parallel group)."""
    return getattr(param, "expert_parallel", False)


def moe_layers(model) -> list:
    """The MoE layers of `model` (a module or a list of pipeline chunks)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if getattr(m, "is_moe_layer", False)]


@torch.no_grad()
def update_expert_biases(model, data_group=None) -> None:
    """After a step: the aux-loss-free bias update of every router with
    ``moe_router_enable_expert_bias``, from the step's load summed over the
    data-parallel group (every tensor rank saw the same tokens)."""
    for layer in moe_layers(model):
        layer.update_expert_bias(data_group)
