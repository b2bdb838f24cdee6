"""The router: which experts each token goes to, with what weight, and the
losses that keep the experts evenly loaded.

Megatron-Core's semantics and flag names:

* ``softmax`` scores (default): top-k of the logits, then a softmax over the
  k chosen (``moe_router_pre_softmax=True``: softmax over all experts, then
  top-k of the probabilities, as Mixtral).
* ``sigmoid`` scores with ``moe_router_enable_expert_bias`` (DeepSeek-V3's
  auxiliary-loss-free balancing): the experts are chosen by sigmoid score +
  a per-expert bias that is not trained by gradient but nudged after every
  step towards the mean load (:meth:`Router.update_expert_bias`); the weights
  are the chosen sigmoid scores, normalized over the k.
* ``aux_loss``: Switch/GShard load balancing, ``coeff * E * sum_e f_e P_e``
  with ``f_e`` the fraction of the k * T assignments routed to e and ``P_e``
  the mean probability of e; ``moe_z_loss_coeff``: ST-MoE's
  ``mean(logsumexp(logits)^2)``.
* ``seq_aux_loss`` (DeepSeek-V3's complementary sequence-wise balance loss):
  the same ``coeff * E / k * sum_e f_e P_e`` within each sequence (``f_e``
  the sequence's assignments to e over its length, ``P_e`` the mean of its
  normalized scores), averaged over the sequences; the router is told the
  tokens' [s, b] layout.
* Group-limited routing (``moe_router_num_groups`` G, ``moe_router_group_topk``
  g; DeepSeek-V3's node-limited routing): the experts form G equal groups
  (with expert parallelism, e.g. one per node); a group scores the sum of
  its k / g best selection scores, each token keeps its g best groups and
  picks its top-k experts among them, so it reaches at most g groups.
* Capacity (``moe_expert_capacity_factor``): an expert takes at most
  ``ceil(T * k / E * factor)`` of this rank's T tokens; the rest are dropped
  (``moe_token_drop_policy``: ``probs`` keeps the highest weights, Megatron's
  default; ``position`` the first in token order).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Router(nn.Module):
    """``forward(x [T, h]) -> (probs [T, k], expert_idx [T, k] int64, aux [scalar])``.

    ``expert_idx`` is -1 where capacity dropped the assignment (its weight is
    then 0). ``aux`` is the weighted sum of the load-balancing and z losses
    (a differentiable scalar; 0 when both are off). Statistics of the last
    forward, as tensors: :attr:`last_load` (assignments per expert before
    dropping), :attr:`last_dropped`."""

    #: not parameters, but state a resume needs (see megatronapp.checkpoint)
    _checkpointed_buffers = ("expert_bias",)

    def __init__(self, hidden_size: int, num_experts: int, topk: int, *,
                 score_function: str = "softmax", pre_softmax: bool = False,
                 load_balancing_type: str = "aux_loss", aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float | None = None, capacity_factor: float | None = None,
                 drop_policy: str = "probs", enable_expert_bias: bool = False,
                 bias_update_rate: float = 1e-3, init_std: float = 0.02,
                 topk_scaling_factor: float | None = None, num_groups: int | None = None,
                 group_topk: int | None = None):
        super().__init__()
        if (num_groups is None) != (group_topk is None):
            raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together "
                             "(group-limited routing needs both)")
        if num_groups is not None:
            if num_groups < 1 or num_experts % num_groups:
                raise ValueError(f"--moe-router-num-groups {num_groups} must divide --num-experts "
                                 f"{num_experts} (equal groups of experts)")
            if not 1 <= group_topk <= num_groups or topk % group_topk or \
                    topk // group_topk > num_experts // num_groups:
                raise ValueError(f"--moe-router-group-topk {group_topk} must lie in [1, "
                                 f"--moe-router-num-groups {num_groups}] and divide "
                                 f"--moe-router-topk {topk}, with topk / group_topk <= experts "
                                 f"per group ({num_experts // num_groups})")
        self.num_groups, self.group_topk = num_groups, group_topk
        if topk_scaling_factor is not None and topk_scaling_factor <= 0:
            raise ValueError(f"--moe-router-topk-scaling-factor must be > 0, got "
                             f"{topk_scaling_factor}")
        self.topk_scaling_factor = topk_scaling_factor
        if not 1 <= topk <= num_experts:
            raise ValueError(f"--moe-router-topk {topk} must be in [1, --num-experts "
                             f"{num_experts}]")
        if score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"--moe-router-score-function {score_function!r}: expected "
                             "softmax or sigmoid")
        if load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
            raise ValueError(f"--moe-router-load-balancing-type {load_balancing_type!r}: "
                             "expected aux_loss, seq_aux_loss or none")
        if drop_policy not in ("probs", "position"):
            raise ValueError(f"--moe-token-drop-policy {drop_policy!r}: expected probs or "
                             "position")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"--moe-expert-capacity-factor must be > 0, got {capacity_factor}")
        self.num_experts, self.topk = num_experts, topk
        self.score_function, self.pre_softmax = score_function, pre_softmax
        self.load_balancing_type = load_balancing_type
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.bias_update_rate = bias_update_rate
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, 0.0, init_std)
        if enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
            self.register_buffer("local_tokens_per_expert", torch.zeros(num_experts))
        else:
            self.expert_bias = None
        self.last_load: torch.Tensor | None = None
        self.last_dropped = 0
        from ..resilience.faults import expert_skew

        skew = expert_skew()
        self._skew = None
        if skew is not None:
            if not 0 <= skew["expert"] < num_experts:
                raise ValueError(f"MAPP_INJECT_EXPERT_SKEW: expert {skew['expert']} outside "
                                 f"[0, {num_experts})")
            self._skew = torch.zeros(num_experts)
            self._skew[skew["expert"]] = skew["boost"]

    def capacity(self, tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(tokens * self.topk / self.num_experts * self.capacity_factor)

    def _topk(self, scores: torch.Tensor, k: int):
        """torch.topk over the experts, limited to each token's best groups
        when group-limited routing is on."""
        if self.num_groups is None:
            return torch.topk(scores, k, dim=-1)
        T, G = scores.shape[0], self.num_groups
        grouped = scores.view(T, G, -1)
        group_score = grouped.topk(k // self.group_topk, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.group_topk, dim=-1).indices, True)
        masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)
        return torch.topk(masked, k, dim=-1)

    def forward(self, x: torch.Tensor, seq_shape: tuple | None = None, seq_group=None):
        """`seq_shape`: (s, b) of the tokens x [s * b, h] (needed by seq_aux_loss).
        `seq_group`: the ranks holding the other parts of the same b sequences
        (context parallelism): seq_aux_loss counts the assignments over the whole
        sequences, and this rank's loss is its share of each sequence's sum of
        scores times the group's size (the context ranks' gradients are averaged)."""
        logits = torch.nn.functional.linear(x.float(), self.weight.float())  # [T, E], fp32
        if self._skew is not None:  # fault injection (MAPP_INJECT_EXPERT_SKEW)
            logits = logits + self._skew
        T, E, k = logits.shape[0], self.num_experts, self.topk
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            select = scores if self.expert_bias is None else scores + self.expert_bias
            idx = self._topk(select.detach(), k).indices
            probs = scores.gather(1, idx)
            if k > 1:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
            full = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        elif self.pre_softmax:
            full = torch.softmax(logits, dim=-1)
            probs, idx = self._topk(full, k)
        else:
            top, idx = self._topk(logits, k)
            probs = torch.softmax(top, dim=-1)
            full = torch.softmax(logits, dim=-1)
        load = torch.zeros(E, dtype=torch.float32, device=x.device)
        load.scatter_add_(0, idx.reshape(-1), torch.ones(T * k, device=x.device))
        self.last_load = load.detach()
        if self.expert_bias is not None and self.training:
            self.local_tokens_per_expert += load.detach()
        aux = logits.new_zeros(())
        if self.load_balancing_type == "aux_loss" and self.aux_loss_coeff > 0 and T > 0:
            aux = aux + self.aux_loss_coeff * E * (full.mean(0) * (load / (T * k))).sum()
        if self.load_balancing_type == "seq_aux_loss" and self.aux_loss_coeff > 0 and T > 0:
            if seq_shape is None or seq_shape[0] * seq_shape[1] != T:
                raise ValueError(f"seq_aux_loss needs the [s, b] layout of the {T} tokens, got "
                                 f"{seq_shape}")
            s, b = seq_shape
            counts = torch.zeros(T, E, device=x.device).scatter_(1, idx, 1.0).view(s, b, E).sum(0)
            n = seq_group.size() if seq_group is not None else 1
            if n > 1:  # the whole sequences' assignments (not differentiated)
                from .. import _collectives

                _collectives.all_reduce_sum_(counts, seq_group)
            f = counts * (E / (k * s * n))  # [b, E]
            # this rank's mean score: n x its share of the whole sequence's mean
            p = full.view(s, b, E).mean(0)
            aux = aux + self.aux_loss_coeff * (f * p).sum(-1).mean()
        if self.z_loss_coeff and T > 0:
            aux = aux + self.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
        if self.topk_scaling_factor is not None:  # --moe-router-topk-scaling-factor
            probs = probs * self.topk_scaling_factor
        idx, probs = self._apply_capacity(idx, probs, T)
        return probs, idx, aux

    def _apply_capacity(self, idx, probs, T):
        cap = self.capacity(T)
        self.last_dropped = 0
        if cap is None:
            return idx, probs
        E = self.num_experts
        if self.drop_policy == "position":
            # Token order: the assignment's rank among those to its expert.
            onehot = torch.nn.functional.one_hot(idx.reshape(-1), E)  # [T*k, E]
            rank = (onehot.cumsum(0) - 1).gather(1, idx.reshape(-1, 1)).view_as(idx)
            keep = rank < cap
        else:  # probs: each expert keeps its `cap` highest-weight assignments
            w = torch.full((T, E), -1.0, device=idx.device)
            w.scatter_(1, idx, probs.detach().float())
            kept = torch.zeros_like(w, dtype=torch.bool)
            if cap > 0 and T > 0:
                top = torch.topk(w, min(cap, T), dim=0).indices  # [cap, E]
                kept.scatter_(0, top, True)
            kept &= w >= 0
            keep = kept.gather(1, idx)
        self.last_dropped = (~keep).sum()  # a tensor: no host synchronization
        return torch.where(keep, idx, torch.full_like(idx, -1)), probs * keep

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: bias += rate * sign(mean
        load - load) for the global (data-parallel summed) load of a step."""
        if self.expert_bias is None:
            return
        err = tokens_per_expert.float().mean() - tokens_per_expert.float()
        self.expert_bias += self.bias_update_rate * torch.sign(err)
        self.local_tokens_per_expert.zero_()
