"""Megatron's DDP (contiguous grad buffers) against a single-process run over the concatenated batch.

Each DP rank computes the mean loss of its slice of the global batch; after the DP reduction every
``main_grad`` must equal the gradient of the mean loss over the whole batch computed by plain autograd in
one process (within 1e-6 relative). Covered: one bucket vs several small buckets with overlap (and that the
overlapped reductions really started during backward), ``no_sync`` accumulation over micro-batches across
two iterations, bf16 params with fp32 and bf16 reduction, tensor-parallel layers that accumulate into
``main_grad`` themselves, the ``--DDP-impl torch`` wrapper, the legacy alias, ``broadcast_params`` and
``check_for_nan_in_grad``.
"""
import copy

import pytest
import torch

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed
from helpers.optim_helpers import (
    ToyModel,
    dp_slice,
    init_parallel,
    main_grads,
    make_config,
    reference_grads,
    toy_batch,
    toy_loss,
)


def _worst(ours, ref):
    return max(rel_err(ours[n], ref[n]) for n in ref)


def _buckets(model):
    return [b for buf in model.param_and_grad_buffers for b in buf.buckets]


def ddp_body(dp):
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        TorchDistributedDataParallel,
    )
    from megatron.core.distributed.legacy import DistributedDataParallel as LegacyDDP
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    init_parallel()
    r = parallel_state.get_data_parallel_rank()
    assert parallel_state.get_data_parallel_world_size() == dp
    config = make_config()
    base = ToyModel()
    x, y = toy_batch(4 * dp)
    ref = reference_grads(base, x, y)
    out = {}

    # 1. one bucket (no overlap) and several small buckets reduced during backward (overlap).
    for name, ddp_config in [
        ("one_bucket", DistributedDataParallelConfig()),
        ("overlap_small_buckets", DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=100)),
    ]:
        model = DistributedDataParallel(config, ddp_config, copy.deepcopy(base))
        model.zero_grad_buffer()
        toy_loss(model, dp_slice(x, r, dp), dp_slice(y, r, dp)).backward()
        issued = [b.communication_issued for b in _buckets(model)]
        model.finish_grad_sync()
        out[name] = _worst(main_grads(model), ref)
        out[name + "_buckets"] = len(issued)
        out[name + "_issued_in_backward"] = all(issued)
        out[name + "_grad_cleared"] = all(p.grad is None for p in model.parameters())

    # 2. no_sync: two micro-batches per rank, two iterations (buffers must be reset between them).
    model = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=100),
                                    copy.deepcopy(base))
    errs, silent = [], []
    for step in range(2):
        xs, ys = toy_batch(4 * dp, step=step)
        ref_step = reference_grads(base, xs, ys)
        model.zero_grad_buffer()
        x_mb = dp_slice(xs, r, dp).chunk(2)
        y_mb = dp_slice(ys, r, dp).chunk(2)
        with model.no_sync():
            (toy_loss(model, x_mb[0], y_mb[0]) / 2).backward()
        silent.append(not any(b.communication_issued for b in _buckets(model)))
        (toy_loss(model, x_mb[1], y_mb[1]) / 2).backward()
        model.finish_grad_sync()
        errs.append(_worst(main_grads(model), ref_step))
    out["no_sync"] = max(errs)
    out["no_sync_silent"] = all(silent)

    # 3. bf16 parameters: fp32 buffer (--accumulate-allreduce-grads-in-fp32) and bf16 buffer.
    base16 = copy.deepcopy(base).to(torch.bfloat16)
    ref16 = None
    for k in range(dp):  # the bf16 gradient of every rank's slice, averaged in fp64 here
        m = copy.deepcopy(base16)
        toy_loss(m, dp_slice(x, k, dp), dp_slice(y, k, dp)).backward()
        g = {n: p.grad.double() / dp for n, p in m.named_parameters()}
        ref16 = g if ref16 is None else {n: ref16[n] + g[n] for n in g}
    for name, fp32 in [("bf16_fp32_reduce", True), ("bf16_bf16_reduce", False)]:
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=fp32, overlap_grad_reduce=True, bucket_size=100)
        model = DistributedDataParallel(config, ddp_config, copy.deepcopy(base16))
        model.zero_grad_buffer()
        toy_loss(model, dp_slice(x, r, dp), dp_slice(y, r, dp)).backward()
        model.finish_grad_sync()
        grads = main_grads(model)
        out[name + "_dtype"] = str({g.dtype for g in grads.values()})
        out[name] = _worst(grads, ref16)

    # 4. Tensor-parallel layers with gradient accumulation fusion add the weight grad into main_grad and
    #    return None: the hook must neither miss nor double-count them, and overlap must still fire.
    fused_config = make_config(gradient_accumulation_fusion=True, perform_initialization=False)

    class TPModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            init = torch.nn.init.zeros_
            self.fc1 = ColumnParallelLinear(6, 13, config=fused_config, init_method=init, bias=True)
            self.fc2 = RowParallelLinear(13, 5, config=fused_config, init_method=init, bias=True,
                                         input_is_parallel=True)

        def forward(self, inp):
            return self.fc2(torch.tanh(self.fc1(inp)[0]))[0]

    plain = torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    torch.manual_seed(5)
    for p in plain.parameters():
        torch.nn.init.normal_(p)
    def make_tp_model():
        tp_model = TPModel()
        with torch.no_grad():
            for (_, src), (_, dst) in zip(plain.named_parameters(), tp_model.named_parameters()):
                dst.copy_(src)
        return tp_model

    tp_model = make_tp_model()
    model = DistributedDataParallel(fused_config, DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                                bucket_size=50), tp_model)
    xt = torch.randn(4 * dp, 6, generator=torch.Generator().manual_seed(3))
    yt = torch.randn(4 * dp, 5, generator=torch.Generator().manual_seed(4))
    ref_plain = copy.deepcopy(plain)
    ((ref_plain(xt) - yt) ** 2).mean().backward()
    model.zero_grad_buffer()
    ((model(dp_slice(xt, r, dp)) - dp_slice(yt, r, dp)) ** 2).mean().backward()
    out["fusion_issued_in_backward"] = all(b.communication_issued for b in _buckets(model))
    model.finish_grad_sync()
    ours = [p.main_grad for p in model.module.parameters()]
    out["fusion"] = max(rel_err(a, p.grad) for a, p in zip(ours, ref_plain.parameters()))

    # 5. --DDP-impl torch: torch's reducer, then main_grad = grad.
    model = TorchDistributedDataParallel(copy.deepcopy(base))
    model.zero_grad_buffer()
    toy_loss(model, dp_slice(x, r, dp), dp_slice(y, r, dp)).backward()
    model.finish_grad_sync()
    out["torch_ddp"] = _worst(main_grads(model), ref)

    # 5b. torch DDP over layers configured for gradient accumulation fusion: fusion is switched off.
    model = TorchDistributedDataParallel(make_tp_model())
    model.zero_grad_buffer()
    ((model(dp_slice(xt, r, dp)) - dp_slice(yt, r, dp)) ** 2).mean().backward()
    model.finish_grad_sync()
    out["torch_ddp_fusion_off"] = max(rel_err(p.main_grad, q.grad)
                                      for p, q in zip(model.module.parameters(), ref_plain.parameters()))

    # 6. The legacy signature and allreduce_gradients().
    model = LegacyDDP(copy.deepcopy(base), accumulate_allreduce_grads_in_fp32=True, use_contiguous_buffers=True)
    model.zero_grad_buffer()
    toy_loss(model, dp_slice(x, r, dp), dp_slice(y, r, dp)).backward()
    model.allreduce_gradients()
    out["legacy"] = _worst(main_grads(model), ref)

    # 7. broadcast_params: ranks other than DP rank 0 start from different weights.
    other = ToyModel(seed=99 + r) if r else copy.deepcopy(base)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), other)
    model.broadcast_params()
    out["broadcast"] = max(rel_err(p, q) for p, q in zip(model.module.parameters(), base.parameters()))

    # 8. check_for_nan_in_grad raises before the collective.
    model = DistributedDataParallel(config, DistributedDataParallelConfig(check_for_nan_in_grad=True),
                                    copy.deepcopy(base))
    model.zero_grad_buffer()
    toy_loss(model, dp_slice(x, r, dp) * float("nan"), dp_slice(y, r, dp)).backward()
    try:
        model.finish_grad_sync()
        out["nan_check_raised"] = False
    except RuntimeError as e:
        out["nan_check_raised"] = "NaN" in str(e)
    return out


