"""megatron-core 0.16.1 names of parallel_state, the pipeline schedules' helpers and the CP batch cutters, against
independent references: the oracle's own pure functions (read from its installed source and run here on CPU, no
megatron-core import) and plain PyTorch / numpy computations; one 4-rank gloo launch checks the process groups."""
import ast
import itertools
import os
import types
from datetime import timedelta

import numpy as np
import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.mcore_oracle import require_oracle
from helpers.models_helpers import single_rank  # noqa: F401  (fixture)


def _oracle_definition(relpath: str, name: str, namespace: dict):
    """The oracle's top-level function or class ``name`` from ``megatron/core/<relpath>``, compiled alone in
    ``namespace`` (which supplies the names it uses)."""
    path = os.path.join(require_oracle(), "megatron", "core", relpath)
    tree = ast.parse(open(path).read())
    node = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace[name]


def _oracle_scheduler_class():
    from collections import deque
    from functools import lru_cache
    from math import ceil, log2
    from typing import Callable, List, Optional, Tuple

    return _oracle_definition("pipeline_parallel/hybrid_cp_schedule.py", "BalancedCPScheduler", {
        "deque": deque, "lru_cache": lru_cache, "ceil": ceil, "log2": log2, "Callable": Callable, "List": List,
        "Optional": Optional, "Tuple": Tuple, "torch": torch})


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_get_pp_rank_microbatches_matches_oracle():
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from typing import Optional

    oracle = _oracle_definition("pipeline_parallel/schedules.py", "get_pp_rank_microbatches",
                                {"Optional": Optional, "P2PCommunicator": object, "parallel_state": None})
    cases = 0
    for pp, vp, m, chunks, group, fwd, overlap in itertools.product(
            (1, 2, 4), (None, 2), (1, 4, 8), (1, 2), (2, 4), (False, True), (False, True)):
        for rank in range(pp):
            comm = types.SimpleNamespace(pp_group=_Group(pp, rank), virtual_pipeline_model_parallel_size=vp)
            args = (m, chunks, group, fwd, overlap)
            assert get_pp_rank_microbatches(*args, p2p_communicator=comm) == oracle(*args, p2p_communicator=comm)
            cases += 1
    assert cases == 2 * 3 * 2 * 2 * 2 * 2 * 7


def test_hierarchical_and_hybrid_group_ranks():
    from megatron.core.parallel_groups_extra import hierarchical_rank_groups, hybrid_dp_cp_group_sizes

    ranks = list(range(100, 116))
    for sizes in ([2, 2, 4], [4, 4], [16], [2, 8], [1, 16]):
        levels = hierarchical_rank_groups(ranks, sizes)
        for level, size in enumerate(sizes):  # numpy: "(l s u) -> (l u) s"
            u, l_ = int(np.prod(sizes[:level])), int(np.prod(sizes[level + 1:]))
            expected = np.array(ranks).reshape(l_, size, u).transpose(0, 2, 1).reshape(-1, size).tolist()
            assert levels[level] == expected
    assert hierarchical_rank_groups(ranks, [2, 2, 4])[1][:2] == [[100, 102], [101, 103]]  # the docstring example
    with pytest.raises(ValueError, match="do not multiply"):
        hierarchical_rank_groups(ranks, [3, 4])
    from math import log2

    from megatron.core.parallel_state import overwrite_nccl_comm_cfgs

    cfgs = {"dp": {"max_ctas": 4}}
    overwrite_nccl_comm_cfgs(cfgs, "dp", ("min_ctas", 1))
    overwrite_nccl_comm_cfgs(cfgs, "tp", ("net_name", "IB"))
    overwrite_nccl_comm_cfgs(cfgs, "dp", ("max_ctas", 8))
    assert cfgs == {"dp": {"max_ctas": 8, "min_ctas": 1}, "tp": {"net_name": "IB"}}
    for n in range(2, 40):  # the oracle's sizes: 2**i for i in range(int(log2(n))), without 1
        assert hybrid_dp_cp_group_sizes(n) == [2 ** i for i in range(int(log2(n)))][1:]


