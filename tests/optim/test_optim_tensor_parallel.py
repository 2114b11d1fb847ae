"""Optimizer behaviour across a tensor-parallel group (TP=2), against the unsharded model.

* the global grad norm returned by step() (and the clipped update) equals the unsharded model's, with the
  replicated parameters (row-parallel bias, layer norm) counted once; zero counting likewise;
* an overflow seen on one TP rank only makes both ranks skip the step and back off the loss scale;
* finalize_model_grads sums the sequence-parallel layer-norm gradients over the TP group.
"""
import copy

import torch

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed
from helpers.optim_helpers import init_parallel, make_config

S, B, H_IN, H_MID, H_OUT = 4, 3, 6, 12, 5


class FullModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.fc1 = torch.nn.Linear(H_IN, H_MID)
        self.fc2 = torch.nn.Linear(H_MID, H_OUT)
        self.norm = torch.nn.LayerNorm(H_OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.norm(self.fc2(torch.tanh(self.fc1(x))))


def _tp_model(full, config, tp, r):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class TPModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            init = torch.nn.init.zeros_
            self.fc1 = ColumnParallelLinear(H_IN, H_MID, config=config, init_method=init, bias=True)
            self.fc2 = RowParallelLinear(H_MID, H_OUT, config=config, init_method=init, bias=True,
                                         input_is_parallel=True)
            self.norm = torch.nn.LayerNorm(H_OUT)

        def forward(self, x):
            return self.norm(self.fc2(torch.tanh(self.fc1(x)[0]))[0])

    model = TPModel()
    with torch.no_grad():
        model.fc1.weight.copy_(full.fc1.weight.chunk(tp, 0)[r])
        model.fc1.bias.copy_(full.fc1.bias.chunk(tp, 0)[r])
        model.fc2.weight.copy_(full.fc2.weight.chunk(tp, 1)[r])
        model.fc2.bias.copy_(full.fc2.bias)
        model.norm.load_state_dict(full.norm.state_dict())
    return model


def _shards_of_full(full, tp, r):
    return [full.fc1.weight.chunk(tp, 0)[r], full.fc1.bias.chunk(tp, 0)[r], full.fc2.weight.chunk(tp, 1)[r],
            full.fc2.bias, full.norm.weight, full.norm.bias]


def _data(step, zero_col=False):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(S, B, H_IN, generator=g), torch.randn(S, B, H_OUT, generator=g)
    if zero_col:
        x[..., 0] = 0.0
    return x, y


def tp_body(tp):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    init_parallel(tp=tp)
    r = parallel_state.get_tensor_model_parallel_rank()
    config = make_config(tp=tp, perform_initialization=False)
    full = FullModel()
    out = {}

    # 1. Clipping + zero counting, fp32, 3 steps, against the unsharded model with torch's AdamW and clip.
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), _tp_model(full, config, tp, r))
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.01, weight_decay=0.1, clip_grad=0.3,
                                                 log_num_zeros_in_grad=True), [model])
    ref = copy.deepcopy(full)
    decay = [ref.fc1.weight, ref.fc2.weight]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": [ref.fc1.bias, ref.fc2.bias, ref.norm.weight, ref.norm.bias],
                                  "weight_decay": 0.0}], lr=0.01, foreach=False)
    norm_errs, zeros_match = [], []
    for step in range(3):
        x, y = _data(step, zero_col=step == 0)
        model.zero_grad_buffer()
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        finalize_model_grads([model])
        ok, norm, zeros = opt.step()
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_zeros = sum(int((p.grad == 0).sum()) for p in ref.parameters())
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3).item()
        ref_opt.step()
        norm_errs.append(abs(norm - ref_norm) / ref_norm)
        zeros_match.append((zeros, ref_zeros))
    out["clip_norm"] = max(norm_errs)
    out["clip_norm_was_active"] = ref_norm > 0.3
    out["zeros"] = zeros_match
    out["params_after_clip"] = max(rel_err(p, q) for p, q in zip(model.module.parameters(), _shards_of_full(ref, tp, r)))

    # 2. fp16: an overflow on TP rank 1 only -> both ranks skip and halve the scale (hysteresis 1).
    model16 = DistributedDataParallel(config, DistributedDataParallelConfig(),
                                      _tp_model(full, config, tp, r).half())
    opt16 = get_megatron_optimizer(OptimizerConfig(lr=0.01, fp16=True, initial_loss_scale=256.0, hysteresis=1),
                                   [model16])
    trace = []
    for step in range(3):
        x, y = _data(step)
        model16.zero_grad_buffer()
        opt16.zero_grad()
        opt16.scale_loss(((model16(x.half()).float() - y) ** 2).mean()).backward()
        finalize_model_grads([model16])
        if step == 1 and r == tp - 1:
            model16.module.fc1.weight.main_grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model16.parameters()]
        ok = opt16.step()[0]
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model16.parameters()))
        trace.append((ok, unchanged, opt16.get_loss_scale().item()))
    out["found_inf_trace"] = trace

    # 3. Sequence parallelism: each TP rank normalises its own sequence shard; the layer-norm gradients
    #    must be summed over TP to equal the full-sequence gradient.
    sp_config = make_config(tp=tp, sequence_parallel=True)
    norm = torch.nn.LayerNorm(H_OUT)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(1))
        norm.bias.normal_(generator=torch.Generator().manual_seed(2))
    ref_norm_module = copy.deepcopy(norm)
    for p in norm.parameters():
        p.sequence_parallel = True
    sp_model = DistributedDataParallel(sp_config, DistributedDataParallelConfig(), norm)
    gen = torch.Generator().manual_seed(9)
    x, y = torch.randn(S, B, H_OUT, generator=gen), torch.randn(S, B, H_OUT, generator=gen)
    sp_model.zero_grad_buffer()
    ((sp_model(x.chunk(tp, 0)[r]) * y.chunk(tp, 0)[r]).sum()).backward()
    finalize_model_grads([sp_model])
    ((ref_norm_module(x) * y).sum()).backward()
    out["sp_layernorm"] = max(rel_err(p.main_grad, q.grad) for p, q in zip(norm.parameters(),
                                                                       ref_norm_module.parameters()))
    return out


def test_tensor_parallel_clip_zeros_found_inf_and_sequence_parallel_grads():
    results = run_distributed(tp_body, 2, 2, timeout=120)
    for out in results:
        assert out["clip_norm"] < 1e-6 and out["clip_norm_was_active"], out
        assert out["params_after_clip"] < 1e-6, out
        for ours, ref in out["zeros"]:
            assert ours == ref, out["zeros"]
        assert out["zeros"][0][0] >= 12, "the zeroed input column must give 12 zero weight-gradient entries"
        # (update ok, params unchanged, loss scale): step 1 overflowed on one rank only.
        assert out["found_inf_trace"] == [(True, False, 256.0), (False, True, 128.0), (True, False, 128.0)], out
        assert out["sp_layernorm"] < 1e-6, out
