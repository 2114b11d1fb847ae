"""The distributed optimizer (ZeRO-1) against the plain optimizer on DP=2 and DP=4.

The toy model's parameter sizes (78, 13, 143, 11, 11, 11, 55, 5) do not divide by the DP size, so shard
boundaries cut through parameters and buckets need padding. Checked on every rank:

* fp32: parameters, grad norms (clipping active) and zero counts after 3 steps equal the plain
  optimizer's (1e-6 relative);
* get_parameter_state on DP rank 0 holds, in buffer order (reverse parameter order, padding removed),
  exactly the plain optimizer's parameters and Adam moments;
* state_dict + get_parameter_state, saved with torch.save, load into a fresh optimizer whose DDP uses a
  different bucket layout, and training continues identically;
* bf16 (fp32 grad reduction) tracks the non-distributed bf16 optimizer; fp16 with an overflow injected
  into the shard of the last DP rank only: every rank skips the step.
"""
import copy
import io
import os

import pytest
import torch

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed
from helpers.optim_helpers import ToyModel, dp_slice, init_parallel, make_config, toy_batch, toy_loss


def _build(base, dtype, distributed, bucket_size=100, seed_model=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    module = copy.deepcopy(base if seed_model is None else seed_model).to(dtype)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float16,
                                               use_distributed_optimizer=distributed,
                                               overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size)
    model = DistributedDataParallel(make_config(), ddp_config, module)
    cfg = OptimizerConfig(lr=0.02, weight_decay=0.1, clip_grad=0.05, log_num_zeros_in_grad=True,
                          bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, initial_loss_scale=2 ** 10,
                          hysteresis=1, use_distributed_optimizer=distributed)
    return model, get_megatron_optimizer(cfg, [model])


def _step(model, opt, step, dp, r, inject=None):
    model.zero_grad_buffer()
    opt.zero_grad()
    x, y = toy_batch(4 * dp, step=step)
    if step == 1:
        x[:, 0] = 0.0  # gives exactly 13 zero gradient entries in fc1.weight
    opt.scale_loss(toy_loss(model, dp_slice(x, r, dp), dp_slice(y, r, dp))).backward()
    model.finish_grad_sync()
    if inject is not None:
        inject(model)
    return opt.step()


