"""Rank layout of parallel_state against tables written by hand from Megatron's documented layout.

Each layout's tables list every group of every kind. The expected per-rank values (tp/pp/dp rank, src
ranks, next/prev, first/last stage, embedding membership) are derived in the test from these hand tables,
and every group is exercised with a real all-reduce to show the process groups match the tables.
"""
import pytest
import torch

from helpers.dist_harness import run_distributed

# (world, tp, pp, vpp) -> hand-written group tables.
LAYOUTS = {
    (8, 2, 2, None): {  # TP groups: consecutive ranks; DP: stride TP; PP: stride TP*DP
        "tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "data": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pipeline": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "model": [[0, 1, 4, 5], [2, 3, 6, 7]],
        "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "position_embedding": [[0], [1], [2], [3]],
    },
    (8, 2, 4, None): {
        "tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "data": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "pipeline": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "model": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "embedding": [[0, 6], [1, 7]],
        "position_embedding": [[0], [1]],
    },
    (8, 4, 1, None): {
        "tensor": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "data": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "pipeline": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "model": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "embedding": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "position_embedding": [[0], [1], [2], [3], [4], [5], [6], [7]],
    },
    (8, 1, 8, None): {
        "tensor": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "data": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "pipeline": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "model": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "embedding": [[0, 7]],
        "position_embedding": [[0]],
    },
    (8, 1, 4, 2): {
        "tensor": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "data": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pipeline": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "model": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "embedding": [[0, 6], [1, 7]],
        "position_embedding": [[0], [1]],
    },
    (4, 1, 2, None): {
        "tensor": [[0], [1], [2], [3]],
        "data": [[0, 1], [2, 3]],
        "pipeline": [[0, 2], [1, 3]],
        "model": [[0, 2], [1, 3]],
        "embedding": [[0, 2], [1, 3]],
        "position_embedding": [[0], [1]],
    },
}

GROUP_GETTERS = {
    "tensor": "get_tensor_model_parallel_group",
    "data": "get_data_parallel_group",
    "pipeline": "get_pipeline_model_parallel_group",
    "model": "get_model_parallel_group",
    "embedding": "get_embedding_group",
    "position_embedding": "get_position_embedding_group",
}


def _mine(groups, rank):
    found = [g for g in groups if rank in g]
    assert len(found) == 1, f"rank {rank} in {len(found)} groups of {groups}"
    return found[0]


def _check_layout(world, tp, pp, vpp, tables):
    """Runs on every rank; raises AssertionError with a precise message on any mismatch."""
    from megatron.core import parallel_state as ps

    rank = torch.distributed.get_rank()
    ps.initialize_model_parallel(tp, pp, vpp)
    try:
        # The group tables the library reports.
        reported = ps.get_all_group_ranks()
        for kind, groups in tables.items():
            assert reported[kind] == groups, f"{kind}: got {reported[kind]}, expected {groups}"

        # Real process groups: all-reduce of (rank + 1) equals the sum over the hand-written group.
        for kind, getter in GROUP_GETTERS.items():
            if not any(rank in g for g in tables[kind]):
                continue  # e.g. middle pipeline stages hold no embedding
            group_ranks = _mine(tables[kind], rank)
            t = torch.tensor([float(rank + 1)])
            torch.distributed.all_reduce(t, group=getattr(ps, getter)())
            assert t.item() == sum(r + 1 for r in group_ranks), f"{kind} all-reduce on rank {rank}"
        dp_ranks = _mine(tables["data"], rank)
        t = torch.tensor([float(rank + 1)])
        torch.distributed.all_reduce(t, group=ps.get_data_parallel_group_gloo())
        assert t.item() == sum(r + 1 for r in dp_ranks)

        tp_ranks = _mine(tables["tensor"], rank)
        pp_ranks = _mine(tables["pipeline"], rank)
        emb_ranks = _mine(tables["embedding"], rank) if any(rank in g for g in tables["embedding"]) else []
        pos_ranks = [g for g in tables["position_embedding"] if rank in g]
        pp_rank = pp_ranks.index(rank)

        assert ps.model_parallel_is_initialized()
        assert ps.get_tensor_model_parallel_world_size() == tp == len(tp_ranks)
        assert ps.get_tensor_model_parallel_rank() == tp_ranks.index(rank)
        assert ps.get_tensor_model_parallel_src_rank() == tp_ranks[0]
        assert ps.get_pipeline_model_parallel_world_size() == pp == len(pp_ranks)
        assert ps.get_pipeline_model_parallel_rank() == pp_rank
        assert ps.get_data_parallel_world_size() == len(dp_ranks) == world // (tp * pp)
        assert ps.get_data_parallel_rank() == dp_ranks.index(rank)
        assert ps.get_data_parallel_src_rank() == dp_ranks[0]
        assert ps.get_pipeline_model_parallel_first_rank() == pp_ranks[0]
        assert ps.get_pipeline_model_parallel_last_rank() == pp_ranks[-1]
        assert ps.get_pipeline_model_parallel_next_rank() == pp_ranks[(pp_rank + 1) % pp]
        assert ps.get_pipeline_model_parallel_prev_rank() == pp_ranks[(pp_rank - 1) % pp]
        assert ps.get_virtual_pipeline_model_parallel_world_size() == vpp
        assert ps.get_virtual_pipeline_model_parallel_rank() == (0 if vpp else None)
        assert ps.is_rank_in_position_embedding_group() == bool(pos_ranks)

        if vpp is None:
            assert ps.is_pipeline_first_stage() == (pp_rank == 0)
            assert ps.is_pipeline_last_stage() == (pp_rank == pp - 1)
            assert ps.is_rank_in_embedding_group() == (rank in emb_ranks)
        else:
            # Walk the virtual chunks: only chunk 0 of stage 0 is "first", only the last chunk of the last
            # stage is "last"; ignore_virtual looks at the physical stage only.
            for v in range(vpp):
                ps.set_virtual_pipeline_model_parallel_rank(v)
                assert ps.is_pipeline_first_stage() == (pp_rank == 0 and v == 0), (rank, v)
                assert ps.is_pipeline_last_stage() == (pp_rank == pp - 1 and v == vpp - 1), (rank, v)
                assert ps.is_pipeline_first_stage(ignore_virtual=True) == (pp_rank == 0)
                assert ps.is_pipeline_last_stage(ignore_virtual=True) == (pp_rank == pp - 1)
                expected_emb = bool(emb_ranks) and (
                    (rank == emb_ranks[0] and v == 0) or (rank == emb_ranks[-1] and v == vpp - 1))
                assert ps.is_rank_in_embedding_group() == expected_emb, (rank, v)
                assert ps.is_rank_in_embedding_group(ignore_virtual=True) == (rank in emb_ranks)
            ps.set_virtual_pipeline_model_parallel_rank(0)

        # Overrides take precedence over the groups (used by offline tools and --lazy-mpu-init).
        ps.set_tensor_model_parallel_world_size(16)
        ps.set_tensor_model_parallel_rank(5)
        ps.set_pipeline_model_parallel_world_size(3)
        ps.set_pipeline_model_parallel_rank(2)
        assert ps.get_tensor_model_parallel_world_size() == 16
        assert ps.get_tensor_model_parallel_rank() == 5
        assert ps.get_pipeline_model_parallel_world_size() == 3
        assert ps.get_pipeline_model_parallel_rank() == 2
        assert ps.is_pipeline_last_stage(ignore_virtual=True)
    finally:
        ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    return True


