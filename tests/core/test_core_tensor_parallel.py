"""Tensor-parallel layers and cross entropy against an unsharded float64 PyTorch computation.

Every rank builds the same full weights and inputs from a fixed generator, loads its own shard into the
layer (Megatron's documented layout: column weight rows, row weight columns, vocab rows), and compares the
layer's output and the gradients of input, weight and bias with the matching slice of the unsharded
result. Relative error = ||ours - ref|| / ||ref||.
"""
import pytest
import torch
import torch.nn.functional as F

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed

S, B, IN, OUT, VOCAB, HID = 8, 3, 8, 12, 16, 6
TOL = 1e-5


def _full_tensors():
    g = torch.Generator().manual_seed(1234)
    return {
        "W": torch.randn(OUT, IN, generator=g, dtype=torch.float64),
        "b": torch.randn(OUT, generator=g, dtype=torch.float64),
        "X": torch.randn(S, B, IN, generator=g, dtype=torch.float64),
        "G": torch.randn(S, B, OUT, generator=g, dtype=torch.float64),
        "E": torch.randn(VOCAB, HID, generator=g, dtype=torch.float64),
        "ids": torch.randint(0, VOCAB, (B, S), generator=g),
        "GE": torch.randn(B, S, HID, generator=g, dtype=torch.float64),
        "logits": torch.randn(S, B, VOCAB, generator=g, dtype=torch.float64) * 3,
        "target": torch.randint(0, VOCAB, (S, B), generator=g),
    }


def _chunk(t, dim, tp, r):
    return t.chunk(tp, dim=dim)[r]


def _reference_linear(T):
    X = T["X"].clone().requires_grad_(True)
    W = T["W"].clone().requires_grad_(True)
    b = T["b"].clone().requires_grad_(True)
    Y = F.linear(X, W, b)
    (Y * T["G"]).sum().backward()
    return Y.detach(), X.grad, W.grad, b.grad


def _megatron_label_smoothing_loss(logits, target, eps):
    """Megatron's definition from the math: eps spread over the V-1 non-target classes."""
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    v = logits.size(-1)
    others = -(logp.sum(-1)) - nll
    return (1 - eps) * nll + eps / (v - 1) * others