def distrib_body(dp, tmpdir):
    from megatron.core import parallel_state

    init_parallel()
    r = parallel_state.get_data_parallel_rank()
    base = ToyModel()
    out = {}

    # 1. fp32: distributed vs plain optimizer.
    plain, plain_opt = _build(base, torch.float32, distributed=False)
    dist, dist_opt = _build(base, torch.float32, distributed=True)
    out["shards_cut_params"] = any(
        rng.numel != p.numel() for p, rng in dist_opt.param_ranges.items())
    out["padded"] = any(b.numel != b.numel_unpadded for b in dist.param_and_grad_buffers)
    results = []
    for step in range(3):
        a = _step(plain, plain_opt, step, dp, r)
        b = _step(dist, dist_opt, step, dp, r)
        results.append((a[0], b[0], abs(a[1] - b[1]) / a[1], a[2], b[2]))
    out["fp32_steps"] = results
    out["fp32_params"] = max(rel_err(p, q) for p, q in zip(dist.parameters(), plain.parameters()))

    # 2. The distrib_optim.pt content, checked against the plain optimizer's parameters and moments.
    state = dist_opt.get_parameter_state()
    if r == 0:
        entry = state[0][(torch.float32, torch.float32)]
        params = list(reversed(list(plain.module.parameters())))
        adam = plain_opt.optimizer.state
        out["format_keys"] = sorted(k for k in state if not isinstance(k, int)) + sorted(entry)
        out["format_numel"] = entry["numel_unpadded"]
        out["format_param"] = rel_err(entry["param"], torch.cat([p.detach().view(-1) for p in params]))
        out["format_exp_avg"] = rel_err(entry["exp_avg"], torch.cat([adam[p]["exp_avg"].view(-1) for p in params]))
        out["format_exp_avg_sq"] = rel_err(entry["exp_avg_sq"],
                                       torch.cat([adam[p]["exp_avg_sq"].view(-1) for p in params]))
    else:
        out["format_none_elsewhere"] = state is None

    # 3. Round trip through torch.save into a fresh model with one big bucket (another padding layout).
    #    As in Megatron's checkpoints, DP rank 0 writes the optimizer state_dict that every rank loads.
    optimizer_sd = dist_opt.state_dict()
    blob = [None]
    if r == 0:
        buf = io.BytesIO()
        torch.save({"optimizer": optimizer_sd, "param_state": state}, buf)
        blob = [buf.getvalue()]
    torch.distributed.broadcast_object_list(blob, src=0)
    saved = torch.load(io.BytesIO(blob[0]), weights_only=False)
    fresh, fresh_opt = _build(base, torch.float32, distributed=True, bucket_size=None, seed_model=ToyModel(seed=5))
    fresh.load_state_dict(dist.state_dict())
    fresh_opt.load_state_dict(saved["optimizer"])
    fresh_opt.load_parameter_state(saved["param_state"] if r == 0 else None)
    # The file path form (distrib_optim.pt) gives the same shards.
    path = os.path.join(tmpdir, "distrib_optim.pt")
    dist_opt.save_parameter_state(path)
    from_file, from_file_opt = _build(base, torch.float32, distributed=True, seed_model=ToyModel(seed=6))
    from_file.load_state_dict(dist.state_dict())
    from_file_opt.load_state_dict(saved["optimizer"])
    from_file_opt.load_parameter_state(path if r == 0 else None)
    out["group_steps"] = [g["step"] for g in optimizer_sd["optimizer"]["param_groups"]]
    for step in range(3, 5):
        _step(plain, plain_opt, step, dp, r)
        _step(dist, dist_opt, step, dp, r)
        _step(fresh, fresh_opt, step, dp, r)
        _step(from_file, from_file_opt, step, dp, r)
    out["roundtrip_vs_dist"] = max(rel_err(p, q) for p, q in zip(fresh.parameters(), dist.parameters()))
    out["roundtrip_vs_plain"] = max(rel_err(p, q) for p, q in zip(fresh.parameters(), plain.parameters()))
    out["roundtrip_file"] = max(rel_err(p, q) for p, q in zip(from_file.parameters(), dist.parameters()))

    # 4. bf16 params: distributed vs non-distributed mixed-precision optimizer.
    plain16, plain16_opt = _build(base, torch.bfloat16, distributed=False)
    dist16, dist16_opt = _build(base, torch.bfloat16, distributed=True)
    for step in range(3):
        _step(plain16, plain16_opt, step, dp, r)
        _step(dist16, dist16_opt, step, dp, r)
    out["bf16_params"] = max(rel_err(p.float(), q.float()) for p, q in zip(dist16.parameters(), plain16.parameters()))
    mains = {p: m for g1, g2 in zip(plain16_opt.float16_groups, plain16_opt.fp32_from_float16_groups)
             for p, m in zip(g1, g2)}
    out["bf16_main_shards"] = max(
        rel_err(dist16_opt.optimizer.param_groups[gi]["params"][order],
            mains[_same_param(plain16, dist16, p)].view(-1)[dist16_opt.param_ranges[p].param_start:
                                                            dist16_opt.param_ranges[p].param_end])
        for p, (gi, order) in dist16_opt.model_param_group_index_map.items())

    # 5. fp16 with an overflow only inside the last DP rank's shard: everyone skips and backs off.
    dist_fp16, opt_fp16 = _build(base, torch.float16, distributed=True)

    def overflow_on_last_rank(model):
        if r == dp - 1:
            bucket = model.param_and_grad_buffers[0].buckets[0]
            shard = bucket.grad_data.numel() // dp
            bucket.grad_data[r * shard] = float("inf")

    trace = []
    for step in range(3):
        before = [p.detach().clone() for p in dist_fp16.parameters()]
        ok = _step(dist_fp16, opt_fp16, step, dp, r, inject=overflow_on_last_rank if step == 1 else None)[0]
        unchanged = all(torch.equal(a, p) for a, p in zip(before, dist_fp16.parameters()))
        trace.append((ok, unchanged, opt_fp16.get_loss_scale().item()))
    out["fp16_trace"] = trace
    return out


def _same_param(plain_model, dist_model, dist_param):
    """The parameter of ``plain_model`` with the same name as ``dist_param`` in ``dist_model``."""
    name = {p: n for n, p in dist_model.module.named_parameters()}[dist_param]
    return dict(plain_model.module.named_parameters())[name]


@pytest.mark.parametrize("dp", [2, 4])
def test_distributed_optimizer_matches_plain_optimizer(dp, tmp_path):
    results = run_distributed(distrib_body, dp, dp, str(tmp_path), timeout=150)
    for rank, out in enumerate(results):
        assert out["shards_cut_params"] and out["padded"], "the layout must exercise uneven shard boundaries"
        for ok_plain, ok_dist, norm_err, zeros_plain, zeros_dist in out["fp32_steps"]:
            assert ok_plain and ok_dist and norm_err < 1e-6 and zeros_plain == zeros_dist, out["fp32_steps"]
        assert out["fp32_steps"][1][3] >= 13, out["fp32_steps"]
        assert out["fp32_params"] < 1e-6, (rank, out)
        assert out["roundtrip_vs_dist"] < 1e-6 and out["roundtrip_vs_plain"] < 1e-6, (rank, out)
        assert out["roundtrip_file"] < 1e-6, (rank, out)
        assert out["bf16_main_shards"] < 1e-6, (rank, out)
        assert out["bf16_params"] < 5e-3, (rank, out)  # a bf16 rounding flip at most
        assert out["fp16_trace"] == [(True, False, 1024.0), (False, True, 512.0), (True, False, 512.0)], out
        assert out["group_steps"] == [3, 3], out["group_steps"]
        if rank == 0:
            assert out["format_keys"] == ["buckets_coalesced", "exp_avg", "exp_avg_sq", "numel_unpadded", "param"]
            assert out["format_numel"] == 327, out
            for key in ("format_param", "format_exp_avg", "format_exp_avg_sq"):
                assert out[key] < 1e-6, (key, out[key])
        else:
            assert out["format_none_elsewhere"]
