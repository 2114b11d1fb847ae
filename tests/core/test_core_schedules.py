"""Pipeline schedules on a toy chain of virtual stages.

Virtual stage ``v`` computes ``tanh(x @ W_v)``; the last one's loss is the MSE to a target. The reference is
the same chain run sequentially in one process over every micro-batch. We check the losses, every stage's
weight gradient, the forward/backward order on each rank against the order the schedule's definition gives,
and forward_only.
"""
import functools

import pytest
import torch

from helpers.dist_harness import run_distributed

S, MB, H = 4, 2, 8


def _weight(v):
    return torch.randn(H, H, generator=torch.Generator().manual_seed(100 + v)) / H ** 0.5


def _micro_batch(m):
    g = torch.Generator().manual_seed(1000 + m)
    return torch.randn(S, MB, H, generator=g), torch.randn(S, MB, H, generator=g)


def reference(num_virtual, num_microbatches):
    weights = [_weight(v).requires_grad_(True) for v in range(num_virtual)]
    losses = []
    for m in range(num_microbatches):
        x, target = _micro_batch(m)
        for w in weights:
            x = torch.tanh(x @ w)
        loss = ((x - target) ** 2).mean()
        losses.append(loss.detach())
        (loss / num_microbatches).backward()
    return losses, [w.grad for w in weights]


class Stage(torch.nn.Module):
    def __init__(self, config, virtual_stage, num_virtual):
        super().__init__()
        self.config = config
        self.v = virtual_stage
        self.pre_process = virtual_stage == 0
        self.post_process = virtual_stage == num_virtual - 1
        self.weight = torch.nn.Parameter(_weight(virtual_stage))
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, x):
        if not self.pre_process:
            x = self.input_tensor
        return torch.tanh(x @ self.weight)


