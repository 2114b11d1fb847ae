"""megatron-core 0.16.1's dist_checkpointing names that complete the module map: ``exchange_utils``,
``strategies.fully_parallel``, ``strategies.async_utils``' callers, ``serialization.remove_sharded_tensors`` and the
debug helpers of ``utils``.

References are independent of the code under test: the save distribution is worked out by hand from the greedy rule
(fewest holders first, then largest, then by id; each shard to the least-loaded holder, ties to the lower rank); which
rank wrote a block is read from the DCP metadata (the data file each chunk lies in); loaded values are compared with
the global tensors the pieces were cut from; the checkpoint for ``remove_sharded_tensors`` is assembled by hand from
two DCP checkpoints (metadata entries and data files, as the DCP format stores them).
"""
import logging
import os

import pytest
import torch

from helpers.dist_harness import run_distributed

SIZES = {"dp.a": 8, "dp.b": 6, "dp.c": 4, "dp.d": 2}  # float32 elements: 32, 24, 16, 8 bytes


def _globals():
    g = torch.Generator().manual_seed(5)
    out = {"tp.w": torch.randn(4, 3, generator=g), "dp.e": torch.randn(4, generator=g).to(torch.bfloat16)}
    out.update({k: torch.randn(n, generator=g) for k, n in SIZES.items()})
    return out


def _state(rank, zeros=False):
    """``tp.w`` split over the 2 ranks along dim 0; ``dp.*`` replicated (replica id = rank); one object per rank."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    def data(t):
        return torch.zeros_like(t) if zeros else t.clone()

    g = _globals()
    state = {"tp": {"w": ShardedTensor.from_rank_offsets("tp.w", data(g["tp.w"].chunk(2)[rank]), (0, rank, 2))},
             "obj": ShardedObject("obj", None if zeros else {"rank": rank}, (2,), (rank,))}
    state["dp"] = [ShardedTensor.from_rank_offsets(k, data(g[k]), replica_id=rank) for k in (*SIZES, "dp.e")]
    return state


def _writers(ckpt):
    """{(key, offset): rank whose data file holds the chunk}, from the DCP metadata."""
    from megatron.core.dist_checkpointing.sharded_io import read_dcp_metadata

    md = read_dcp_metadata(ckpt)
    return {(i.fqn, tuple(i.offset)): int(info.relative_path.split("_")[2]) for i, info in md.storage_data.items()
            if i.offset is not None}


def _values(state):
    return {"tp.w": state["tp"]["w"], "obj": state["obj"], **{f"dp{i}": t for i, t in enumerate(state["dp"])}}


def body(root):
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.exchange_utils import determine_main_replica_uniform_distribution
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                            FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import (TorchDistLoadShardedStrategy,
                                                                   TorchDistSaveShardedStrategy)

    rank = torch.distributed.get_rank()
    out = {}
    dist = determine_main_replica_uniform_distribution(_state(rank), None)
    out["assignment"] = {k[0] + str(k[1]): r for k, r in dist.main_rank_for_shard.items()}
    out["holders"] = {k[0] + str(k[1]): r for k, r in dist.all_ranks_for_shard.items()}

    plain, parallel = os.path.join(root, "plain"), os.path.join(root, "parallel")
    dc.save(_state(rank), plain)
    dc.save(_state(rank), parallel, sharded_strategy=FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()))
    torch.distributed.barrier()
    out["writers"] = {"plain": _writers(plain), "parallel": _writers(parallel)}
    for algo in ("broadcast", "gather_rounds", "gather_object"):
        strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo=algo)
        out[algo] = _values(dc.load(_state(rank, zeros=True), parallel, sharded_strategy=strategy))

    # asynchronous fully parallel saves through both callers (one long-lived worker, a worker per request)
    for persistent in (True, False):
        ckpt = os.path.join(root, f"async_{persistent}")
        state = _state(rank)
        request = dc.save(state, ckpt, sharded_strategy=FullyParallelSaveStrategyWrapper(
            TorchDistSaveShardedStrategy()), async_sharded_save=True)
        state["tp"]["w"].data.add_(100.0)  # after the snapshot: not written
        queue = AsyncCallsQueue(persistent=persistent)
        idx = queue.schedule_async_request(request)
        out[f"async_{persistent}_done"] = (idx, queue.maybe_finalize_async_calls(blocking=True),
                                           queue.get_num_unfinalized_calls())
        queue.close()
        out[f"async_{persistent}"] = _values(dc.load(_state(rank, zeros=True), ckpt))
    out["dcp"] = _dcp_round_trip(root, rank)
    return out


def _dcp_blocks(rank, zeros=False):
    """Per key this rank's blocks: ``tp.w`` (one block), ``stack`` (layer ``rank`` of 2, a prepended axis),
    ``pair`` (blocks ``rank`` and ``rank + 2`` of 4) and one object."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    g = _globals()

    def data(t):
        return torch.zeros_like(t) if zeros else t.clone()

    pair = g["dp.a"].chunk(4)
    obj = ShardedObject("obj", None if zeros else {"rank": rank}, (2,), (rank,))
    return {"tp.w": [ShardedTensor.from_rank_offsets("tp.w", data(g["tp.w"].chunk(2)[rank]), (0, rank, 2))],
            "stack": [ShardedTensor.from_rank_offsets("stack", data(g["tp.w"][rank]), (0, rank, 2),
                                                      prepend_axis_num=1)],
            "pair": [ShardedTensor.from_rank_offsets("pair", data(pair[i]), (0, i, 4)) for i in (rank, rank + 2)],
            obj.unique_key: [obj]}