def _schedule(scheduler_class, seqlens, total, max_per_rank):
    scheduler = scheduler_class(max_per_rank, _Group(total, 0))
    try:
        return scheduler.get_groups_and_subsamples(list(enumerate(seqlens)), None)
    except (AssertionError, IndexError) as error:
        return type(error).__name__


def test_balanced_cp_scheduler_matches_oracle():
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    oracle_class = _oracle_scheduler_class()
    generator = torch.Generator().manual_seed(0)
    outcomes = set()
    for case in range(60):
        total = (2, 4, 8)[case % 3]
        count = int(torch.randint(1, 24, (1,), generator=generator))
        seqlens = torch.randint(1, 16 * total + 1, (count,), generator=generator).tolist()
        ours, theirs = _schedule(BalancedCPScheduler, seqlens, total, 16), _schedule(oracle_class, seqlens, total, 16)
        assert ours == theirs, (total, seqlens)
        outcomes.add(type(ours).__name__)
    assert "tuple" in outcomes  # real schedules were compared, not only errors
    scheduler = BalancedCPScheduler(16, _Group(4, 0))
    assert [scheduler.gpus_needed(n) for n in (1, 8, 16, 17, 32, 33, 64)] == [1, 1, 1, 2, 2, 4, 4]
    assert scheduler.get_total_workload(32) == 32 * 32 / 2 and scheduler.get_total_workload(32, 4) == 256


def _zigzag(length, cp, r):
    chunks = torch.arange(length).chunk(2 * cp)
    return torch.cat([chunks[r], chunks[2 * cp - 1 - r]])


def test_thd_and_hybrid_cp_batches():
    from megatron.core.utils import get_batch_on_this_hybrid_cp_rank, get_thd_batch_on_this_cp_rank

    lengths, cp = [8, 4, 12], 2
    padded = torch.tensor([0, 8, 12, 24])
    cu = torch.tensor([0, 7, 10, 21])
    tokens = torch.arange(24).view(1, 24) * 10
    for r in range(cp):
        batch = {"tokens": tokens.clone(), "labels": tokens.clone() + 1, "cu_seqlens": cu,
                 "max_seqlen": torch.tensor([12])}
        out, params = get_thd_batch_on_this_cp_rank(batch, cu, padded, torch.tensor([12]), cp_size=cp, cp_rank=r)
        starts = [0, 8, 12]
        keep = torch.cat([s + _zigzag(n, cp, r) for s, n in zip(starts, lengths)])
        assert torch.equal(out["tokens"][0], tokens[0, keep]) and out["tokens"].shape == (1, 12)
        assert torch.equal(out["labels"][0], tokens[0, keep] + 1) and out["cu_seqlens"] is cu
        assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 12
        assert params.cu_seqlens_q is cu and params.cu_seqlens_kv_padded is padded
    same, _ = get_thd_batch_on_this_cp_rank({"tokens": tokens.clone()}, cu, padded, torch.tensor([12]), 1, 0)
    assert torch.equal(same["tokens"], tokens)

    sample = {"tokens": torch.arange(6), "position_ids": torch.arange(6), "attention_mask": torch.ones(6, 6)}
    out, params = get_batch_on_this_hybrid_cp_rank(sample, local_cp_size=1)
    assert out["tokens"].shape == (1, 6) and out["attention_mask"].shape == (6, 6)
    assert params.qkv_format == "sbhd" and params.cu_seqlens_q.tolist() == [0, 6] and params.local_cp_size == 1
    assert params.max_seqlen_q == 6 and params.cp_group is None
    with pytest.raises(AssertionError, match="local_cp_size is 4"):
        get_batch_on_this_hybrid_cp_rank({"tokens": torch.arange(4)}, 4, cp_group=_Group(2, 0))