def _expected_order(pp, rank, num_chunks, num_microbatches, forward_only):
    """The (kind, chunk, microbatch) sequence a rank must run, from the schedules' definitions."""
    total = num_microbatches * num_chunks

    def chunk(k, forward):
        c = (k % (pp * num_chunks)) // pp
        return c if forward else num_chunks - 1 - c

    if pp == 1:
        order = []
        for m in range(num_microbatches):
            order += [("F", 0, m)] + ([] if forward_only else [("B", 0, m)])
        return order
    if forward_only:
        warmup = total
    elif num_chunks == 1:
        warmup = min(pp - rank - 1, num_microbatches)
    elif num_microbatches == pp:
        warmup = total
    else:
        warmup = min((pp - rank - 1) * 2 + (num_chunks - 1) * pp, total)
    steps = [("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [("F", warmup + k), ("B", k)]
    if not forward_only:
        steps += [("B", k) for k in range(total - warmup, total)]
    seen = {}
    order = []
    for kind, k in steps:
        c = chunk(k, kind == "F")
        n = seen.get((kind, c), 0)
        seen[(kind, c)] = n + 1
        order.append((kind, c, n))
    return order


def _run_layout(pp, vpp, num_microbatches, forward_only=False, grad_scale=None, deallocate=False):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(1, pp, vpp)
    try:
        rank = ps.get_pipeline_model_parallel_rank()
        num_chunks = vpp or 1
        num_virtual = pp * num_chunks
        config = TransformerConfig(num_layers=num_virtual, hidden_size=H, num_attention_heads=1,
                                   pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                   pipeline_dtype=torch.float32, deallocate_pipeline_outputs=deallocate)
        if grad_scale is not None:
            config.grad_scale_func = lambda loss: loss * grad_scale
        chunks = [Stage(config, c * pp + rank, num_virtual) for c in range(num_chunks)]
        trace = []

        def forward_step_func(data_iterator, model):
            m, x, target = next(data_iterator)
            out = model(x)
            chunk_id = chunks.index(model)
            trace.append(("F", chunk_id, m))
            if out.requires_grad:
                out.register_hook(lambda g, c=chunk_id, m=m: trace.append(("B", c, m)))

            def loss_func(target, output):
                loss = ((output - target) ** 2).mean()
                return loss, {"loss": loss.detach()}

            return out, functools.partial(loss_func, target)

        iters = [iter([(m,) + _micro_batch(m) for m in range(num_microbatches)]) for _ in chunks]
        fb = get_forward_backward_func()
        store = fb(forward_step_func=forward_step_func, data_iterator=iters if vpp else iters[0],
                   model=chunks if vpp else chunks[0], num_microbatches=num_microbatches, seq_length=S,
                   micro_batch_size=MB, forward_only=forward_only)
        return {
            "name": fb.__name__,
            "trace": trace,
            "expected": _expected_order(pp, rank, num_chunks, num_microbatches, forward_only),
            "losses": [d["loss"] for d in store],
            "grads": {c.v: (None if c.weight.grad is None else c.weight.grad.clone()) for c in chunks},
            "last": ps.is_pipeline_last_stage(ignore_virtual=True),
        }
    finally:
        ps.destroy_model_parallel()


def layouts_body(cases):
    return [_run_layout(**case) for case in cases]


def _check(results_per_rank, case):
    pp, vpp, m = case["pp"], case["vpp"], case["num_microbatches"]
    scale = case.get("grad_scale") or 1.0
    ref_losses, ref_grads = reference(pp * (vpp or 1), m)
    for rank_results in results_per_rank:
        res = rank_results[case["_idx"]]
        assert res["trace"] == res["expected"], f"{case}: order {res['trace']} != {res['expected']}"
        if res["last"]:
            assert len(res["losses"]) == m
            for a, b in zip(res["losses"], ref_losses):
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert res["losses"] == []
        for v, g in res["grads"].items():
            if case.get("forward_only"):
                assert g is None
            else:
                assert torch.allclose(g, scale * ref_grads[v], rtol=1e-5, atol=1e-7), f"{case}: grad of stage {v}"


CASES_4 = [
    dict(pp=4, vpp=None, num_microbatches=6),
    dict(pp=4, vpp=None, num_microbatches=2),  # fewer micro-batches than stages
    dict(pp=4, vpp=2, num_microbatches=8),
    dict(pp=4, vpp=2, num_microbatches=4),  # M == pp: all warm-up
    dict(pp=4, vpp=None, num_microbatches=4, forward_only=True),
    dict(pp=4, vpp=2, num_microbatches=4, forward_only=True),
    dict(pp=4, vpp=None, num_microbatches=5, grad_scale=2.0, deallocate=True),
    dict(pp=4, vpp=2, num_microbatches=8, deallocate=True),
]
CASES_2 = [dict(pp=2, vpp=None, num_microbatches=3), dict(pp=1, vpp=None, num_microbatches=3)]


@pytest.mark.parametrize("world,cases", [(4, CASES_4), (2, CASES_2)])
def test_schedules_against_sequential_reference(world, cases):
    cases = [dict(c) for c in cases]
    results = run_distributed(layouts_body, world, cases, timeout=90)
    for i, case in enumerate(cases):
        case["_idx"] = i  # pp=1 on a 2-rank world: both ranks run the whole chain (data parallel)
        _check(results, case)
    names = {res["name"] for rank in results for res in rank}
    expected = {"forward_backward_pipelining_without_interleaving"}
    if world == 4:
        expected.add("forward_backward_pipelining_with_interleaving")
    else:
        expected.add("forward_backward_no_pipelining")
    assert names == expected


def interleave_error_body():
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(1, 4, 2)
    config = TransformerConfig(num_layers=8, hidden_size=H, num_attention_heads=1, pipeline_model_parallel_size=4,
                               virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    chunks = [Stage(config, c * 4 + ps.get_pipeline_model_parallel_rank(), 8) for c in range(2)]
    try:
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=None, data_iterator=[iter([]), iter([])], model=chunks, num_microbatches=6,
            seq_length=S, micro_batch_size=MB)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_interleaved_requires_divisible_microbatches():
    for msg in run_distributed(interleave_error_body, 4):
        assert "number of microbatches (6) is not divisible by pipeline-model-parallel-size (4)" in msg


def test_expected_order_helper_matches_textbook_1f1b():
    """The test's own order builder, checked on the classic 4-stage, 8-micro-batch picture."""
    last = _expected_order(4, 3, 1, 8, False)
    assert last[:4] == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]
    first = _expected_order(4, 0, 1, 8, False)
    assert [k for k, _, _ in first[:3]] == ["F", "F", "F"] and first[3:5] == [("F", 0, 3), ("B", 0, 0)]