def _dcp_round_trip(root, rank):
    """megatron-core's DCP-compatible values written by PyTorch DCP with MCoreSavePlanner, read whole by our
    offline reader and back into blocks with MCoreLoadPlanner."""
    import torch.distributed.checkpoint as dcp

    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.sharded_io import load_full_state_dict
    from megatron.core.dist_checkpointing.strategies.checkpointable import (CheckpointableShardedTensor,
                                                                            LocalShardsContainer)
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreLoadPlanner, MCoreSavePlanner,
                                                                   _unwrap_pyt_sharded_tensor, mcore_to_pyt_state_dict)

    ckpt, out = os.path.join(root, "dcp"), {}
    values = mcore_to_pyt_state_dict(_dcp_blocks(rank))
    out["types"] = {k: type(v).__name__ for k, v in values.items() if not k.startswith("obj")}
    assert isinstance(values["tp.w"], CheckpointableShardedTensor) and isinstance(values["pair"], LocalShardsContainer)
    dcp.save(values, storage_writer=dcp.FileSystemWriter(ckpt), planner=MCoreSavePlanner(flatten_state_dict=False))
    torch.distributed.barrier()
    if rank == 0:
        out["whole"] = load_full_state_dict(ckpt)
    blocks = _dcp_blocks(rank, zeros=True)
    request = mcore_to_pyt_state_dict({k: v for k, v in blocks.items() if not k.startswith("obj")}, is_loading=True)
    checked = [b for k in ("tp.w", "stack", "pair") for b in blocks[k]]
    dcp.load(request, storage_reader=dcp.FileSystemReader(ckpt),
             planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=checked, flatten_state_dict=False))
    out["loaded"] = {k: [t.clone() for t in _unwrap_pyt_sharded_tensor(v)] for k, v in request.items()}
    wrong = ShardedTensor.from_rank_offsets("tp.w", torch.zeros(3, 3), (0, rank, 2))  # global (6, 3), stored (4, 3)
    try:
        dcp.load(mcore_to_pyt_state_dict({"tp.w": [wrong]}, is_loading=True), storage_reader=dcp.FileSystemReader(ckpt),
                 planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=[wrong], flatten_state_dict=False))
        out["mismatch"] = None
    except dcp.api.CheckpointException as e:  # DCP wraps the planner's error of every rank
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(body, 2, str(tmp_path_factory.mktemp("fully_parallel")), timeout=200)


def test_save_distribution_matches_the_greedy_rule_worked_by_hand(results):
    # coverage 1 first: each tp.w half to its only holder (24 bytes each); then by size: dp.a -> 0 (tie),
    # dp.b -> 1, dp.c -> 1 (48 < 56), dp.d -> 0 (56 < 64), dp.e (bf16, 8 bytes, id after dp.d) -> 0 (tie 64/64)
    expected = {"tp.w(0, 0)": 0, "tp.w(2, 0)": 1, "dp.a(0,)": 0, "dp.b(0,)": 1, "dp.c(0,)": 1, "dp.d(0,)": 0,
                "dp.e(0,)": 0}
    for r in results:
        assert r["assignment"] == expected
        assert r["holders"]["tp.w(0, 0)"] == [0] and r["holders"]["dp.a(0,)"] == [0, 1]
    # the files say who wrote what: without the wrapper rank 0 writes every replicated tensor
    writers = results[0]["writers"]
    assert {k: v for k, v in writers["plain"].items() if k[0].startswith("dp.")} == {
        (k, (0,)): 0 for k in (*SIZES, "dp.e")}
    assert writers["parallel"] == {(k.split("(")[0], eval("(" + k.split("(", 1)[1])): r for k, r in expected.items()}