def tp_parity_body(tp, sequence_parallel):
    from megatron.core import ModelParallelConfig, parallel_state as ps, tensor_parallel as tpl

    ps.initialize_model_parallel(tp)
    tpl.model_parallel_cuda_manual_seed(123)
    r = ps.get_tensor_model_parallel_rank()
    T = _full_tensors()
    Y_ref, dX_ref, dW_ref, db_ref = _reference_linear(T)
    errs = {}
    sp = sequence_parallel and tp > 1
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
    init = torch.nn.init.zeros_

    # --- ColumnParallelLinear: weight rows [r*OUT/tp, (r+1)*OUT/tp) -------------------------------------
    for gather in ([False] if sp else [False, True]):
        layer = tpl.ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, gather_output=gather)
        with torch.no_grad():
            layer.weight.copy_(_chunk(T["W"], 0, tp, r))
            layer.bias.copy_(_chunk(T["b"], 0, tp, r))
        X = (_chunk(T["X"], 0, tp, r) if sp else T["X"]).float().clone().requires_grad_(True)
        Y, bias_out = layer(X)
        assert bias_out is None
        G = T["G"] if gather else _chunk(T["G"], 2, tp, r)
        (Y * G.float()).sum().backward()
        name = f"column(gather={gather},sp={sp})"
        errs[name + ".out"] = rel_err(Y, Y_ref if gather else _chunk(Y_ref, 2, tp, r))
        errs[name + ".dX"] = rel_err(X.grad, _chunk(dX_ref, 0, tp, r) if sp else dX_ref)
        errs[name + ".dW"] = rel_err(layer.weight.grad, _chunk(dW_ref, 0, tp, r))
        errs[name + ".db"] = rel_err(layer.bias.grad, _chunk(db_ref, 0, tp, r))

    # --- RowParallelLinear: weight columns [r*IN/tp, (r+1)*IN/tp) --------------------------------------
    for input_is_parallel in ([True] if sp else [True, False]):
        layer = tpl.RowParallelLinear(IN, OUT, config=cfg, init_method=init, input_is_parallel=input_is_parallel)
        with torch.no_grad():
            layer.weight.copy_(_chunk(T["W"], 1, tp, r))
            layer.bias.copy_(T["b"])
        X = (_chunk(T["X"], 2, tp, r) if input_is_parallel else T["X"]).float().clone().requires_grad_(True)
        Y, bias_out = layer(X)
        assert bias_out is None
        G = _chunk(T["G"], 0, tp, r) if sp else T["G"]
        (Y * G.float()).sum().backward()
        name = f"row(input_is_parallel={input_is_parallel},sp={sp})"
        errs[name + ".out"] = rel_err(Y, _chunk(Y_ref, 0, tp, r) if sp else Y_ref)
        errs[name + ".dX"] = rel_err(X.grad, _chunk(dX_ref, 2, tp, r) if input_is_parallel else dX_ref)
        errs[name + ".dW"] = rel_err(layer.weight.grad, _chunk(dW_ref, 1, tp, r))
        db = layer.bias.grad.clone()
        if sp:  # each rank saw part of the sequence: the optimizer all-reduces SP-param grads over TP
            assert layer.bias.sequence_parallel
            torch.distributed.all_reduce(db, group=ps.get_tensor_model_parallel_group())
        errs[name + ".db"] = rel_err(db, db_ref)

    # --- skip_bias_add returns the bias instead of adding it -----------------------------------------
    layer = tpl.ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, skip_bias_add=True)
    with torch.no_grad():
        layer.bias.copy_(_chunk(T["b"], 0, tp, r))
    X = _chunk(T["X"], 0, tp, r).float() if sp else T["X"].float()
    out, bias_out = layer(X)
    assert bias_out is layer.bias
    errs["column.skip_bias_add"] = 0.0 if torch.all(out == 0) else 1.0

    # --- VocabParallelEmbedding: rows [r*V/tp, (r+1)*V/tp) --------------------------------------------
    emb = tpl.VocabParallelEmbedding(VOCAB, HID, init_method=init, config=cfg)
    with torch.no_grad():
        emb.weight.copy_(_chunk(T["E"], 0, tp, r))
    out = emb(T["ids"])
    (out * T["GE"].float()).sum().backward()
    E = T["E"].clone().requires_grad_(True)
    ref = F.embedding(T["ids"], E)
    (ref * T["GE"]).sum().backward()
    errs["embedding.out"] = rel_err(out, ref)
    errs["embedding.dW"] = rel_err(emb.weight.grad, _chunk(E.grad, 0, tp, r))

    # With gradient_accumulation_fusion the looked-up rows are added straight into main_grad (as DDP gives it):
    # main_grad = what it held + the reference gradient slice, and no .grad is made.
    fused_cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp,
                                    gradient_accumulation_fusion=True)
    emb = tpl.VocabParallelEmbedding(VOCAB, HID, init_method=init, config=fused_cfg)
    with torch.no_grad():
        emb.weight.copy_(_chunk(T["E"], 0, tp, r))
    held = torch.full_like(emb.weight, 0.25)
    emb.weight.main_grad = held.clone()
    (emb(T["ids"]) * T["GE"].float()).sum().backward()
    errs["embedding(main_grad).dW"] = rel_err(emb.weight.main_grad - held, _chunk(E.grad, 0, tp, r))
    errs["embedding(main_grad).no_grad"] = 0.0 if emb.weight.grad is None else 1.0

    # --- vocab_parallel_cross_entropy ------------------------------------------------------------------
    # inplace=True (the model heads' call) works in the logits buffer: same loss and gradient, and the
    # buffer it was given is overwritten (so the models must own it).
    for eps, inplace in ((0.0, False), (0.1, False), (0.0, True), (0.1, True)):
        local = _chunk(T["logits"], 2, tp, r).float().clone().requires_grad_(True)
        logits_in = local * 1.0  # a non-leaf the loss may overwrite
        loss = tpl.vocab_parallel_cross_entropy(logits_in, T["target"], label_smoothing=eps, inplace=inplace)
        assert torch.equal(logits_in, local) != inplace
        gl = torch.linspace(0.5, 1.5, S * B, dtype=torch.float64).view(S, B)
        (loss * gl.float()).sum().backward()
        full = T["logits"].clone().requires_grad_(True)
        if eps == 0.0:
            ref = F.cross_entropy(full.view(-1, VOCAB), T["target"].view(-1), reduction="none").view(S, B)
        else:
            ref = _megatron_label_smoothing_loss(full, T["target"], eps)
        (ref * gl).sum().backward()
        tag = f"cross_entropy(ls={eps}{', inplace' if inplace else ''})"
        errs[f"{tag}.loss"] = rel_err(loss, ref)
        errs[f"{tag}.dlogits"] = rel_err(local.grad, _chunk(full.grad, 2, tp, r))
    return errs


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_tensor_parallel_parity_with_unsharded(tp, sp):
    results = run_distributed(tp_parity_body, tp, tp, sp)
    worst = {}
    for errs in results:
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"
    # Every quantity was actually checked.
    assert len(worst) == (21 if sp else 29)


