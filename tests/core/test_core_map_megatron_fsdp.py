"""megatron-core's Megatron-FSDP package path (``megatron.core.distributed.fsdp.src.megatron_fsdp``) on this library's
FSDP2 engine, against independent references: a plain unsharded PyTorch model trained on the whole batch, the full
tensor a DTensor was cut from, torch.split, and an ordinary (non-meta) build.

One gloo launch of 2 ranks checks the distributed behaviour; the rest runs in process.
"""
import importlib
import inspect

import pytest
import torch

from helpers.dist_harness import run_distributed

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.src import megatron_fsdp as mfsdp
from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp as core_mod
from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
from megatron.core.distributed.fsdp.src.megatron_fsdp import utils as fs_utils

fs_mod = importlib.import_module("megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard")  # the package's
# attribute ``fully_shard`` is the function, as in megatron-core
STEPS, ROWS, HIDDEN = 3, 4, 8


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def _model(seed=0, device=None):
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        # 5 output rows: an odd row count gives uneven (torch.chunk) blocks over 2 ranks.
        return torch.nn.Sequential(Block(HIDDEN), Block(HIDDEN), torch.nn.Linear(HIDDEN, 5))


def _batches(world):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(world * ROWS, HIDDEN, generator=g), torch.randn(world * ROWS, 5, generator=g))
            for _ in range(STEPS)]