def test_microbatch_and_embedding_wgrad_helpers(monkeypatch):
    from megatron.core.pipeline_parallel import schedule_helpers
    from megatron.core.pipeline_parallel.schedules import (clear_embedding_activation_buffer,
                                                           finish_embedding_wgrad_compute, set_current_microbatch)

    layers = [types.SimpleNamespace() for _ in range(2)]
    mtp = [types.SimpleNamespace(transformer_layer=types.SimpleNamespace())]
    inner = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=layers), mtp=types.SimpleNamespace(layers=mtp))
    wrapped = types.SimpleNamespace(decoder=None, module=inner)  # a wrapper whose decoder is None is skipped
    set_current_microbatch(wrapped, 3)
    assert [layer.current_microbatch for layer in layers] == [3, 3] and mtp[0].transformer_layer.current_microbatch == 3
    set_current_microbatch(types.SimpleNamespace(), 1)  # no decoder anywhere: nothing happens

    weight, shared = torch.zeros(2), torch.ones(2)
    post = types.SimpleNamespace(post_process=True, embedding_activation_buffer=[1, 2], grad_output_buffer=[3],
                                 output_layer=types.SimpleNamespace(weight=weight),
                                 share_embeddings_and_output_weights=False,
                                 shared_embedding_or_output_weight=lambda: shared)
    model = types.SimpleNamespace(module=post)
    on, off = types.SimpleNamespace(defer_embedding_wgrad_compute=True), types.SimpleNamespace()
    assert clear_embedding_activation_buffer(off, model, True) is None
    assert clear_embedding_activation_buffer(on, model, False) is None and post.embedding_activation_buffer == [1, 2]
    assert clear_embedding_activation_buffer(on, [None, model], True) is post and post.embedding_activation_buffer == []
    calls = []
    monkeypatch.setattr(schedule_helpers, "drain_embedding_wgrad_compute", lambda *a: calls.append(a))
    finish_embedding_wgrad_compute(off, post, True, "tp")
    finish_embedding_wgrad_compute(on, post, False, "tp")
    assert calls == []
    finish_embedding_wgrad_compute(on, post, True, "tp")
    post.share_embeddings_and_output_weights = True
    finish_embedding_wgrad_compute(on, post, True, "tp")
    assert [c[3] for c in calls] == [shared, weight] and calls[0][:3] == (on, [], [3]) and calls[0][4] == "tp"


def _ranks(group):
    return torch.distributed.get_process_group_ranks(group)


def _groups_body():
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_hybrid_cp_rank

    rank = torch.distributed.get_rank()
    out = {}
    # tp 1, cp 2, dp 2: DP x CP = [0 1 2 3]; two distributed-optimizer instances; expert DP = the 4 ranks.
    ps.initialize_model_parallel(1, 1, context_parallel_size=2, num_distributed_optimizer_instances=2,
                                 create_all_gather_group=True, hybrid_context_parallel=True)
    out["partial"] = _ranks(ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True))
    out["partial_gloo"] = _ranks(ps.get_data_parallel_group_gloo(True, partial_data_parallel=True))
    ag = ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
    out["ag"] = (ps.has_separate_all_gather_group(), _ranks(ag),
                 ag is not ps.get_data_parallel_group(with_context_parallel=True))
    out["hybrid2"] = _ranks(ps.get_hybrid_data_context_parallel_groups(group_size=2))
    out["hybrid4"] = ps.get_hybrid_data_context_parallel_groups(group_size=4) is ps.get_data_parallel_group(True)
    out["intra_edp"] = _ranks(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True))
    out["edp_size"] = ps.get_expert_data_parallel_world_size(partial_expert_data_parallel=True)
    out["inter"] = _ranks(ps.get_inter_distributed_optimizer_instance_group())
    out["intra_opt"] = _ranks(ps.get_intra_distributed_optimizer_instance_group())
    # One sample on the hybrid group of 2 ranks: the zigzag half of this rank in that group.
    sample = {"tokens": torch.arange(8) * 10, "labels": torch.arange(8)}
    batch, params = get_batch_on_this_hybrid_cp_rank(sample, local_cp_size=2)
    out["hybrid_batch"] = (batch["tokens"].tolist(), params.cp_group.size(), params.local_cp_size)
    group = ps.get_tensor_model_parallel_group()
    ps.update_pg_timeout(timedelta(minutes=7), group)
    cpu = torch.device("cpu")
    out["timeout_one"] = (group._get_backend(cpu).options._timeout,
                          ag._get_backend(cpu).options._timeout)
    ps.update_pg_timeout(timedelta(minutes=9))
    out["timeout_all"] = (ag._get_backend(cpu).options._timeout,
                          torch.distributed.group.WORLD._get_backend(cpu).options._timeout)
    out.update(_hybrid_data_and_schedule(ps))
    out.update(_bridge(rank))
    out.update(_multimodule(rank))
    ps.destroy_model_parallel()
    out["rank"] = rank
    return out


