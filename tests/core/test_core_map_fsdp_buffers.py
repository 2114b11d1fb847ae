"""megatron-core's Megatron-FSDP buffer engine (``megatron_fsdp.param_and_grad_buffer``: ParamAndGradBuffer,
AllGatherPipeline, GradReducePipeline) on 2 gloo ranks, against an independent reference: the same small model,
unsharded, run by plain PyTorch on the whole batch.

One launch checks, per sharding strategy: gathering every weight bucket gives back the full weights (and
releasing frees them); gradients computed on each rank's half of the batch, reduced by the pipeline, give each
rank its shard (or with ``no_shard`` all) of the full-batch gradient.
"""
import torch

from helpers.dist_harness import run_distributed

ROWS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _batch(world):
    g = torch.Generator().manual_seed(1)
    return torch.randn(world * ROWS, 8, generator=g), torch.randn(world * ROWS, 3, generator=g)


def _reference(world):
    model = _model()
    x, y = _batch(world)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, {n: p.grad for n, p in
                                                                          model.named_parameters()}


def _body():
    from torch.distributed.device_mesh import init_device_mesh

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        AllGatherPipeline, BucketingPolicy, BucketStatus, GradReducePipeline, ParamAndGradBuffer)
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    index = FSDPDistributedIndex(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), dp_shard_dim="dp")
    ref_w, ref_g = _reference(world)
    x, y = (t[rank * ROWS:(rank + 1) * ROWS] for t in _batch(world))
    out = {}
    for strategy, avg in (("optim_grads_params", False), ("optim", False), ("no_shard", True)):
        cfg = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, average_in_collective=avg)
        model = _model()
        params = dict(model.named_parameters())
        buf = ParamAndGradBuffer(cfg, model, BucketingPolicy(suggested_bucket_size=40), index,
                                 gradient_scaling_factor=1.0 / world, device=torch.device("cpu"))
        res = {"buckets": buf.num_buckets}
        res["sharded_away"] = all(p.untyped_storage().nbytes() == 0 for p in params.values()) \
            == (strategy == "optim_grads_params")
        if strategy != "no_shard":
            ag = AllGatherPipeline(buf)
            ag.all_gather_params(list(params.values()), async_param_gather=False)
            res["gathered"] = all(torch.equal(params[n], ref_w[n]) for n in ref_w)
            res["ready"] = all(ag.bucket_status[ag.get_bucket_key(b, False)] is BucketStatus.READY_TO_USE
                               for b in range(buf.num_buckets))
        loss = torch.nn.functional.mse_loss(model(x), y)  # this rank's half batch
        grads = torch.autograd.grad(loss, list(params.values()))
        for p, g in zip(params.values(), grads):
            p.get_main_grad().copy_(g)
        pipe = GradReducePipeline(buf)
        pipe.reduce_gradients(list(params.values()))
        pipe.wait_for_previous_grad_reduce(0)
        err, opt_grads = 0.0, True
        buf.update_main_grads()
        for n, q in buf.optimizer_named_parameters:
            p = params[n]
            gbuf = buf.parameter_groups[buf.param_to_param_group[p]].main_grad_buffer
            i = gbuf.param_idx[p]
            lo, hi = gbuf._get_item_slice_in_shard(i) if strategy != "no_shard" else (0, p.numel())
            mine = gbuf.get_item(i, only_shard=strategy != "no_shard")
            err = max(err, (mine - ref_g[n].flatten()[lo:hi]).abs().max().item() if hi > lo else 0.0)
            opt_grads &= q.grad is None if hi == lo else torch.equal(q.grad.to_local().flatten(), mine)
        res["grad_err"], res["opt_grads"] = err, opt_grads
        if strategy != "no_shard":
            ag.reset()
            res["released"] = (set(ag.bucket_status.values()) == {BucketStatus.EMPTY},
                               strategy != "optim_grads_params" or all(
                                   p.untyped_storage().nbytes() == 0 for p in params.values()))
        pipe.reset()
        out[strategy] = res
    return out


def test_param_and_grad_buffer_gathers_weights_and_reduces_gradients_on_two_gloo_ranks():
    results = run_distributed(_body, 2, timeout=60)
    for out in results:
        for strategy, res in out.items():
            assert res["buckets"] == 2, (strategy, res)
            assert res["grad_err"] < 1e-6, (strategy, res)
            assert res["opt_grads"] and res["sharded_away"], (strategy, res)
            if strategy != "no_shard":
                assert res["gathered"] is True and res["ready"] is True, (strategy, res)
                assert res["released"] == (True, True), (strategy, res)
