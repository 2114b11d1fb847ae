"""Context-parallel rank layout: RankGenerator and initialize_model_parallel against hand-written tables
(tests/helpers/cp_helpers.py). The process-group side of these tables (real all-reduces over every CP group and
every getter) runs inside the gloo run of tests/models/test_models_context_parallel.py, which needs those groups
anyway; here only what needs no process."""
import pytest
import torch

from helpers.cp_helpers import CP_LAYOUTS, KIND_TOKENS


@pytest.mark.parametrize("layout", sorted(CP_LAYOUTS), ids=lambda k: "w{}-tp{}-cp{}-pp{}-{}".format(*k))
def test_rank_generator_cp_tables(layout):
    from megatron.core.parallel_state import RankGenerator

    world, tp, cp, pp, order = layout
    gen = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=order)
    assert gen.world_size == world
    for kind, expected in CP_LAYOUTS[layout].items():
        assert gen.get_ranks(KIND_TOKENS[kind]) == expected, kind


def test_cp_getters_and_errors_without_processes():
    from megatron.core import parallel_state as ps

    assert ps.get_context_parallel_world_size() == 1 and ps.get_context_parallel_rank() == 0
    assert ps.get_data_parallel_world_size(with_context_parallel=True) == 0  # Megatron's value without dist
    assert ps.get_tensor_and_context_parallel_world_size() == 0
    with pytest.raises(AssertionError, match="not initialized"):
        ps.get_data_parallel_group(with_context_parallel=True)
    with pytest.raises(AssertionError, match="not initialized"):
        ps.get_context_parallel_global_ranks()
    assert ps.get_context_parallel_global_ranks(check_initialized=False) is None
    with pytest.raises(NotImplementedError, match="hierarchical context parallelism"):
        ps.get_hierarchical_context_parallel_groups()
    with pytest.raises(NotImplementedError, match="hierarchical"):
        ps.initialize_model_parallel(1, 1, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    with pytest.raises(AssertionError, match="intra partial data parallel group is not initialized"):
        ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)


@pytest.mark.parametrize("seq,cp,expected", [
    (8, 2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
    (16, 4, [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]),
    (12, 3, [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]),
    (6, 1, [[0, 1, 2, 3, 4, 5]]),
])
def test_zigzag_split_hand_tables(seq, cp, expected):
    """Megatron's load-balanced split: 2 x CP chunks, rank r keeps chunk r then chunk 2CP-1-r (written by hand)."""
    from megatron.core.transformer.rotary import get_pos_emb_on_this_cp_rank
    from megatron.core.utils import context_parallel_chunk_indices

    for r in range(cp):
        assert context_parallel_chunk_indices(seq, cp, r).tolist() == expected[r]
        angles = torch.arange(seq, dtype=torch.float32)[:, None, None, None] * 0.5
        assert (get_pos_emb_on_this_cp_rank(angles, 0, cp, r)[:, 0, 0, 0] * 2).tolist() == expected[r]
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size"):
        context_parallel_chunk_indices(seq + 1, cp, 0)