@pytest.mark.parametrize("dp", [2, 4])
def test_ddp_matches_single_process_over_concatenated_batch(dp):
    results = run_distributed(ddp_body, dp, dp, timeout=120)
    for rank, out in enumerate(results):
        for key in ("one_bucket", "overlap_small_buckets", "no_sync", "fusion", "torch_ddp", "torch_ddp_fusion_off",
                    "legacy",
                    "bf16_fp32_reduce"):
            assert out[key] < 1e-6, (rank, key, out[key])
        assert out["broadcast"] == 0.0, out
        assert out["one_bucket_buckets"] == 1 and out["overlap_small_buckets_buckets"] >= 2, out
        assert out["overlap_small_buckets_issued_in_backward"] and out["fusion_issued_in_backward"], out
        assert not out["one_bucket_issued_in_backward"], "without overlap nothing should be reduced during backward"
        assert out["one_bucket_grad_cleared"] and out["no_sync_silent"], out
        assert out["bf16_fp32_reduce_dtype"] == "{torch.float32}", out
        assert out["bf16_bf16_reduce_dtype"] == "{torch.bfloat16}", out
        assert out["bf16_bf16_reduce"] < 2e-2, out  # bf16 rounding of the buffer itself
        assert out["nan_check_raised"], out


def test_ddp_config_bucket_sizes():
    from megatron.core.distributed import DistributedDataParallelConfig

    assert DistributedDataParallelConfig().effective_bucket_size() is None
    assert DistributedDataParallelConfig(overlap_grad_reduce=True).effective_bucket_size() == 40_000_000
    assert DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=7).effective_bucket_size() == 7
    assert DistributedDataParallelConfig(overlap_grad_reduce=True).effective_bucket_size(disable_bucketing=True) is None
    with pytest.raises(ValueError, match="bucket_size"):
        DistributedDataParallelConfig(bucket_size=0)