@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds", "gather_object"])
def test_fully_parallel_load_gives_every_rank_its_pieces(results, algo):
    g = _globals()
    for rank, r in enumerate(results):
        got = r[algo]
        assert torch.equal(got["tp.w"], g["tp.w"].chunk(2)[rank])
        for i, key in enumerate((*SIZES, "dp.e")):
            assert got[f"dp{i}"].dtype == g[key].dtype and torch.equal(got[f"dp{i}"], g[key]), (algo, key)
        assert got["obj"] == {"rank": rank}


@pytest.mark.parametrize("persistent", [True, False])
def test_async_callers_write_the_snapshot(results, persistent):
    g = _globals()
    for rank, r in enumerate(results):
        assert r[f"async_{persistent}_done"] == (0, [0], 0)
        assert torch.equal(r[f"async_{persistent}"]["tp.w"], g["tp.w"].chunk(2)[rank])
        assert torch.equal(r[f"async_{persistent}"]["dp0"], g["dp.a"])


def test_distribute_shards_to_ranks_by_hand():
    from megatron.core.dist_checkpointing.exchange_utils import distribute_shards_to_ranks

    # c has one holder (first); then a (two holders) before b, d (three); b larger than d
    shard_to_ranks = {"a": [0, 1], "b": [0, 1, 2], "c": [2], "d": [0, 1, 2], "x": [0, 2]}
    sizes = {"a": 10, "b": 7, "c": 5, "d": 3, "x": 100}
    got = distribute_shards_to_ranks(shard_to_ranks, sizes, 3, {"x"})
    # loads per rank after each step: c -> 2 [0,0,5]; a -> 0 [10,0,5]; b -> 1 [10,7,5]; d -> 2 [10,7,8];
    # x (needed from another group) last, holders 0 and 2: -> 2 (8 < 10)
    assert got == {"c": 2, "a": 0, "b": 1, "d": 2, "x": 2}


def test_async_worker_error_is_raised_at_finalization_without_finalizing():
    from megatron.core.dist_checkpointing.strategies.async_utils import (AsyncCaller, AsyncCallsQueue, AsyncRequest,
                                                                         PersistentAsyncCaller, TemporalAsyncCaller)

    def fail(*_):
        raise OSError("disk full")

    for persistent in (False, True):
        queue, finalized = AsyncCallsQueue(persistent=persistent), []
        queue.schedule_async_request(AsyncRequest(fail, (None, None), [lambda: finalized.append(1)]))
        with pytest.raises(OSError, match="disk full"):
            queue.maybe_finalize_async_calls(blocking=True)
        staged = []
        queue.schedule_async_request(AsyncRequest(lambda a, b: staged.append(b), ("dir", "raw"), [
            lambda: finalized.append(2)], preload_fn=lambda: "staged"))
        assert queue.maybe_finalize_async_calls(blocking=True) == [1]
        queue.close()
        assert finalized == [2] and staged == ["staged"]
        assert isinstance(queue.persistent_caller, PersistentAsyncCaller) == persistent
    assert issubclass(TemporalAsyncCaller, AsyncCaller) and issubclass(PersistentAsyncCaller, AsyncCaller)
    frozen = AsyncRequest(None, (), []).freeze()
    with pytest.raises(RuntimeError):
        frozen.add_finalize_fn(print)


def test_separation_hint_files_and_remove_sharded_tensors(tmp_path):
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.sharded_io import read_dcp_metadata
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    w, m = torch.arange(6.0).reshape(2, 3), torch.arange(4.0)
    ckpt = tmp_path / "ckpt"
    dc.save({"w": ShardedTensor.from_rank_offsets("model.w", w.clone()),
             "m": ShardedTensor.from_rank_offsets("opt.m", m.clone())}, str(ckpt),
            sharded_strategy=TorchDistSaveShardedStrategy(separation_hint="opt."))
    # the entries under the hint are in their own data file, named with the hint (DCP metadata says where)
    files = {i.fqn: info.relative_path for i, info in read_dcp_metadata(str(ckpt)).storage_data.items()}
    assert files == {"model.w": "__0_0.distcp", "opt.m": "opt.__0_1.distcp"}
    assert set(dc.load_plain_tensors(str(ckpt))) == {"model.w", "opt.m"}

    with pytest.warns(UserWarning, match="Skipping removal"):
        dc.serialization.remove_sharded_tensors(str(ckpt), "nothing.")
    dc.serialization.remove_sharded_tensors(str(ckpt), "opt.")
    assert sorted(f for f in os.listdir(ckpt) if f.endswith("distcp")) == ["__0_0.distcp"]
    assert not any(name.endswith((".tmp", ".bck")) for name in os.listdir(ckpt))
    assert set(read_dcp_metadata(str(ckpt)).state_dict_metadata) == {"model.w"}
    plain = dc.load_plain_tensors(str(ckpt))
    assert set(plain) == {"model.w"} and torch.equal(plain["model.w"], w)