def all_layouts_body(layouts):
    for (world, tp, pp, vpp) in layouts:
        _check_layout(world, tp, pp, vpp, LAYOUTS[(world, tp, pp, vpp)])
    return True


def test_rank_layouts_world_8():
    layouts = [k for k in LAYOUTS if k[0] == 8]
    assert all(run_distributed(all_layouts_body, 8, layouts, timeout=120))


def errors_body():
    """Misconfigurations raise clear errors, and the process group stays usable afterwards."""
    from megatron.core import parallel_state as ps

    out = {}
    for name, kwargs in {
        "tp_too_big": dict(tensor_model_parallel_size=8),
        "not_divisible": dict(tensor_model_parallel_size=3),
        "pp_too_big": dict(pipeline_model_parallel_size=8),
        "tp_pp_product": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4),
        "vpp_few_stages": dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        "split_rank": dict(pipeline_model_parallel_size=2, pipeline_model_parallel_split_rank=5),
    }.items():
        try:
            ps.initialize_model_parallel(**kwargs)
        except RuntimeError as e:
            out[name] = str(e)
        finally:
            ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 1)
    try:
        ps.initialize_model_parallel(2, 1)
    except AssertionError as e:
        out["reinit"] = str(e)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2)
    assert ps.get_pipeline_model_parallel_world_size() == 2
    ps.destroy_model_parallel()
    return out


def test_initialize_errors_and_world_4_layout():
    outs = run_distributed(errors_body, 4)
    for out in outs:
        assert "not divisible" in out["tp_too_big"] and "tensor_model_parallel_size (8)" in out["tp_too_big"]
        assert "world_size (4) is not divisible" in out["not_divisible"]
        assert "pipeline_model_parallel_size (8)" in out["pp_too_big"]
        assert "tensor_model_parallel_size (2) x pipeline_model_parallel_size (4)" in out["tp_pp_product"]
        assert "greater than 2 with interleaved schedule" in out["vpp_few_stages"]
        assert "pipeline_model_parallel_split_rank (5)" in out["split_rank"]
        assert "destroy_model_parallel" in out["reinit"]
    assert all(run_distributed(all_layouts_body, 4, [(4, 1, 2, None)]))


def test_split_rank_embedding_groups():
    """Encoder-decoder split: the split stage joins the embedding and position-embedding groups."""
    from megatron.core.parallel_state import embedding_ranks_of

    assert embedding_ranks_of([0, 2, 4, 6], None) == ([0, 6], [0])
    assert embedding_ranks_of([0, 2, 4, 6], 2) == ([0, 4, 6], [0, 4])
    assert embedding_ranks_of([0, 2, 4, 6], 0) == ([0, 6], [0])
    assert embedding_ranks_of([3], 0) == ([3], [3])


@pytest.mark.parametrize("order,token,expected", [
    ("tp-cp-ep-dp-pp", "dp", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("tp-cp-ep-dp-pp", "tp-pp", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    ("tp-cp-ep-dp-pp", "pp", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("tp-pp-dp", "dp", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("tp-pp-dp", "pp", [[0, 2], [1, 3], [4, 6], [5, 7]]),
])
def test_rank_generator_orders(order, token, expected):
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order=order)
    assert gen.get_ranks(token) == expected


def test_rank_generator_with_context_dimension():
    """A context-parallel dimension slots between TP and DP without changing the other formulas."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert gen.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(RuntimeError, match="must name 'cp'"):
        RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=2, order="tp-dp-pp")


def test_getters_before_initialization():
    from megatron.core import parallel_state as ps

    assert not ps.model_parallel_is_initialized()
    assert ps.get_data_parallel_world_size() == 0  # Megatron's value without torch.distributed
    assert ps.get_data_parallel_rank() == 0
    with pytest.raises(AssertionError, match="not initialized"):
        ps.get_tensor_model_parallel_group()
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(AssertionError, match="init_process_group"):
        ps.initialize_model_parallel(1, 1)
