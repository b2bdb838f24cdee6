"""Autograd around the C++ token dispatcher (``torch.ops.mapp.moe_*``).

    recv, tokens_per_expert, plan = dispatch(x, expert_idx, num_experts, group=ep_group)
    y = experts(recv, tokens_per_expert)
    out = combine(y, probs, plan, group=ep_group)

``dispatch`` permutes this rank's token rows by expert (C++ counting sort),
exchanges the per-expert counts, then the rows (all-to-all with uneven
splits) so that each rank receives the rows of its local experts, grouped by
expert. ``combine`` sends the experts' outputs home and sums each token's k
outputs weighted by its routing probabilities. Their backward passes are each
other's communication (the gradient of the dispatch is a combine without
weights; the gradient of the combine is a dispatch of the output gradient
scaled by the weights, plus the weights' gradient ``<grad_out, y>``).

``compression="int8"`` (``--moe-dispatch-compression``) sends the dispatched
rows as int8 with one float32 scale per block of 256 values of a token row
(the gradient codec's layout), about a quarter of the fp32 bytes; the combine
and every backward exchange stay in full precision (the dispatch's gradient
passes straight through the quantization). Error bound per element:
``|x - q(x)| <= absmax(block) / 254``.
"""

from __future__ import annotations

import torch.distributed as dist

import torch

__all__ = ["dispatch", "combine", "plan_stats"]


def _name(group: dist.ProcessGroup | None) -> str:
    return "" if group is None or group.size() == 1 else group.group_name


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, expert_idx, num_experts, capacity, pad, codec, group_name):
        recv, tpe, plan = torch.ops.mapp.moe_dispatch(x, expert_idx, num_experts, capacity, pad,
                                                      codec, group_name)
        ctx.plan, ctx.group_name = plan, group_name
        ctx.mark_non_differentiable(tpe, plan)
        return recv, tpe, plan

    @staticmethod
    def backward(ctx, grad, _tpe, _plan):
        gx, _ = torch.ops.mapp.moe_combine(grad.contiguous(), ctx.plan, None, ctx.group_name)
        return gx, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, probs, plan, group_name):
        out, y_back = torch.ops.mapp.moe_combine(y, plan, probs, group_name)
        ctx.save_for_backward(probs, y_back)
        ctx.plan, ctx.group_name = plan, group_name
        return out

    @staticmethod
    def backward(ctx, grad):
        probs, y_back = ctx.saved_tensors
        grad = grad.contiguous()
        gy = torch.ops.mapp.moe_dispatch_with_plan(grad, ctx.plan, probs, ctx.group_name)
        gp = None
        if ctx.needs_input_grad[1]:
            gp = torch.ops.mapp.moe_weight_grads(grad, y_back, ctx.plan).to(probs.dtype)
        return gy, gp, None, None


def dispatch(x: torch.Tensor, expert_idx: torch.Tensor, num_experts: int, *,
             capacity: int | None = None, pad: bool = False, compression: str = "none",
             group: dist.ProcessGroup | None = None):
    """Rows of `x` [T, h] to the experts `expert_idx` [T, k] names (-1: not
    sent) over the expert-parallel `group`. Returns ``(recv [R, h],
    tokens_per_local_expert [E/ep] int64 CPU, plan)``."""
    cap = -1 if capacity is None else int(capacity)
    return _Dispatch.apply(x, expert_idx, num_experts, cap, pad, compression or "none",
                           _name(group))


def combine(y: torch.Tensor, probs: torch.Tensor, plan: torch.Tensor, *,
            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The experts' outputs `y` [R, h] home, each token's rows summed with its
    weights `probs` [T, k]: [T, h]."""
    return _Combine.apply(y, probs, plan, _name(group))


def plan_stats(plan: torch.Tensor) -> dict:
    """``{"dropped": assignments over capacity (dropped by the dispatcher),
    "rows": rows sent (padding included), "kept_per_expert": [...]}``."""
    s = torch.ops.mapp.moe_plan_stats(plan)
    return {"dropped": s[0], "rows": s[1], "kept_per_expert": list(s[2:])}