def _bridge(rank):
    """A TP 2 source grid (ranks 0, 1) bridged to a DP 2 destination grid (ranks 2, 3): fan-out from leader 1."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    names = ["tp", "cp", "pp", "dp"]
    bridge = BridgeCommunicator(HyperCommGrid([2, 1, 1, 1], names), HyperCommGrid([1, 1, 1, 2], names, rank_offset=2))
    plan = {r: (info.role.value, info.send_to_ranks, info.recv_from_ranks) for r, info in bridge.comm_map.items()}
    x0, x1 = torch.arange(24.0).view(4, 2, 3), torch.arange(24.0).view(4, 2, 3) + 100
    got = {}
    if rank < 2:  # the source: micro-batch 0 forward, then 1 forward with 0's gradient, then 1's gradient
        bridge.send_forward(x0)
        got["g0"] = bridge.send_forward_recv_backward(x1).tolist()
        got["g1"] = bridge.recv_backward().tolist()
    else:
        a0 = bridge.recv_forward()
        a1 = bridge.send_backward_recv_forward(a0.detach() * 2)
        bridge.send_backward(a1.detach() * 3)
        got["a0"], got["a1"], got["grad"] = a0.tolist(), a1.tolist(), a1.requires_grad
    return {"plan": plan, "bridge": got, "leaders": (bridge.src_tp_leaders, bridge.dest_tp_leaders)}


def _multimodule(rank):
    """An encoder on 2 pipeline stages (ranks 0, 1) feeding a language model on DP 2 (ranks 2, 3)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator

    names = ["tp", "cp", "pp", "dp"]
    grids = {"enc": HyperCommGrid([1, 1, 2, 1], names), "llm": HyperCommGrid([1, 1, 1, 2], names, rank_offset=2)}
    for grid in grids.values():
        grid.create_pg("pp")
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    comm = MultiModulePipelineCommunicator(grids, {"enc": ["llm"], "llm": []}, config)
    x = torch.arange(24.0).view(4, 2, 3)
    got = {"first": comm.is_pp_first_stage, "last": comm.is_pp_last_stage, "warmup": comm.num_warmup_microbatches,
           "stages": {m: (i.pp_rank, i.pp_size) for m, i in comm.rank_module_map.items()}}
    if rank == 0:
        comm.send_forward({"enc": x})
        got["grad"] = comm.recv_backward(tensor_shape=(4, 2, 3))["enc"].tolist()
    elif rank == 1:
        got["in"] = comm.recv_forward(tensor_shape=(4, 2, 3))["enc"].tolist()
        comm.send_forward({"enc": x * 2})
        grad = comm.recv_backward()["enc"]
        got["grad"] = grad.tolist()
        comm.send_backward({"enc": grad + 1})
    else:
        got["in"] = comm.recv_forward()["enc"].tolist()
        comm.send_backward({"enc": torch.tensor(got["in"]) * 5})
    return {"multimodule": got}


# Packed samples of DP rank 0 and 1 (CP peers read the same): their cu_seqlens (one empty sub-sample).
_PACKED = {0: [[0, 8, 12, 14], [0, 3, 3, 6]], 1: [[0, 16], [0, 2, 4, 5]]}
_GLOBAL_SEQLENS = [8, 4, 2, 3, 3, 16, 2, 2, 1]  # global ids 0..4 on DP rank 0, 5..8 on DP rank 1


