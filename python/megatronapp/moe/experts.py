"""The local experts: a two-layer MLP per expert, run as one grouped GEMM per
projection (``torch.ops.mapp.moe_grouped_gemm``: a loop of GEMMs on CPU,
cuBLAS's grouped GEMM on CUDA).

Each expert's weights are tensor-parallel like the dense MLP (fc1 split by
output features, fc2 by input features; Megatron's expert tensor parallelism
equal to the tensor-parallel size), so the experts' outputs are partial sums
over the tensor group that the MoE layer reduces once after the combine.
Expert e's full weights are drawn from a generator seeded by (layer seed, e):
the model is the same function at every expert- and tensor-parallel size.
With SwiGLU (``--swiglu``) fc1 is the gate rows then the up rows, each split
over the tensor group (a rank holds ``[gate_r; up_r]``, stacked like the
dense MLP's fc1), and the activation is silu(gate) * up.
"""

from __future__ import annotations

import torch.nn.functional as F

import torch
from torch import nn

from ..tensor_parallel.utils import set_tensor_model_parallel_attributes


class _GroupedLinear(torch.autograd.Function):
    """y = x_e W_e^T for each expert's block of rows."""

    @staticmethod
    def forward(ctx, x, counts, *weights):
        ctx.save_for_backward(x, *weights)
        ctx.counts = counts
        return torch.ops.mapp.moe_grouped_gemm(x, counts, list(weights), True)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        gx = torch.ops.mapp.moe_grouped_gemm(grad, ctx.counts, weights, False)
        gws, lo = [], 0
        for w, m in zip(weights, ctx.counts, strict=True):
            if m:
                gws.append(grad[lo:lo + m].t().mm(x[lo:lo + m]))
            else:
                gws.append(torch.zeros_like(w))
            lo += m
        return (gx, None, *gws)


def grouped_linear(x: torch.Tensor, counts: list[int], weights: list[torch.Tensor]):
    return _GroupedLinear.apply(x, counts, *weights)


class Expert(nn.Module):
    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor):
        super().__init__()
        self.fc1 = nn.Parameter(fc1)
        self.fc2 = nn.Parameter(fc2)


class GroupedMLP(nn.Module):
    """Experts ``first .. first + num_local - 1`` of `num_experts`; their
    parameters are ``experts.<global id>.fc1`` [ffn/tp, h] and ``.fc2``
    [h, ffn/tp], marked ``expert_parallel`` (reduced over the
    expert-data-parallel group)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, first: int, num_local: int,
                 *, tp_size: int, tp_rank: int, seed: int, init_std: float, output_std: float,
                 swiglu: bool = False):
        super().__init__()
        self.swiglu = swiglu
        gate = 2 if swiglu else 1
        if ffn_hidden_size % tp_size:
            raise ValueError(f"moe ffn hidden size {ffn_hidden_size} is not divisible by the "
                             f"tensor-parallel size {tp_size}")
        shard = ffn_hidden_size // tp_size
        lo = tp_rank * shard
        self.ids = list(range(first, first + num_local))
        experts = {}
        for e in self.ids:
            g = torch.Generator().manual_seed((seed * 1_000_003 + 104_729 * (e + 1)) % (2**63 - 1))
            fc1 = torch.empty(gate, ffn_hidden_size, hidden_size).normal_(0.0, init_std,
                                                                          generator=g)
            fc2 = torch.empty(hidden_size, ffn_hidden_size).normal_(0.0, output_std, generator=g)
            ex = Expert(fc1[:, lo:lo + shard].reshape(gate * shard, hidden_size).clone(),
                        fc2[:, lo:lo + shard].clone())
            if swiglu:
                set_tensor_model_parallel_attributes(ex.fc1, 1)
                ex.fc1.partition_view = (2, shard, hidden_size)
            else:
                set_tensor_model_parallel_attributes(ex.fc1, 0)
            set_tensor_model_parallel_attributes(ex.fc2, 1)
            for p in ex.parameters():
                p.expert_parallel = True
            experts[str(e)] = ex
        self.experts = nn.ModuleDict(experts)

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        ex = [self.experts[str(e)] for e in self.ids]
        h = grouped_linear(x, tokens_per_expert, [m.fc1 for m in ex])
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return grouped_linear(h, tokens_per_expert, [m.fc2 for m in ex])
