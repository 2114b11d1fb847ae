"""Expert (mixture-of-experts) rank layout of parallel_state against hand-written tables.

The tables follow megatron-core's documented expert grid ``(tp=ETP, cp=1, ep=EP, dp=EDP, pp=PP)`` over the
order ``tp-cp-ep-dp-pp`` (first dimension fastest), worked out by hand: e.g. with W=8, TP=2, EP=2 a rank r has
etp = r % 2, ep = (r // 2) % 2, edp = r // 4. The generator is checked without processes; one 4-rank gloo run
then re-initializes three 4-rank layouts and checks each group with a real all-reduce and every getter.
"""
import pytest
import torch

from helpers.dist_harness import run_distributed

S = [[r] for r in range(8)]
# (world, tp, pp, ep, etp) -> expert group tables.
EXPERT_LAYOUTS = {
    (8, 2, 1, 2, None): {  # reference §3.6 worked example
        "expert_tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expert_model": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "expert_tensor_and_model": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expert_tensor_model_pipeline": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expert_data": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (8, 2, 2, 4, 1): {  # rank = ep + 4 * pp
        "expert_tensor": S,
        "expert_model": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expert_tensor_and_model": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expert_tensor_model_pipeline": [list(range(8))],
        "expert_data": S,
    },
    (8, 1, 2, 2, 1): {  # rank = ep + 2 * edp + 4 * pp
        "expert_tensor": S,
        "expert_model": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expert_tensor_and_model": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expert_tensor_model_pipeline": [[0, 1, 4, 5], [2, 3, 6, 7]],
        "expert_data": [[0, 2], [1, 3], [4, 6], [5, 7]],
    },
    (8, 1, 1, 4, 2): {  # expert TP wider than dense TP: rank = etp + 2 * ep
        "expert_tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expert_model": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "expert_tensor_and_model": [list(range(8))],
        "expert_tensor_model_pipeline": [list(range(8))],
        "expert_data": S,
    },
    (8, 1, 1, 1, None): {  # no expert parallelism: expert DP = the whole world
        "expert_tensor": S,
        "expert_model": S,
        "expert_tensor_and_model": S,
        "expert_tensor_model_pipeline": S,
        "expert_data": [list(range(8))],
    },
    (4, 2, 1, 2, None): {  # expert TP = TP = 2: rank = etp + 2 * ep, no expert DP
        "expert_tensor": [[0, 1], [2, 3]],
        "expert_model": [[0, 2], [1, 3]],
        "expert_tensor_and_model": [[0, 1, 2, 3]],
        "expert_tensor_model_pipeline": [[0, 1, 2, 3]],
        "expert_data": [[0], [1], [2], [3]],
    },
    (4, 1, 2, 2, 1): {  # PP 2: rank = ep + 2 * pp
        "expert_tensor": [[0], [1], [2], [3]],
        "expert_model": [[0, 1], [2, 3]],
        "expert_tensor_and_model": [[0, 1], [2, 3]],
        "expert_tensor_model_pipeline": [[0, 1, 2, 3]],
        "expert_data": [[0], [1], [2], [3]],
    },
    (4, 2, 1, 2, 1): {  # rank = ep + 2 * edp
        "expert_tensor": [[0], [1], [2], [3]],
        "expert_model": [[0, 1], [2, 3]],
        "expert_tensor_and_model": [[0, 1], [2, 3]],
        "expert_tensor_model_pipeline": [[0, 1], [2, 3]],
        "expert_data": [[0, 2], [1, 3]],
    },
}
TOKENS = {"expert_tensor": "tp", "expert_model": "ep", "expert_tensor_and_model": "tp-ep",
          "expert_tensor_model_pipeline": "tp-ep-pp", "expert_data": "dp"}
GETTERS = {
    "expert_tensor": "get_expert_tensor_parallel_group",
    "expert_model": "get_expert_model_parallel_group",
    "expert_tensor_and_model": "get_expert_tensor_and_model_parallel_group",
    "expert_tensor_model_pipeline": "get_expert_tensor_model_pipeline_parallel_group",
    "expert_data": "get_expert_data_parallel_group",
}


@pytest.mark.parametrize("layout", list(EXPERT_LAYOUTS))
def test_expert_rank_generator_tables(layout):
    from megatron.core.parallel_state import expert_rank_generator

    world, tp, pp, ep, etp = layout
    gen = expert_rank_generator(world, tp, pp, ep, etp)
    for kind, token in TOKENS.items():
        assert gen.get_ranks(token) == EXPERT_LAYOUTS[layout][kind], kind


def test_expert_rank_generator_errors():
    from megatron.core.parallel_state import expert_rank_generator

    with pytest.raises(RuntimeError, match=r"world_size \(8\) is not divisible by expert_tensor_parallel_size \(2\) x "
                                           r"expert_model_parallel_size \(3\)"):
        expert_rank_generator(8, 2, 1, 3)


def _mine(groups, rank):
    found = [g for g in groups if rank in g]
    assert len(found) == 1
    return found[0]


def expert_layouts_body(layouts):
    from megatron.core import parallel_state as ps

    rank = torch.distributed.get_rank()
    for (world, tp, pp, ep, etp) in layouts:
        tables = EXPERT_LAYOUTS[(world, tp, pp, ep, etp)]
        ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        try:
            reported = ps.get_all_group_ranks()
            for kind, getter in GETTERS.items():
                assert reported[kind] == tables[kind], (kind, reported[kind])
                mine = _mine(tables[kind], rank)
                t = torch.tensor([float(rank + 1)])
                torch.distributed.all_reduce(t, group=getattr(ps, getter)())
                assert t.item() == sum(r + 1 for r in mine), (kind, rank)
            edp = _mine(tables["expert_data"], rank)
            t = torch.tensor([float(rank + 1)])
            torch.distributed.all_reduce(t, group=ps.get_expert_data_parallel_group_gloo())
            assert t.item() == sum(r + 1 for r in edp)
            epg = _mine(tables["expert_model"], rank)
            etpg = _mine(tables["expert_tensor"], rank)
            tpep = _mine(tables["expert_tensor_and_model"], rank)
            assert ps.get_expert_model_parallel_world_size() == ep == len(epg)
            assert ps.get_expert_model_parallel_rank() == epg.index(rank)
            assert ps.get_expert_model_parallel_src_rank() == epg[0]
            assert ps.get_expert_tensor_parallel_world_size() == len(etpg) == (etp or tp)
            assert ps.get_expert_tensor_parallel_rank() == etpg.index(rank)
            assert ps.get_expert_tensor_and_model_parallel_world_size() == len(tpep)
            assert ps.get_expert_tensor_and_model_parallel_rank() == tpep.index(rank)
            assert ps.get_expert_data_parallel_world_size() == len(edp)
            assert ps.get_expert_data_parallel_rank() == edp.index(rank)
            # Overrides (offline tools) take precedence.
            ps.set_expert_model_parallel_world_size(16)
            ps.set_expert_model_parallel_rank(3)
            ps.set_expert_tensor_parallel_world_size(5)
            ps.set_expert_tensor_parallel_rank(4)
            assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (16, 3)
            assert (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()) == (5, 4)
        finally:
            ps.destroy_model_parallel()
        assert ps.get_expert_model_parallel_group(check_initialized=False) is None
    return True


def test_expert_layouts_world_4():
    # Real groups on 4 ranks (8-rank layouts: generator tables above): expert TP = TP with EP, expert TP < TP
    # with expert DP, and EP with PP.
    layouts = [(4, 2, 1, 2, None), (4, 2, 1, 2, 1), (4, 1, 2, 2, 1)]
    assert all(run_distributed(expert_layouts_body, 4, layouts, timeout=120))


def test_expert_getters_before_initialization():
    from megatron.core import parallel_state as ps

    assert ps.get_expert_model_parallel_rank() == 0
    assert ps.get_expert_data_parallel_world_size() == 0
    with pytest.raises(AssertionError, match="not initialized"):
        ps.get_expert_model_parallel_group()


# Expert and context parallelism together: (world, tp, cp, pp, ep) -> dense and expert tables. The dense grid
# orders tp-cp-ep-dp-pp with ep = 1; the expert grid has cp = 1, so CP ranks become expert-parallel or
# expert-data-parallel ranks. By hand: W=8, TP=1, CP=2, EP=2: cp = r % 2, dp = r // 2; ep = r % 2, edp = r // 2.
EP_CP_LAYOUTS = {
    (8, 1, 2, 1, 2): {
        "context": [[0, 1], [2, 3], [4, 5], [6, 7]], "data": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "data_with_cp": [list(range(8))], "tensor_and_context": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expert_model": [[0, 1], [2, 3], [4, 5], [6, 7]], "expert_data": [[0, 2, 4, 6], [1, 3, 5, 7]],
    },
    # W=8, TP=2, CP=2, EP=4 (expert TP = TP = 2): dense tp = r % 2, cp = (r // 2) % 2, dp = r // 4;
    # expert etp = r % 2, ep = (r // 2) % 4: no expert DP.
    (8, 2, 2, 1, 4): {
        "context": [[0, 2], [1, 3], [4, 6], [5, 7]], "data": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "data_with_cp": [[0, 2, 4, 6], [1, 3, 5, 7]], "tensor_and_context": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expert_model": [[0, 2, 4, 6], [1, 3, 5, 7]], "expert_data": S,
    },
    # W=4, TP=1, CP=2, PP=1, EP=2 (the gloo run below): cp = r % 2, dp = r // 2; ep = r % 2, edp = r // 2.
    (4, 1, 2, 1, 2): {
        "context": [[0, 1], [2, 3]], "data": [[0, 2], [1, 3]], "data_with_cp": [[0, 1, 2, 3]],
        "tensor_and_context": [[0, 1], [2, 3]], "expert_model": [[0, 1], [2, 3]], "expert_data": [[0, 2], [1, 3]],
    },
    # W=8, TP=1, CP=2, PP=2, EP=2: cp = r % 2, dp = (r // 2) % 2, pp = r // 4; ep = r % 2, edp = (r // 2) % 2.
    (8, 1, 2, 2, 2): {
        "context": [[0, 1], [2, 3], [4, 5], [6, 7]], "data": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "data_with_cp": [[0, 1, 2, 3], [4, 5, 6, 7]], "tensor_and_context": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expert_model": [[0, 1], [2, 3], [4, 5], [6, 7]], "expert_data": [[0, 2], [1, 3], [4, 6], [5, 7]],
    },
}
DENSE_TOKENS = {"context": "cp", "data": "dp", "data_with_cp": "dp-cp", "tensor_and_context": "tp-cp"}


@pytest.mark.parametrize("layout", list(EP_CP_LAYOUTS), ids=lambda k: "w{}-tp{}-cp{}-pp{}-ep{}".format(*k))
def test_expert_and_context_parallel_tables(layout):
    from megatron.core.parallel_state import RankGenerator, expert_rank_generator

    world, tp, cp, pp, ep = layout
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = expert_rank_generator(world, tp, pp, ep)
    for kind, expected in EP_CP_LAYOUTS[layout].items():
        gen, token = (dense, DENSE_TOKENS[kind]) if kind in DENSE_TOKENS else (expert, TOKENS[kind])
        assert gen.get_ranks(token) == expected, kind


def expert_and_cp_body():
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1, context_parallel_size=2, expert_model_parallel_size=2)
    try:
        reported = ps.get_all_group_ranks()
        tables = EP_CP_LAYOUTS[(4, 1, 2, 1, 2)]
        rank = torch.distributed.get_rank()
        for kind, expected in tables.items():
            assert reported[kind] == expected, (kind, reported[kind])
        groups = {"context": ps.get_context_parallel_group(), "data": ps.get_data_parallel_group(),
                  "data_with_cp": ps.get_data_parallel_group(with_context_parallel=True),
                  "expert_model": ps.get_expert_model_parallel_group(),
                  "expert_data": ps.get_expert_data_parallel_group()}
        for kind, group in groups.items():
            t = torch.tensor([float(rank + 1)])
            torch.distributed.all_reduce(t, group=group)
            assert t.item() == sum(r + 1 for r in _mine(tables[kind], rank)), (kind, rank)
        return (ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                ps.get_expert_data_parallel_world_size())
    finally:
        ps.destroy_model_parallel()


def test_expert_and_context_parallel_groups_world_4():
    assert run_distributed(expert_and_cp_body, 4, timeout=120) == [(2, 2, 2)] * 4