def _packed_batch(dp_rank):
    batch = []
    for index, bounds in enumerate(_PACKED[dp_rank]):
        n = bounds[-1]
        tokens = torch.arange(n) + 1000 * dp_rank + 100 * index
        batch.append({"tokens": tokens, "labels": tokens + 1, "cu_seqlens": torch.tensor(bounds),
                      "max_seqlen": torch.tensor([n])})
    return batch


def _hybrid_data_and_schedule(ps):
    """HybridCPDataLoaderWrapper and the hybrid-CP schedule on the DP 2 x CP 2 grid (max 4 tokens per rank)."""
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    config = ModelParallelConfig(max_seqlen_per_dp_cp_rank=4, hybrid_context_parallel=True)
    dp_rank = ps.get_data_parallel_rank()
    samples, groups = next(HybridCPDataLoaderWrapper(iter([_packed_batch(dp_rank)]), config))
    out = {"groups": groups, "samples": {gid: (s["tokens"].tolist(), s["labels"].tolist(), sorted(s))
                                         for gid, s in samples.items()}}

    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    model.config, model.set_input_tensor = config, lambda tensor: None
    seen = []

    def forward_step_func(data_iterator, model):
        sample = next(data_iterator)
        seen.append((sample["tokens"].tolist(), int(sample["local_cp_size"])))
        loss = model(sample["tokens"].float().view(-1, 1)).sum()
        return loss, lambda output: (output, torch.tensor(1), {"loss": output.detach()})

    wrapper = HybridCPDataLoaderWrapper(iter([_packed_batch(dp_rank)]), config)
    store = forward_backward_no_pipelining(forward_step_func=forward_step_func, data_iterator=wrapper, model=model,
                                           num_microbatches=1, seq_length=4, micro_batch_size=1)
    out["seen"], out["grad"], out["stored"] = seen, float(model.weight.grad), len(store)
    return out


def test_parallel_state_groups_world_4():
    results = run_distributed(_groups_body, world_size=4)
    for rank, out in enumerate(results):
        half = [0, 1] if rank < 2 else [2, 3]
        assert out["partial"] == out["partial_gloo"] == half
        assert out["ag"] == (True, [0, 1, 2, 3], True)
        assert out["hybrid2"] == half and out["hybrid4"] is True
        assert out["intra_edp"] == half and out["edp_size"] == 2
        assert out["inter"] == [rank % 2, rank % 2 + 2]
        assert out["intra_opt"] == half
        tokens = (torch.arange(8) * 10)[_zigzag(8, 2, rank % 2)].tolist()
        assert out["hybrid_batch"] == ([tokens], 2, 2)
        assert out["timeout_one"] == (timedelta(minutes=7), timedelta(minutes=30))
        assert out["timeout_all"] == (timedelta(minutes=9), timedelta(minutes=9))
    # The bridge: leader 1 sends halves of the batch to 2 and 3; the gradients come back to both source ranks.
    x0, x1 = torch.arange(24.0).view(4, 2, 3), torch.arange(24.0).view(4, 2, 3) + 100
    for rank, out in enumerate(results):
        assert out["leaders"] == ([1], [2, 3])
        assert out["plan"] == {0: ("MEMBER", [], []), 1: ("SENDER", [2, 3], []), 2: ("RECEIVER", [], [1]),
                               3: ("RECEIVER", [], [1])}
        if rank < 2:
            assert out["bridge"] == {"g0": (2 * x0).tolist(), "g1": (3 * x1).tolist()}
        else:
            half = slice(0, 2) if rank == 2 else slice(2, 4)
            assert out["bridge"] == {"a0": x0[half].tolist(), "a1": x1[half].tolist(), "grad": True}
    # The multi-module pipeline: enc stage 0 -> enc stage 1 -> (bridge, halves) -> llm on ranks 2 and 3, and back.
    stages = [{"enc": (0, 2)}, {"enc": (1, 2)}, {"llm": (0, 1)}, {"llm": (0, 1)}]
    for rank, out in enumerate(results):
        got = out["multimodule"]
        assert (got["first"], got["last"], got["warmup"], got["stages"]) == (rank == 0, rank >= 2, max(2 - rank, 0),
                                                                             stages[rank])
        if rank == 0:
            assert got["grad"] == (x0 * 10 + 1).tolist()
        elif rank == 1:
            assert got["in"] == x0.tolist() and got["grad"] == (x0 * 10).tolist()
        else:
            assert got["in"] == (x0 * 2)[slice(0, 2) if rank == 2 else slice(2, 4)].tolist()
    # The data schedule: every rank got the oracle's schedule, and exactly its sub-samples, whole.
    oracle_groups = _oracle_scheduler_class()(4, _Group(4, 0)).get_groups_and_subsamples(
        list(enumerate(_GLOBAL_SEQLENS)), None)[1]
    contents = {}
    for dp_rank in (0, 1):
        batch = _packed_batch(dp_rank)
        for sample in batch:
            b = sample["cu_seqlens"].tolist()
            for start, end in zip(b[:-1], b[1:]):
                if end > start:
                    contents[len(contents)] = sample["tokens"][start:end].tolist()
    assert [len(contents[g]) for g in range(9)] == _GLOBAL_SEQLENS
    for rank, out in enumerate(results):
        assert out["groups"] == oracle_groups
        mine = sorted({g for group in oracle_groups for g in group[rank]})
        assert sorted(out["samples"]) == mine
        for gid, (tokens, labels, keys) in out["samples"].items():
            assert tokens == contents[gid] and labels == [t + 1 for t in contents[gid]] and keys == ["labels", "tokens"]
        # The schedule ran this rank's sub-samples group by group, each with the size of its rank set.
        expected = [(contents[g], sum(g in ids for ids in group)) for group in oracle_groups for g in group[rank]]
        assert out["seen"] == expected and out["stored"] == len(expected)
        assert out["grad"] == pytest.approx(sum(sum(tokens) for tokens, _ in expected))


