"""Every tensor-parallel module against the single-process PyTorch module built
from the same full weights, on 2 and 4 real Gloo ranks: forward output, input
gradient and weight gradients within 1e-5 (float32), with and without sequence
parallelism."""

import pytest
import torch.nn.functional as F

import torch
from dist_harness import run_ranks

ATOL, RTOL = 1e-5, 1e-5


def _close(name, got, want, failures):
    if got.shape != want.shape:
        failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    elif not torch.allclose(got, want, atol=ATOL, rtol=RTOL):
        failures.append(f"{name}: max abs err {(got - want).abs().max().item():.3e}")


def _shard(t, dim, rank, world):
    return t.chunk(world, dim=dim)[rank].contiguous()


def _check_column(rank, world, sp, gather_output, failures):
    import megatronapp as mapp
    from megatronapp.tensor_parallel import ColumnParallelLinear

    torch.manual_seed(10)
    s, b, fin, fout = 4 * world, 3, 12, 8 * world
    ref = torch.nn.Linear(fin, fout)
    x = torch.randn(s, b, fin)
    gy = torch.randn(s, b, fout)
    xr = x.clone().requires_grad_()
    (ref(xr) * gy).sum().backward()

    layer = ColumnParallelLinear(fin, fout, gather_output=gather_output, sequence_parallel=sp)
    mapp.tensor_parallel.load_full_state_dict(layer, ref.state_dict())
    assert layer.weight.shape == (fout // world, fin)
    xin = (_shard(x, 0, rank, world) if sp else x).clone().requires_grad_()
    y = layer(xin)
    want_y = ref(x).detach() if gather_output else _shard(ref(x).detach(), -1, rank, world)
    tag = f"column(sp={sp}, gather={gather_output})"
    _close(f"{tag} output", y.detach(), want_y, failures)
    (y * (gy if gather_output else _shard(gy, -1, rank, world))).sum().backward()
    want_gx = _shard(xr.grad, 0, rank, world) if sp else xr.grad
    _close(f"{tag} input grad", xin.grad, want_gx, failures)
    _close(f"{tag} weight grad", layer.weight.grad, _shard(ref.weight.grad, 0, rank, world), failures)
    _close(f"{tag} bias grad", layer.bias.grad, _shard(ref.bias.grad, 0, rank, world), failures)


def _check_row(rank, world, sp, input_is_parallel, failures):
    import megatronapp as mapp
    from megatronapp import _collectives, parallel_state
    from megatronapp.tensor_parallel import RowParallelLinear

    torch.manual_seed(11)
    s, b, fin, fout = 4 * world, 3, 8 * world, 10
    ref = torch.nn.Linear(fin, fout)
    x = torch.randn(s, b, fin)
    gy = torch.randn(s, b, fout)
    xr = x.clone().requires_grad_()
    (ref(xr) * gy).sum().backward()

    layer = RowParallelLinear(fin, fout, input_is_parallel=input_is_parallel, sequence_parallel=sp)
    mapp.tensor_parallel.load_full_state_dict(layer, ref.state_dict())
    assert layer.weight.shape == (fout, fin // world) and layer.bias.shape == (fout,)
    xin = (_shard(x, -1, rank, world) if input_is_parallel else x).clone().requires_grad_()
    y = layer(xin)
    tag = f"row(sp={sp}, input_is_parallel={input_is_parallel})"
    want_y = ref(x).detach()
    _close(f"{tag} output", y.detach(), _shard(want_y, 0, rank, world) if sp else want_y, failures)
    (y * (_shard(gy, 0, rank, world) if sp else gy)).sum().backward()
    _close(f"{tag} input grad", xin.grad,
           _shard(xr.grad, -1, rank, world) if input_is_parallel else xr.grad, failures)
    _close(f"{tag} weight grad", layer.weight.grad, _shard(ref.weight.grad, 1, rank, world), failures)
    bias_grad = layer.bias.grad.clone()
    if sp:  # partial sums per sequence shard; finalize_model_grads adds them up
        assert layer.bias.sequence_parallel
        _collectives.all_reduce_sum_(bias_grad, parallel_state.get_tensor_model_parallel_group())
    _close(f"{tag} bias grad", bias_grad, ref.bias.grad, failures)


def _check_embedding(rank, world, sp, failures):
    import megatronapp as mapp
    from megatronapp.tensor_parallel import VocabParallelEmbedding

    torch.manual_seed(12)
    vocab, dim, s, b = 8 * world, 6, 2 * world, 5
    ref = torch.nn.Embedding(vocab, dim)
    ids = torch.randint(0, vocab, (s, b))
    gy = torch.randn(s, b, dim)
    (ref(ids) * gy).sum().backward()
    layer = VocabParallelEmbedding(vocab, dim, sequence_parallel=sp)
    mapp.tensor_parallel.load_full_state_dict(layer, ref.state_dict())
    assert layer.weight.shape == (vocab // world, dim)
    y = layer(ids)
    want = ref(ids).detach()
    _close(f"embedding(sp={sp}) output", y.detach(),
           _shard(want, 0, rank, world) if sp else want, failures)
    (y * (_shard(gy, 0, rank, world) if sp else gy)).sum().backward()
    _close(f"embedding(sp={sp}) weight grad", layer.weight.grad,
           _shard(ref.weight.grad, 0, rank, world), failures)


def _check_cross_entropy(rank, world, failures):
    from megatronapp.tensor_parallel import vocab_parallel_cross_entropy

    torch.manual_seed(13)
    n, b, vocab = 6, 2, 16 * world
    logits = 3 * torch.randn(n, b, vocab)
    target = torch.randint(0, vocab, (n, b))
    target[0, 0] = -100  # ignored token
    gl = torch.rand(n, b)
    lr = logits.clone().requires_grad_()
    want = F.cross_entropy(lr.reshape(-1, vocab), target.reshape(-1), reduction="none").view(n, b)
    (want * gl).sum().backward()
    local = _shard(logits, -1, rank, world).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target)
    _close("cross_entropy loss", loss.detach(), want.detach(), failures)
    (loss * gl).sum().backward()
    _close("cross_entropy logits grad", local.grad, _shard(lr.grad, -1, rank, world), failures)


def _all_checks(rank, world):
    import megatronapp as mapp

    mapp.initialize_model_parallel(tensor_model_parallel_size=world)
    failures = []
    for sp in (False, True):
        _check_column(rank, world, sp, False, failures)
        _check_row(rank, world, sp, True, failures)
        _check_embedding(rank, world, sp, failures)
    _check_column(rank, world, False, True, failures)
    _check_row(rank, world, False, False, failures)
    _check_cross_entropy(rank, world, failures)
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_tp_modules_match_single_process_reference(world):
    for rank, failures in enumerate(run_ranks(_all_checks, world)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _collectives_on_subgroups(rank, world):
    """The C++ collectives on the grid's groups: all-reduce, all-gather and
    reduce-scatter along a non-zero dim, bfloat16 over Gloo."""
    import megatronapp as mapp
    from megatronapp import _collectives

    state = mapp.initialize_model_parallel(tensor_model_parallel_size=2)
    tp, dp = state.tensor_group, state.data_group
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    x = base + 100 * rank
    out = {}
    out["ar_tp"] = _collectives.all_reduce_sum_(x.clone(), tp)
    out["ar_dp_bf16"] = _collectives.all_reduce_sum_(x.clone().bfloat16(), dp)
    out["ag_dim1"] = _collectives.all_gather(x, 1, tp)
    out["rs_dim1"] = _collectives.reduce_scatter_sum(torch.ones(2, 4) * (rank + 1), 1, tp)
    return {k: v.float() for k, v in out.items()}


def test_collectives_on_grid_groups():
    res = run_ranks(_collectives_on_subgroups, 4)
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    for rank, out in enumerate(res):
        tp_peers = [r for r in range(4) if r // 2 == rank // 2]  # Megatron: tp fastest
        dp_peers = [r for r in range(4) if r % 2 == rank % 2]
        assert torch.equal(out["ar_tp"], sum(base + 100 * r for r in tp_peers))
        assert torch.allclose(out["ar_dp_bf16"], sum(base + 100 * r for r in dp_peers), rtol=1e-2)
        assert torch.equal(out["ag_dim1"], torch.cat([base + 100 * r for r in tp_peers], 1))
        assert torch.equal(out["rs_dim1"], torch.full((2, 2), float(sum(r + 1 for r in tp_peers))))
