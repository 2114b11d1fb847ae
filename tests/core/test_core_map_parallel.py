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


def _oracle_function(relpath: str, name: str, namespace: dict):
    """The oracle's function ``name`` from ``megatron/core/<relpath>``, compiled alone in ``namespace``."""
    path = os.path.join(require_oracle(), "megatron", "core", relpath)
    tree = ast.parse(open(path).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.returns = None
    for arg in node.args.args + node.args.kwonlyargs:
        arg.annotation = None
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace[name]


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_get_pp_rank_microbatches_matches_oracle():
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    oracle = _oracle_function("pipeline_parallel/schedules.py", "get_pp_rank_microbatches",
                              {"Optional": None, "P2PCommunicator": None, "parallel_state": None})
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

    for n in range(2, 40):  # the oracle's sizes: 2**i for i in range(int(log2(n))), without 1
        assert hybrid_dp_cp_group_sizes(n) == [2 ** i for i in range(int(log2(n)))][1:]


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
    from megatron.core import utils
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
    monkeypatch.setattr(utils, "drain_embedding_wgrad_compute", lambda *a: calls.append(a), raising=False)
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
    ps.destroy_model_parallel()
    out["rank"] = rank
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