def test_filesystem_writer_async_stages(tmp_path):
    """The staged write driven by hand: bucket and resolve, write (a worker per file), results, .metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    from megatron.core.dist_checkpointing.sharded_io import LocalShard, _ShardSavePlanner, load_full_state_dict
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    big = torch.arange(20.0)
    state = {"a": LocalShard(big[:8], (8,), (0,)), "b": LocalShard(torch.ones(2, 2), (2, 2), (0, 0)),
             "obj": {"step": 3}}
    writer = FileSystemWriterAsync(str(tmp_path), thread_count=2)
    planner = _ShardSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    plan = writer.prepare_global_plan([plan])[0]
    assert plan.storage_data == _StoragePrefix("__0_")
    writer.prepare_write_data(plan, planner)
    assert sorted(name for _, name, _ in writer.write_buckets) == ["__0_0.distcp", "__0_1.distcp"]
    staged_a = [t for _, _, (_, ts) in writer.write_buckets for i, t in ts if i.index.fqn == "a"][0]
    assert staged_a.untyped_storage().size() == 8 * 4  # a view of 20 floats was copied to its own 8
    write, stage, args = writer.get_save_function_and_args()
    args[1] = stage()
    write(*args)
    results = writer.retrieve_write_results()
    assert sorted(r.index.fqn for r in results) == ["a", "b", "obj"]
    metadata = planner.create_global_plan([plan])[1]
    writer.finish(metadata, [results])
    whole = load_full_state_dict(str(tmp_path))
    assert torch.equal(whole["a"], big[:8]) and torch.equal(whole["b"], torch.ones(2, 2)) and whole["obj"] == {
        "step": 3}
    with pytest.raises(NotImplementedError, match="object storage"):
        FileSystemWriterAsync(str(tmp_path), use_msc=True)
    assert dcp  # DCP's reader read the files above (load_full_state_dict)


def test_debug_time_logs_in_nested_scopes(caplog):
    from megatron.core.dist_checkpointing.utils import debug_msg, debug_time, force_all_tensors_to_non_fp8, logger_stack

    log = logging.getLogger("test_core_map_dist_ckpt")
    with caplog.at_level(logging.DEBUG, logger="test_core_map_dist_ckpt"):
        with logger_stack("outer", log) as (name, active):
            assert (name, active) == ("outer", log)
            with debug_time("inner"):
                debug_msg("hello")
        with debug_time("slow", log, threshold=10.0):
            pass  # under the threshold: not logged

        @debug_time("decorated", log)
        def f():
            return 3

        assert f() == 3
    messages = [rec.getMessage() for rec in caplog.records]
    assert messages[0] == "outer.inner hello"
    assert messages[1].startswith("outer.inner took ") and messages[1].endswith("s")
    assert messages[2].startswith("decorated took ") and len(messages) == 3
    assert all(rec.levelno == logging.DEBUG for rec in caplog.records)
    with logger_stack() as (name, _):
        assert name == ""  # the stacks were restored
    state = {"a": torch.ones(2)}
    force_all_tensors_to_non_fp8(state)  # no Transformer Engine FP8 tensor: nothing changes
    assert torch.equal(state["a"], torch.ones(2))


def test_mcore_dcp_values_round_trip(results):
    g = _globals()
    whole = results[0]["dcp"]["whole"]
    assert torch.equal(whole["tp.w"], g["tp.w"]) and torch.equal(whole["pair"], g["dp.a"])
    assert torch.equal(whole["stack"], g["tp.w"][:2])  # layer r (prepended axis) is tp.w row r
    assert whole["obj/shard_0_2"] == [{"rank": 0}] and whole["obj/shard_1_2"] == [{"rank": 1}]
    for rank, r in enumerate(results):
        d = r["dcp"]
        assert d["types"] == {"tp.w": "CheckpointableShardedTensor", "stack": "ShardedTensor",
                              "pair": "LocalShardsContainer"}
        assert torch.equal(d["loaded"]["tp.w"][0], g["tp.w"].chunk(2)[rank])
        assert torch.equal(d["loaded"]["stack"][0], g["tp.w"][rank])
        assert [t.tolist() for t in d["loaded"]["pair"]] == [g["dp.a"].chunk(4)[i].tolist() for i in (rank, rank + 2)]
        assert "Global shape mismatch" in d["mismatch"]
