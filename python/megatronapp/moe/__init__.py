"""Mixture of experts with expert parallelism (``--num-experts``).

* :class:`Router` — top-k softmax or sigmoid (+ DeepSeek-V3 expert bias)
  routing, the auxiliary load-balancing and z losses, capacity and token
  dropping (``megatronapp.moe.router``).
* :func:`dispatch` / :func:`combine` — the token dispatcher over the
  expert-parallel group (C++ operators ``torch.ops.mapp.moe_dispatch`` /
  ``moe_combine``; all-to-all with uneven splits; optional int8 dispatch).
* :class:`GroupedMLP` — the local experts, one grouped GEMM per projection.
* :class:`MoELayer` — the transformer's MLP replaced by all of the above;
  ``GPTConfig(num_experts=...)`` builds it every ``moe_layer_freq`` layers.

See docs/moe.md.
"""

from .dispatcher import combine, dispatch, plan_stats
from .experts import GroupedMLP, grouped_linear
from .layer import AuxLoss, MoELayer, aux_loss_scale, set_aux_loss_scale
from .router import Router
from .training import is_expert, moe_layers, update_expert_biases

__all__ = ["Router", "dispatch", "combine", "plan_stats", "GroupedMLP", "grouped_linear",
           "MoELayer", "AuxLoss", "aux_loss_scale", "set_aux_loss_scale", "is_expert",
           "moe_layers", "update_expert_biases"]