def _reference(world, lr):
    """Plain PyTorch on the whole batch: the loss and weights data parallelism must reproduce."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in _batches(world):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model, opt, rank, world):
    losses = []
    for x, y in _batches(world):
        opt.zero_grad()
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _full_weights(model):
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_uneven_dtensor_to_full_tensor

    return {n.removeprefix("module."): gather_uneven_dtensor_to_full_tensor(p).to_local()
            for n, p in model.named_parameters()}


def _fsdp_body():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from megatron.core.distributed.fsdp.src.megatron_fsdp import (fully_shard, fully_shard_model,
                                                                  fully_shard_optimizer)
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        gather_and_compute_chunk_metadata, gather_uneven_dtensor_to_full_tensor, split_dtensor,
        validate_uneven_dtensor)
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    lr = 0.01
    ref_losses, ref_weights = _reference(world, lr)

    # 1. fully_shard (ZeRO-3, a unit per Block, default mesh) with an optimizer built before wrapping.
    module = _model()
    model, opt = fully_shard(module, torch.optim.Adam(module.parameters(), lr=lr), fsdp_unit_modules=[Block],
                             zero_dp_strategy=3)
    params = list(model.parameters())
    out["zero3_dtensor_shards"] = all(isinstance(p, DTensor) for p in params) and \
        sum(p.to_local().numel() for p in params) < sum(p.numel() for p in params)
    out["zero3_losses"] = (_train(model, opt, rank, world), ref_losses)
    full = _full_weights(model)
    out["zero3_weights_err"] = max((full[n] - ref_weights[n]).abs().max().item() for n in ref_weights)
    # The state dict: torch's keys under module., DTensors carrying their (uneven) chunk for DCP.
    sd = model.state_dict()
    out["state_dict_keys"] = sorted(sd) == sorted(f"module.{n}" for n in ref_weights)
    head = sd["module.2.weight"]  # 5 rows over 2 ranks: blocks of 3 and 2 rows
    out["head_chunk"] = (tuple(head.__create_chunk_list__()[0].offsets), tuple(head.to_local().shape))
    saved = {k: v.detach().clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(saved)
    out["reload_err"] = max((w - ref_weights[n]).abs().max().item() for n, w in _full_weights(model).items())

    # 2. fully_shard_model + fully_shard_optimizer (ZeRO-2, import path as unit, explicit mesh).
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    model2 = fully_shard_model(_model(), device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp",
                               fsdp_unit_modules=[f"{__name__}.Block"], zero_dp_strategy="optim_grads")
    opt2 = fully_shard_optimizer(torch.optim.Adam(model2.parameters(), lr=lr))
    out["zero2_losses"] = (_train(model2, opt2, rank, world), ref_losses)
    out["zero2_weights_err"] = max((w - ref_weights[n]).abs().max().item() for n, w in _full_weights(model2).items())
    out["zero2_index"] = model2.get_distributed_index().get_fsdp_group().size() == world

    # 3. no_shard (DDP over FSDP2's replicate dimension): whole weights everywhere, the same training.
    model0 = fully_shard_model(_model(), fsdp_unit_modules=[Block], zero_dp_strategy="no_shard")
    out["no_shard_whole"] = all(p.to_local().shape == p.shape for p in model0.parameters())
    out["no_shard_losses"] = (_train(model0, fully_shard_optimizer(torch.optim.Adam(model0.parameters(), lr=lr)),
                                     rank, world), ref_losses)

    # 3b. Hybrid FSDP: replicas over an outer dimension of 2, shards over an inner one of 1 (all a 2-rank run allows),
    # built on the meta device (each rank draws its blocks of the (replicate, shard) mesh).
    hsdp_mesh = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("outer", "inner", "tp"))
    model_h = fully_shard_model(_model(device="meta"), device_mesh=hsdp_mesh, dp_outer_dim="outer",
                                dp_shard_dim="inner", tp_dim="tp", init_model_with_meta_device=True,
                                hybrid_fsdp_group=hsdp_mesh["outer", "inner"]._flatten().get_group(),
                                fsdp_unit_modules=[Block])
    out["hsdp_losses"] = (_train(model_h, fully_shard_optimizer(torch.optim.Adam(model_h.parameters(), lr=lr)),
                                 rank, world), ref_losses)

    # 3c. A bf16 module: fp32 main weights (the optimizer's DTensors), bf16 compute and outputs.
    model_b = fully_shard_model(_model().bfloat16(), fsdp_unit_modules=[Block])
    y = model_b(_batches(world)[0][0][:ROWS].bfloat16())
    out["bf16"] = ({p.dtype for p in model_b.parameters()}, y.dtype)

    # 4. Meta-device build: each rank draws its blocks, equal to the ordinary build's weights.
    meta = fully_shard_model(_model(seed=5, device="meta"), fsdp_unit_modules=[Block], init_model_with_meta_device=True,
                             preproc_state_dict_for_dcp_ckpt=False)
    ordinary = dict(_model(seed=5).named_parameters())
    out["meta_init_err"] = max((w - ordinary[n]).abs().max().item() for n, w in _full_weights(meta).items())

    # 5. Uneven DTensors: rank r holds rows [0, 1) / [1, 5) of a 5 x 3 tensor.
    whole = torch.arange(15.0).view(5, 3)
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp", tp_dim="tp")
    rows = (0, 1) if rank == 0 else (1, 5)
    dt = make_fsdp_dtensor(whole[rows[0]:rows[1]].clone(), torch.nn.Parameter(torch.empty(5, 3)), index,
                           run_check=True)
    meta_chunk = gather_and_compute_chunk_metadata(dt)
    out["uneven_chunk"] = (tuple(meta_chunk.offsets), tuple(meta_chunk.sizes))
    out["uneven_gather"] = torch.equal(gather_uneven_dtensor_to_full_tensor(dt).to_local(), whole)
    pieces = [gather_uneven_dtensor_to_full_tensor(p).to_local() for p in split_dtensor(dt, [2, 3], dim=0)]
    out["uneven_split"] = all(torch.equal(a, b) for a, b in zip(pieces, torch.split(whole, [2, 3])))
    # 6. DataParallelBuffer: each rank stores its shard of a flat bucket of two parameters; gathering the shards
    # gives back both parameters (6 + 5 elements, padded to 12: rank 0 holds [0, 6), rank 1 [6, 12)).
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import DataParallelBuffer

    weights = [torch.arange(6.0).view(2, 3), torch.arange(10.0, 15.0)]
    buf = DataParallelBuffer(DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params"),
                             [torch.nn.Parameter(w.clone()) for w in weights], True, 0)
    buf.init_data(torch.zeros(buf.data_size))
    for i, w in enumerate(weights):
        buf.set_item(i, w)
    bucket = buf.fetch_bucket()
    torch.distributed.all_gather(list(bucket.data.chunk(world)), buf.get_shard_from_local_buffer())
    out["buffer_roundtrip"] = all(torch.equal(buf.get_item_from_bucket(bucket, i), w.flatten())
                                  for i, w in enumerate(weights))
    out["buffer_shard_part"] = (buf.data_size, buf.locate_item_in_global_item(1), buf.get_item(1).tolist())
    gap = make_fsdp_dtensor(torch.zeros(1, 3), torch.nn.Parameter(torch.empty(5, 3)), index)  # rows 0..2 only
    try:
        validate_uneven_dtensor(gap)
        out["uneven_gap_refused"] = False
    except AssertionError:
        out["uneven_gap_refused"] = True
    return out


def test_fully_shard_trains_like_an_unsharded_model_on_two_gloo_ranks():
    results = run_distributed(_fsdp_body, 2, timeout=120)
    for rank, out in enumerate(results):
        assert out["zero3_dtensor_shards"]
        assert out["no_shard_whole"]
        for key in ("zero3_losses", "zero2_losses", "no_shard_losses", "hsdp_losses"):
            ours, ref = out[key]
            assert ours == pytest.approx(ref, rel=1e-5, abs=1e-6), key
        assert out["zero3_weights_err"] < 1e-5 and out["zero2_weights_err"] < 1e-5
        assert out["state_dict_keys"] and out["reload_err"] < 1e-5
        assert out["bf16"] == ({torch.float32}, torch.bfloat16)
        assert out["head_chunk"] == (((0, 0), (3, HIDDEN)) if rank == 0 else ((3, 0), (2, HIDDEN)))
        assert out["zero2_index"]
        assert out["meta_init_err"] == 0.0
        assert out["uneven_chunk"] == (((0, 0), (1, 3)) if rank == 0 else ((1, 0), (4, 3)))
        assert out["uneven_gather"] and out["uneven_split"] and out["uneven_gap_refused"]
        assert out["buffer_roundtrip"]
        assert out["buffer_shard_part"] == ((6, (0, 0), []) if rank == 0 else (6, (0, 5), [10.0, 11, 12, 13, 14]))


def test_megatron_fsdp_names_without_a_process_group():
    assert mfsdp.__version__ == "0.3.1" and mfsdp.__package_name__ == "megatron_fsdp"
    assert mfsdp.DistributedDataParallelConfig is DistributedDataParallelConfig
    assert [s.name for s in fs_mod.ShardingStrategy] == ["NO_SHARD", "OPTIM", "OPTIM_GRADS", "OPTIM_GRADS_PARAMS"]
    assert fs_mod.experimental_api(lambda: 1)._experimental_api
    assert [s.name for s in core_mod.TrainingState] == ["FORWARD", "PRE_BACKWARD", "POST_BACKWARD", "IDLE"]
    assert list(inspect.signature(fs_mod.fully_shard).parameters)[:3] == ["module", "optimizer", "device_mesh"]
    sig = fs_utils.create_updated_function_signature(lambda a, b=1: None, flag=True)
    assert str(sig) == "(a, b=1, *, flag: bool = True)"

    # RegisterFSDPBackwardFunction: identity forward; the hook runs once, before the gradient passes on.
    calls = []
    x = torch.ones(3, requires_grad=True)
    (y,) = core_mod.RegisterFSDPBackwardFunction.apply(lambda: calls.append(1), x * 2)
    (y * torch.arange(3.0)).sum().backward()
    assert calls == [1] and torch.equal(x.grad, 2 * torch.arange(3.0))

    # Gradient pre-scaling: the reduced value is scaling_factor * sum.
    cfg = mfsdp.DistributedDataParallelConfig()
    g = torch.full((4,), 3.0)
    assert pgb.gradient_reduce_preprocessing(g, 0.5, cfg) == torch.distributed.ReduceOp.SUM
    assert torch.equal(g, torch.full((4,), 1.5))
    assert pgb.gradient_reduce_preprocessing(g, None, cfg) == torch.distributed.ReduceOp.SUM
    assert torch.equal(g, torch.full((4,), 1.5))
    assert pgb.BucketingPolicy().suggested_bucket_size == 40_000_000 and pgb.PrefetchOrder(1).name == \
        "BACKWARD_PASS_ORDER" and pgb.BucketStatus(3).name == "READY_TO_USE"

    p = torch.nn.Parameter(torch.empty(2, 2))
    assert not fs_utils.is_mcore_tensor_model_parallel(p)
    p.tensor_model_parallel, p.partition_dim = True, 1
    assert fs_utils.is_mcore_tensor_model_parallel(p) and fs_utils.get_mcore_tensor_parallel_partition_dim(p) == 1
    assert fs_utils.get_mesh_names(None) == [] and not fs_utils.contains_submesh(None, "dp")
    buf = fs_utils.get_global_memory_buffer()
    assert buf is fs_utils.get_global_memory_buffer() and buf.get_tensor((2, 3), torch.float32, "x").shape == (2, 3)

    with pytest.raises(ValueError, match="Invalid FSDP / inner DP sharding strategy"):
        fs_mod._strategy_name(7, fs_mod._STRATEGY_NAMES, "FSDP / inner DP sharding strategy")
    with pytest.raises(ValueError, match="outer_dp_sharding_strategy"):
        mfsdp.DistributedDataParallelConfig(outer_dp_sharding_strategy="optim")


def test_buffer_layout_and_bucket_allocators():
    from types import SimpleNamespace

    # Cells of 4 over 2 ranks. Hand layout: item 0 (6) at 0 leaves a gap of 2 in cell [4, 8); item 3 (5, remainder
    # 1) is pulled in to end its remainder at 8 -> [7, 12); the small item 4 (1) fills [6, 7); item 2 (8) at 12;
    # the small item 1 (2) left over goes at 20. 22 elements padded to a multiple of 2 * 4: 24.
    shapes = [torch.Size([6]), torch.Size([2]), torch.Size([2, 4]), torch.Size([5]), torch.Size([1])]
    cfg = mfsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    index, bucket, shard = pgb.build_data_parallel_buffer_index(shapes, 1, 2, True, cfg, bucket_id=3,
                                                                chunk_size_factor=4)
    assert {i: (t.global_data_index, t.size) for i, t in index.items()} == \
        {0: (0, 6), 3: (7, 5), 4: (6, 1), 2: (12, 8), 1: (20, 2)}
    assert [t.item_id for t in bucket.items] == [0, 3, 4, 2, 1] and bucket.size == 24 and bucket.bucket_id == 3
    assert tuple(shard) == (3, 12, 0, 12, 12)
    _, unsharded, virtual = pgb.build_data_parallel_buffer_index(
        shapes, 1, 2, False, mfsdp.DistributedDataParallelConfig(), chunk_size_factor=4)
    assert unsharded.size == 22 and tuple(virtual) == (0, 11, 11, 11, 11)

    temp = pgb.StorageResizeBasedBucketAllocator()
    data = temp.allocate(0, 6, torch.float32, torch.device("cpu")).data
    temp.free(0)
    assert data.untyped_storage().nbytes() == 0
    assert temp.allocate(0, 6, torch.float32, torch.device("cpu")).data is data
    assert data.untyped_storage().nbytes() == 24

    rotary = pgb.RotaryBucketAllocator("t_rot")
    a = rotary.allocate(0, 4, torch.float32, torch.device("cpu"))
    rotary.allocate(1, 4, torch.float32, torch.device("cpu"))
    rotary.free(0)
    c = rotary.allocate(2, 4, torch.float32, torch.device("cpu"))  # reuses bucket 0's buffer
    assert c.data.data_ptr() == a.data.data_ptr() and rotary.num_global_buffer == 2

    # Two units of two equal buckets each share 2 x 2 pooled buffers; bucket 4 (no unit) uses the backup allocator.
    groups = [SimpleNamespace(fsdp_unit_id=u, dtype=torch.float32, params=[torch.empty(n)])
              for u, n in ((0, 3), (0, 5), (1, 3), (1, 5), (None, 7))]
    pool = pgb.FixedPoolAllocator("t_pool", groups)
    assert pool.fsdp_double_buffer_units == [0, 1]
    b0, b2 = (pool.allocate(i, 3, torch.float32, torch.device("cpu")) for i in (0, 2))
    assert b0.data.data_ptr() != b2.data.data_ptr() and pool.using_buffer == {0: (0, 0), 2: (1, 0)}
    pool.free(0)
    assert pool.allocate(4, 7, torch.float32, torch.device("cpu")).data.numel() == 7
    assert 4 in pool.backup_allocator.buckets
