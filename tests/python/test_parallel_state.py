"""Topology façade and clear errors for bad configurations."""

import pytest

import torch
from dist_harness import run_ranks


def _facade(rank, world):
    import megatronapp as mapp
    from megatronapp import parallel_state as ps

    mapp.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    return {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        "first": ps.is_pipeline_first_stage(), "last": ps.is_pipeline_last_stage(),
        "tp_group_size": ps.get_tensor_model_parallel_group().size(),
        "dp_group_size": ps.get_data_parallel_group().size(),
        "pp_group_size": ps.get_pipeline_model_parallel_group().size(),
        "groups": ps.get_parallel_state().group_ranks,
        "next": ps.get_pipeline_model_parallel_next_rank(),
    }


def test_megatron_facade_on_eight_ranks():
    res = run_ranks(_facade, 8)
    for rank, r in enumerate(res):
        tp, dp, pp = rank % 2, (rank // 2) % 2, rank // 4  # rank = pp*dp*tp + dp*tp + tp
        assert r["tp"] == (tp, 2) and r["dp"] == (dp, 2) and r["pp"] == (pp, 2)
        assert r["first"] == (pp == 0) and r["last"] == (pp == 1)
        assert r["tp_group_size"] == r["dp_group_size"] == r["pp_group_size"] == 2
        assert r["groups"]["tp"] == [rank - tp, rank - tp + 1]
        assert r["groups"]["pp"] == sorted([rank % 4, rank % 4 + 4])
        first = rank % 4 - tp  # tensor-rank-0 member of this stage's tp group
        assert r["groups"]["mp"] == sorted(x + 4 * p for p in (0, 1) for x in (first, first + 1))
        assert r["next"] == (rank + 4) % 8


def _bad_world(rank, world):
    import megatronapp as mapp

    with pytest.raises(ValueError) as e:
        mapp.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert not mapp.model_parallel_is_initialized()
    return str(e.value)


def test_world_not_divisible_by_tp_times_pp_is_a_clear_error():
    for msg in run_ranks(_bad_world, 2):
        assert "world size 2" in msg and "tensor(2)" in msg and "pipeline(2)" in msg


def _bad_shapes(rank, world):
    import megatronapp as mapp
    from megatronapp.models import GPTConfig, GPTModel
    from megatronapp.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    mapp.initialize_model_parallel(tensor_model_parallel_size=2)
    msgs = []
    for make in (lambda: ColumnParallelLinear(4, 5), lambda: RowParallelLinear(5, 4),
                 lambda: VocabParallelEmbedding(255, 8),
                 lambda: GPTModel(GPTConfig(vocab_size=256, hidden_size=48, num_attention_heads=3)),
                 lambda: GPTModel(GPTConfig(vocab_size=255, hidden_size=32, num_attention_heads=4)),
                 lambda: GPTConfig(vocab_size=256, hidden_size=30, num_attention_heads=4)):
        with pytest.raises(ValueError) as e:
            make()
        msgs.append(str(e.value))
    emb = VocabParallelEmbedding(16, 4)
    with pytest.raises(IndexError, match=r"\[0, 16\), got values in \[3, 16\]"):
        emb(torch.tensor([[3, 16]]))
    from megatronapp.tensor_parallel import vocab_parallel_cross_entropy

    with pytest.raises(IndexError, match=r"target ids must lie in \[0, 16\).*found \[20\]"):
        vocab_parallel_cross_entropy(torch.zeros(2, 8), torch.tensor([1, 20]))
    return msgs


def test_sizes_not_divisible_by_tp_are_clear_errors():
    msgs = run_ranks(_bad_shapes, 2)[0]
    assert "out_features (5)" in msgs[0] and "tensor-parallel size (2)" in msgs[0]
    assert "in_features (5)" in msgs[1]
    assert "num_embeddings" in msgs[2] and "(255)" in msgs[2]
    assert "num_attention_heads (3)" in msgs[3]
    assert "vocab_size (255)" in msgs[4]
    assert "hidden_size (30)" in msgs[5] and "num_attention_heads (4)" in msgs[5]


def test_layers_before_initialize_say_what_to_call():
    import megatronapp as mapp
    from megatronapp.tensor_parallel import ColumnParallelLinear

    assert not mapp.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ColumnParallelLinear(8, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        mapp.initialize_model_parallel(tensor_model_parallel_size=2)


def test_rank_grid_binding():
    import megatronapp as mapp

    g = mapp.RankGrid(16, tp=2, pp=4)
    assert (g.tp, g.dp, g.pp) == (2, 2, 4)
    assert g.group(5, ["tp"]) == [4, 5]
    assert sorted(sum(g.groups(["dp"]), [])) == list(range(16))
    with pytest.raises(ValueError, match="world size 16"):
        mapp.RankGrid(16, tp=3)


def test_errors_name_repository_paths_not_the_build_machine():
    import pathlib

    import megatronapp as mapp

    with pytest.raises(ValueError) as e:
        mapp.RankGrid(3, tp=2)
    msg = str(e.value)
    assert "[src/topology/rank_grid.cc:" in msg, msg
    assert str(pathlib.Path(__file__).resolve().parents[2]) not in msg  # the checkout