def test_parallel_state_one_instance(single_rank):
    """One distributed-optimizer instance (the default): it spans the world, the partial DP group is the DP x CP
    group, no inter-instance group, no all-gather group, no hybrid group but the whole DP x CP one."""
    from megatron.core import parallel_state as ps

    assert _ranks(ps.get_intra_distributed_optimizer_instance_group()) == [0]
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    assert ps.get_data_parallel_group(True, partial_data_parallel=True) is dp_cp
    assert ps.get_data_parallel_group_gloo(True, partial_data_parallel=True) is ps.get_data_parallel_group_gloo(True)
    assert ps.get_expert_data_parallel_group(partial_expert_data_parallel=True) is ps.get_expert_data_parallel_group()
    assert ps.has_separate_all_gather_group() is False
    with pytest.raises(AssertionError, match="inter distributed optimizer instance group is not initialized"):
        ps.get_inter_distributed_optimizer_instance_group()
    assert ps.get_inter_distributed_optimizer_instance_group(check_initialized=False) is None
    with pytest.raises(AssertionError, match="all-gather group is not initialized"):
        ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
    with pytest.raises(AssertionError, match="Partial DP for Optimizer needs to include CP"):
        ps.get_data_parallel_group(partial_data_parallel=True)
    assert ps.get_hybrid_data_context_parallel_groups(group_size=1) is dp_cp
    with pytest.raises(KeyError, match="no hybrid data x context parallel group of size 2"):
        ps.get_hybrid_data_context_parallel_groups(group_size=2)
    ps.update_pg_timeout(timedelta(minutes=11))
    assert dp_cp._get_backend(torch.device("cpu")).options._timeout == timedelta(minutes=11)
    ps.update_pg_timeout(timedelta(minutes=30))