def test_label_smoothing_definition_tp1_matches_pytorch_form():
    """At TP=1 Megatron's smoothing equals the textbook form with the mass on the V-1 other classes."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.float64, generator=g)
    target = torch.randint(0, 7, (5,), generator=g)
    eps, v = 0.2, 7
    smoothed_target = torch.full((5, 7), eps / (v - 1), dtype=torch.float64)
    smoothed_target[torch.arange(5), target] = 1 - eps
    ref = -(smoothed_target * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(_megatron_label_smoothing_loss(logits, target, eps), ref)


def cpu_init_body(tp):
    """use_cpu_initialization gives shards of the same full weight for any TP size (stride 1 and 2)."""
    from megatron.core import ModelParallelConfig, parallel_state as ps, tensor_parallel as tpl

    ps.initialize_model_parallel(tp)
    tpl.model_parallel_cuda_manual_seed(5)
    r = ps.get_tensor_model_parallel_rank()
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)

    def full(out_size, in_size, seed):
        torch.manual_seed(seed)
        w = torch.empty(out_size, in_size)
        torch.nn.init.normal_(w, std=0.02)
        return w

    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    checks = {}
    torch.manual_seed(11)
    col = tpl.ColumnParallelLinear(IN, OUT, config=cfg, init_method=init)
    checks["column"] = torch.equal(col.weight, _chunk(full(OUT, IN, 11), 0, tp, r))
    torch.manual_seed(12)
    row = tpl.RowParallelLinear(IN, OUT, config=cfg, init_method=init)
    checks["row"] = torch.equal(row.weight, _chunk(full(OUT, IN, 12), 1, tp, r))
    torch.manual_seed(13)
    emb = tpl.VocabParallelEmbedding(VOCAB, HID, config=cfg, init_method=init)
    checks["embedding"] = torch.equal(emb.weight, _chunk(full(VOCAB, HID, 13), 0, tp, r))
    # stride 2: the output dim is cut into tp*2 chunks, rank r keeps chunks r and r+tp.
    torch.manual_seed(14)
    col2 = tpl.ColumnParallelLinear(IN, 16, config=cfg, init_method=init, stride=2)
    chunks = full(16, IN, 14).chunk(tp * 2, dim=0)
    checks["column_stride2"] = torch.equal(col2.weight, torch.cat([chunks[r], chunks[r + tp]], dim=0))
    checks["attrs"] = (col.weight.tensor_model_parallel and col.weight.partition_dim == 0
                       and row.weight.partition_dim == 1 and col2.weight.partition_stride == 2
                       and not hasattr(row.bias, "tensor_model_parallel") and col.bias.partition_dim == 0)
    return checks


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cpu_initialization_same_full_weight(tp):
    for checks in run_distributed(cpu_init_body, tp, tp):
        assert all(checks.values()), checks


def mappings_body():
    """The mappings on TP=4 against their definitions (forward value and backward gradient)."""
    from megatron.core import parallel_state as ps, tensor_parallel as tpl

    ps.initialize_model_parallel(4)
    r = ps.get_tensor_model_parallel_rank()
    ar8 = torch.arange(8.0)
    out = {}

    def run(fn, x, grad):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(grad)
        return y.detach(), x.grad

    y, g = run(tpl.copy_to_tensor_model_parallel_region, torch.full((2,), r + 1.0), torch.full((2,), r + 1.0))
    out["copy"] = torch.equal(y, torch.full((2,), r + 1.0)) and torch.equal(g, torch.full((2,), 10.0))
    y, g = run(tpl.reduce_from_tensor_model_parallel_region, torch.full((2,), r + 1.0), torch.full((2,), r + 7.0))
    out["reduce"] = torch.equal(y, torch.full((2,), 10.0)) and torch.equal(g, torch.full((2,), r + 7.0))
    y, g = run(tpl.scatter_to_tensor_model_parallel_region, ar8.view(1, 8), torch.full((1, 2), r + 1.0))
    out["scatter"] = (torch.equal(y, ar8[2 * r:2 * r + 2].view(1, 2))
                      and torch.equal(g, torch.tensor([[1.0, 1, 2, 2, 3, 3, 4, 4]])))
    y, g = run(tpl.gather_from_tensor_model_parallel_region, torch.full((1, 2), float(r)), ar8.view(1, 8))
    out["gather"] = (torch.equal(y, torch.tensor([[0.0, 0, 1, 1, 2, 2, 3, 3]]))
                     and torch.equal(g, ar8[2 * r:2 * r + 2].view(1, 2)))
    y, g = run(tpl.scatter_to_sequence_parallel_region, ar8.view(8, 1), torch.full((2, 1), r + 1.0))
    out["scatter_seq"] = (torch.equal(y, ar8[2 * r:2 * r + 2].view(2, 1))
                          and torch.equal(g, torch.tensor([1.0, 1, 2, 2, 3, 3, 4, 4]).view(8, 1)))
    y, g = run(tpl.gather_from_sequence_parallel_region, torch.full((2, 1), float(r)), (r + 1.0) * ar8.view(8, 1))
    out["gather_seq"] = (torch.equal(y, torch.tensor([0.0, 0, 1, 1, 2, 2, 3, 3]).view(8, 1))
                         and torch.equal(g, 10.0 * ar8[2 * r:2 * r + 2].view(2, 1)))
    y, g = run(lambda x: tpl.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False),
               torch.full((2, 1), float(r)), (r + 1.0) * ar8.view(8, 1))
    out["gather_seq_no_tp_grad"] = torch.equal(g, (r + 1.0) * ar8[2 * r:2 * r + 2].view(2, 1))
    y, g = run(tpl.reduce_scatter_to_sequence_parallel_region, (r + 1.0) * ar8.view(8, 1), torch.full((2, 1), float(r)))
    out["reduce_scatter_seq"] = (torch.equal(y, 10.0 * ar8[2 * r:2 * r + 2].view(2, 1))
                                 and torch.equal(g, torch.tensor([0.0, 0, 1, 1, 2, 2, 3, 3]).view(8, 1)))

    # megatron-core's last-dimension gather / reduce-scatter and the sequence <-> hidden all-to-alls
    y, g = run(tpl.all_gather_last_dim_from_tensor_parallel_region, torch.full((1, 2), float(r)),
               (r + 1.0) * ar8.view(1, 8))
    out["gather_last"] = (torch.equal(y, torch.tensor([[0.0, 0, 1, 1, 2, 2, 3, 3]]))
                          and torch.equal(g, 10.0 * ar8[2 * r:2 * r + 2].view(1, 2)))
    y, g = run(tpl.reduce_scatter_last_dim_to_tensor_parallel_region, (r + 1.0) * ar8.view(1, 8),
               torch.full((1, 2), float(r)))
    out["reduce_scatter_last"] = (torch.equal(y, 10.0 * ar8[2 * r:2 * r + 2].view(1, 2))
                                  and torch.equal(g, torch.tensor([[0.0, 0, 1, 1, 2, 2, 3, 3]])))
    tokens = torch.arange(64.0).view(8, 8)  # [tokens, hidden]; rank r holds tokens 2r:2r+2 / hidden block r
    y, g = run(tpl.all_to_all_sp2hp, tokens[2 * r:2 * r + 2], tokens[:, 2 * r:2 * r + 2])
    out["sp2hp"] = torch.equal(y, tokens[:, 2 * r:2 * r + 2]) and torch.equal(g, tokens[2 * r:2 * r + 2])
    y, g = run(tpl.all_to_all_hp2sp, tokens[:, 2 * r:2 * r + 2], tokens[2 * r:2 * r + 2])
    out["hp2sp"] = torch.equal(y, tokens[2 * r:2 * r + 2]) and torch.equal(g, tokens[:, 2 * r:2 * r + 2])

    # Splitting a sequence that does not divide by TP is a clear error.
    try:
        tpl.scatter_to_sequence_parallel_region(torch.zeros(6, 1))
        out["seq_error"] = False
    except RuntimeError as e:
        out["seq_error"] = "divisible by tensor parallel size" in str(e)

    # broadcast_data: only TP rank 0 has the batch.
    data = {"text": torch.arange(10).view(2, 5), "types": torch.tensor([7, 8, 9])} if r == 0 else None
    got = tpl.broadcast_data(["text", "types"], data, torch.int64)
    out["broadcast"] = (torch.equal(got["text"], torch.arange(10).view(2, 5))
                        and torch.equal(got["types"], torch.tensor([7, 8, 9])))
    return out


def test_mappings_and_broadcast_tp4():
    for out in run_distributed(mappings_body, 4):
        assert all(out.values()), out


def rng_tp2_body():
    """Dropout inside the tracker differs across TP ranks; outside it is identical. Recompute is exact."""
    from megatron.core import parallel_state as ps, tensor_parallel as tpl

    ps.initialize_model_parallel(2)
    tpl.model_parallel_cuda_manual_seed(42)
    r = ps.get_tensor_model_parallel_rank()
    group = ps.get_tensor_model_parallel_group()
    with tpl.get_cuda_rng_tracker().fork():
        inside = torch.rand(64)
    outside = torch.rand(64)
    gathered_in = [torch.empty(64) for _ in range(2)]
    gathered_out = [torch.empty(64) for _ in range(2)]
    torch.distributed.all_gather(gathered_in, inside, group=group)
    torch.distributed.all_gather(gathered_out, outside, group=group)
    out = {
        "inside_differs": not torch.equal(gathered_in[0], gathered_in[1]),
        "outside_same": torch.equal(gathered_out[0], gathered_out[1]),
        "inside_seed": torch.equal(inside, torch.rand(64, generator=torch.Generator().manual_seed(42 + 2718 + r))),
    }

    # checkpoint with distribute_saved_activations stores a 1/TP slice of the first input.
    w = torch.randn(6, 6, generator=torch.Generator().manual_seed(3), requires_grad=True)

    def fn(x):
        with tpl.get_cuda_rng_tracker().fork():
            x = F.dropout(x @ w, p=0.5)
        return F.dropout(torch.tanh(x), p=0.3)

    x0 = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    states = (torch.get_rng_state(), tpl.get_cuda_rng_tracker().get_states())
    x = x0.clone().requires_grad_(True)
    fn(x).sum().backward()
    ref_dx, ref_dw = x.grad.clone(), w.grad.clone()
    w.grad = None
    torch.set_rng_state(states[0])
    tpl.get_cuda_rng_tracker().set_states(states[1])
    x = x0.clone().requires_grad_(True)
    h = x * 1.0  # a non-leaf whose storage can be replaced by the 1-D slice
    y = tpl.checkpoint(fn, True, h)
    out["distributed_slice"] = h.numel() == x0.numel() // 2
    y.sum().backward()
    out["checkpoint_dx"] = torch.allclose(x.grad, ref_dx) and torch.allclose(w.grad, ref_dw)
    return out


def test_rng_tracker_and_distributed_checkpoint_tp2():
    for out in run_distributed(rng_tp2_body, 2):
        assert all(out.values()), out


def kept_output_buffer_body():
    """ColumnParallelLinear(reuse_cpu_output_buffer=True): every output matches F.linear in float64, the storage is
    reused once nothing references the previous output, and never while a caller or autograd still holds it."""
    from megatron.core import ModelParallelConfig, parallel_state as ps, tensor_parallel as tpl

    ps.initialize_model_parallel(1)
    tpl.model_parallel_cuda_manual_seed(3)
    T = _full_tensors()
    cfg = ModelParallelConfig(params_dtype=torch.float64)
    results = {}
    for bias in (False, True):
        col = tpl.ColumnParallelLinear(IN, OUT, config=cfg, init_method=torch.nn.init.zeros_, bias=bias,
                                       reuse_cpu_output_buffer=True)
        col.output_buffer.min_bytes = 0  # the tiny test output is far below the 32 MiB threshold
        with torch.no_grad():
            col.weight.copy_(T["W"])
            if bias:
                col.bias.copy_(T["b"])
        ref = F.linear(T["X"], T["W"], T["b"] if bias else None)

        def step(scale):
            """Forward, a loss that works in the output in place (as the vocab cross entropy does), backward."""
            col.zero_grad(set_to_none=True)
            X = T["X"].clone().requires_grad_(True)
            Y, _ = col(X)
            ptr = Y.untyped_storage().data_ptr()
            value = Y.detach().clone()
            Y.mul_(scale)
            (Y * T["G"]).sum().backward()
            return ptr, value, X.grad, col.weight.grad

        ptr1, y1, gx1, gw1 = step(2.0)
        ptr2, y2, gx2, gw2 = step(3.0)
        results[f"bias{bias}_values"] = max(rel_err(y1, ref), rel_err(y2, ref))
        results[f"bias{bias}_grads"] = max(rel_err(gx1, 2 * T["G"] @ T["W"]), rel_err(gx2, 3 * T["G"] @ T["W"]),
                                           rel_err(gw2, 3 * T["G"].reshape(-1, OUT).t() @ T["X"].reshape(-1, IN)))
        results[f"bias{bias}_reused"] = float(ptr1 != ptr2)  # 0.0: the second step wrote into the kept storage

        # A caller holding an output: the next call must allocate, and the held values stay intact.
        held, _ = col(T["X"])
        other, _ = col(T["X"])
        results[f"bias{bias}_held_distinct"] = float(held.untyped_storage().data_ptr()
                                                     == other.untyped_storage().data_ptr())
        other.zero_()
        results[f"bias{bias}_held_values"] = rel_err(held.detach(), ref)
        del held, other

        # Only autograd holding it (saved by the product for backward): still in use, not overwritten.
        X = T["X"].clone().requires_grad_(True)
        Y, _ = col(X)
        loss = (Y * Y).sum()
        del Y
        overwrite, _ = col(T["X"] * 0)
        loss.backward()
        results[f"bias{bias}_saved_by_autograd"] = rel_err(X.grad, (2 * ref) @ T["W"])
        del overwrite

    # Gradient accumulation fusion under saved-tensor hooks (activation offloading, torch.autograd.graph.save_on_cpu,
    # memory measurement): the weight unpacked in backward is a new tensor object, so main_grad is found through
    # the parameter kept on the autograd context.
    cfg = ModelParallelConfig(params_dtype=torch.float64, gradient_accumulation_fusion=True)
    col = tpl.ColumnParallelLinear(IN, OUT, config=cfg, init_method=torch.nn.init.zeros_, bias=False)
    with torch.no_grad():
        col.weight.copy_(T["W"])
    col.weight.main_grad = torch.zeros_like(col.weight)
    with torch.autograd.graph.save_on_cpu():
        Y, _ = col(T["X"].clone().requires_grad_(True))
    (Y * T["G"]).sum().backward()
    results["saved_tensor_hooks_main_grad"] = rel_err(col.weight.main_grad, T["G"].reshape(-1, OUT).t()
                                                      @ T["X"].reshape(-1, IN))
    return results


def test_column_parallel_kept_cpu_output_buffer():
    (results,) = run_distributed(kept_output_buffer_body, 1)
    assert len(results) == 13, results
    bad = {k: v for k, v in results.items() if not v <= TOL}
    assert not bad, bad
