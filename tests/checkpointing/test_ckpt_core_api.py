"""megatron.core.dist_checkpointing's entry points on 2 gloo ranks, checked against hand-computed expectations:
save / load of ShardedTensor (TP-split, stacked with a prepended axis, replicated), ShardedObject, factories and
non-persistent objects; the directory's files and ``metadata.json``; ``load_common_state_dict``,
``load_tensors_metadata``, ``load_sharded_metadata``, ``load_plain_tensors``, ``load_content_metadata``,
``check_is_distributed_checkpoint``; strict modes; the sharding-integrity check; resharding on load (saved split
over 2 ranks, read whole); an asynchronous save run by ``AsyncCallsQueue``."""
import json
import os

import pytest
import torch

from helpers.dist_harness import run_distributed


def _global(name):
    """The global tensors of the test, from a fixed generator: what every rank's pieces are cut from."""
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(4, 6, generator=g), "stack": torch.randn(3, 2, 5, generator=g),
            "rep": torch.randn(7, generator=g), "glu": torch.randn(8, 3, generator=g)}[name]


def _state(rank, world, fill=None):
    """This rank's sharded state dict: ``w`` split along dim 0, layer ``rank`` of ``stack`` (prepended axis, the
    third layer held by rank 0 as a second entry), ``rep`` replicated, ``glu`` through a factory that saves its two
    halves as separate blocks, an object per rank, a non-persistent object and plain common values."""
    from megatron.core.dist_checkpointing import (LocalNonpersistentObject, ShardedObject, ShardedTensor,
                                                  ShardedTensorFactory)

    def data(t):
        return torch.zeros_like(t) if fill == "zeros" else t.clone()

    w = data(_global("w").chunk(world)[rank])
    stack = _global("stack")
    glu_local = data(torch.cat([_global("glu")[:4].chunk(world)[rank], _global("glu")[4:].chunk(world)[rank]]))

    def build(key, t, replica_id, flattened_range):
        gate, up = t.chunk(2)
        return [ShardedTensor.from_rank_offsets(key, gate, (0, rank, 2 * world), replica_id=replica_id),
                ShardedTensor.from_rank_offsets(key, up, (0, world + rank, 2 * world), replica_id=replica_id)]

    state = {
        "w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
        "layers": [ShardedTensor.from_rank_offsets("stack", data(stack[rank]), (0, rank, 3), prepend_axis_num=1)],
        "rep": ShardedTensor.from_rank_offsets("rep", data(_global("rep")), replica_id=rank),
        "glu": ShardedTensorFactory("glu", glu_local, build, lambda halves: torch.cat(halves)),
        "obj": ShardedObject("obj", {"rank": rank} if fill is None else None, (world,), (rank,)),
        "local": LocalNonpersistentObject(f"local-{rank}"),
        "common": {"step": 7, "name": "tiny"},
    }
    if rank == 0:
        state["layers"].append(ShardedTensor.from_rank_offsets("stack", data(stack[2]), (0, 2, 3), prepend_axis_num=1))
    return state