def test_bridge_plan_matches_oracle(monkeypatch):
    """Leaders, boundary broadcast groups and the fan-in / fan-out plan of several grid pairs, against the oracle's
    own methods (run on instances that skip the collective constructor)."""
    from dataclasses import dataclass, field
    from enum import Enum
    from typing import Dict, List, Optional, Tuple

    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    monkeypatch.setenv("WORLD_SIZE", "64")
    namespace = {"dataclass": dataclass, "field": field, "Enum": Enum, "Dict": Dict, "List": List,
                 "Optional": Optional, "Tuple": Tuple, "torch": torch, "HyperCommGrid": HyperCommGrid}
    for name in ("CommRole", "RankCommInfo", "BridgeCommunicator"):
        _oracle_definition("pipeline_parallel/bridge_communicator.py", name, namespace)
    names = ["tp", "cp", "pp", "dp"]
    pairs = [([2, 1, 1, 1], [1, 1, 1, 2]), ([1, 1, 2, 4], [2, 1, 1, 2]), ([2, 1, 2, 2], [1, 1, 3, 4]),
             ([4, 1, 1, 2], [2, 1, 2, 1])]
    for src_shape, dest_shape in pairs:
        src = HyperCommGrid(src_shape, names)
        dest = HyperCommGrid(dest_shape, names, rank_offset=src.size)
        for rank in range(src.size + dest.size):
            plans = []
            for cls in (BridgeCommunicator, namespace["BridgeCommunicator"]):
                bridge = object.__new__(cls)
                bridge.current_rank, bridge.src_grid, bridge.dest_grid, bridge.comm_map = rank, src, dest, {}
                src_leaders = bridge.get_leader_rank(src, is_src=True)
                dest_leaders = bridge.get_leader_rank(dest, is_src=False)
                bridge.build_comm_map(src_leaders[0], dest_leaders[0])
                plans.append((src_leaders, dest_leaders, bridge.get_boundary_pp_stage_ranks(src, True),
                              bridge.get_boundary_pp_stage_ranks(dest, False),
                              {r: (i.role.value, i.send_to_ranks, i.recv_from_ranks) for r, i in bridge.comm_map.items()}))
            assert plans[0] == plans[1], (src_shape, dest_shape, rank)
    bridge = object.__new__(BridgeCommunicator)
    bridge.dim_mapping = {"s": 0, "b": 1, "h": 2}
    parts = bridge._split_tensor_at_batch_dim(torch.arange(12.0).view(2, 3, 2), 2)
    assert [p.shape for p in parts] == [(2, 2, 2), (2, 1, 2)] and all(p.is_contiguous() for p in parts)
    with pytest.raises(ValueError, match="num_splits must be positive"):
        bridge._split_tensor_at_batch_dim(torch.zeros(2, 2, 2), 0)


def test_multimodule_pipeline_depth_matches_oracle(monkeypatch):
    """compute_total_pipeline_stages (longest path of the module DAG, weighted by stages) against the oracle's."""
    from dataclasses import dataclass
    from typing import Dict, List, Optional

    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator

    monkeypatch.setenv("WORLD_SIZE", "64")
    oracle = _oracle_definition("pipeline_parallel/multimodule_communicator.py", "MultiModulePipelineCommunicator", {
        "dataclass": dataclass, "Dict": Dict, "List": List, "Optional": Optional, "HyperCommGrid": HyperCommGrid,
        "ModelParallelConfig": object, "Shape": object, "torch": torch, "dist": None, "logging": None})
    names = ["tp", "cp", "pp", "dp"]
    grids = {"img": HyperCommGrid([1, 1, 2, 1], names), "audio": HyperCommGrid([2, 1, 3, 1], names, rank_offset=2),
             "llm": HyperCommGrid([1, 1, 4, 2], names, rank_offset=8),
             "gen": HyperCommGrid([1, 1, 1, 1], names, rank_offset=16)}
    topology = {"img": ["llm"], "audio": ["llm"], "llm": ["gen"], "gen": []}
    ours, theirs = MultiModulePipelineCommunicator.compute_total_pipeline_stages, oracle.compute_total_pipeline_stages
    assert ours(topology, grids) == theirs(topology, grids) == 3 + 4 + 1
    for name, grid in grids.items():
        for rank in range(grid.rank_offset, grid.rank_offset + grid.size):
            assert ours(topology, grids, rank, name) == theirs(topology, grids, rank, name)
    assert ours(topology, grids, 9) == ours(topology, grids, 9, "llm")
    with pytest.raises(ValueError, match="cycles"):
        ours({"img": ["llm"], "audio": [], "llm": ["img"], "gen": []}, grids, 0, "img")