def body(root):
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    ckpt = os.path.join(root, "ckpt")
    assert dc.save(_state(rank, world), ckpt, content_metadata={"format": "test"}) is None
    torch.distributed.barrier()
    out["files"] = sorted(os.listdir(ckpt))
    with open(os.path.join(ckpt, "metadata.json")) as f:
        out["metadata"] = json.load(f)
    out["is_dist"] = (dc.check_is_distributed_checkpoint(ckpt), dc.check_is_distributed_checkpoint(root))
    out["common"] = dc.load_common_state_dict(ckpt)
    out["content"] = dc.load_content_metadata(ckpt)
    meta = dc.load_tensors_metadata(ckpt)
    out["tensors_meta"] = {k: (tuple(v.global_shape), v.dtype) for k, v in meta.items()}
    out["objects_meta"] = sorted(k for k, v in dc.load_sharded_metadata(ckpt).items() if "/shard_" in k)

    loaded = dc.load(_state(rank, world, fill="zeros"), ckpt)
    out["loaded"] = {"w": loaded["w"], "layers": loaded["layers"], "rep": loaded["rep"], "glu": loaded["glu"],
                     "obj": loaded["obj"], "local": loaded["local"], "common": loaded["common"]}
    out["plain"] = dc.load_plain_tensors(ckpt)  # resharding: every tensor whole

    # strict modes: a key the checkpoint lacks
    extra = _state(rank, world, fill="zeros")
    extra["missing"] = ShardedTensor.from_rank_offsets("not_saved", torch.zeros(2), replica_id=rank)
    _, missing, unexpected = dc.load(extra, ckpt, strict="return_all")
    out["return_all"] = (sorted(missing), sorted(unexpected))
    try:
        dc.load(extra, ckpt, strict="raise_unexpected")
        out["raise_unexpected"] = None
    except dc.CheckpointingException as e:
        out["raise_unexpected"] = str(e)
    partial = {"w": _state(rank, world, fill="zeros")["w"]}
    _, missing, _ = dc.load(partial, ckpt, strict="return_all")
    out["missing"] = sorted(missing)

    # the integrity check: two main replicas of one block
    bad = {"x": ShardedTensor.from_rank_offsets("x", torch.ones(2), replica_id=0)}
    try:
        dc.save(bad, os.path.join(root, "bad"))
        out["integrity"] = None
    except dc.CheckpointingException as e:
        out["integrity"] = str(e)

    # asynchronous save: the snapshot is taken at save(); later in-place updates are not written
    state = _state(rank, world)
    request = dc.save(state, os.path.join(root, "async"), async_sharded_save=True)
    state["w"].data.add_(100.0)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    out["async_plain"] = dc.load_plain_tensors(os.path.join(root, "async"))["w"]
    out["async_complete"] = dc.check_is_distributed_checkpoint(os.path.join(root, "async"))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(body, 2, str(tmp_path_factory.mktemp("core_api")), timeout=200)


def test_files_metadata_and_readers(results):
    r = results[0]
    assert {"common.pt", "metadata.json", ".metadata"} <= set(r["files"]), r["files"]
    assert r["metadata"] == {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                             "common_backend_version": 1}
    assert r["is_dist"] == (True, False)
    assert r["common"] == {"common": {"step": 7, "name": "tiny"}, "content_metadata": {"format": "test"}}
    assert r["content"] == {"format": "test"}
    assert r["tensors_meta"] == {"w": ((4, 6), torch.float32), "stack": ((3, 2, 5), torch.float32),
                                 "rep": ((7,), torch.float32), "glu": ((8, 3), torch.float32)}
    assert r["objects_meta"] == ["obj/shard_0_2", "obj/shard_1_2"]


def test_load_gives_back_every_piece(results):
    for rank, r in enumerate(results):
        got = r["loaded"]
        assert torch.equal(got["w"], _global("w").chunk(2)[rank])
        expected_layers = [_global("stack")[rank]] + ([_global("stack")[2]] if rank == 0 else [])
        assert len(got["layers"]) == len(expected_layers)
        assert all(torch.equal(a, b) for a, b in zip(got["layers"], expected_layers))
        assert torch.equal(got["rep"], _global("rep"))
        glu = _global("glu")
        assert torch.equal(got["glu"], torch.cat([glu[:4].chunk(2)[rank], glu[4:].chunk(2)[rank]]))
        assert got["obj"] == {"rank": rank} and got["local"] == f"local-{rank}"
        assert got["common"] == {"step": 7, "name": "tiny"}
        plain = r["plain"]
        assert set(plain) == {"w", "stack", "rep", "glu"}
        assert all(torch.equal(plain[k], _global(k)) for k in plain), "load_plain_tensors must give whole tensors"


def test_strict_modes_and_integrity(results):
    r = results[0]
    assert r["return_all"] == ([], ["not_saved"])
    assert "not_saved" in r["raise_unexpected"]
    assert r["missing"] == ["glu", "obj", "rep", "stack"]
    assert "more than one" in r["integrity"] and "'x'" in r["integrity"]


def test_async_save_writes_the_snapshot(results):
    r = results[0]
    assert r["async_complete"]
    assert torch.equal(r["async_plain"], _global("w")), "the background write saw a later in-place update"
