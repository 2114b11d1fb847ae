"""megatron-core's combined 1F1B family (EP all-to-all overlap), one rank.

Reference: a tiny GPT (3 layers: MoE with shared experts and an aux loss, dense, MoE last; alltoall dispatcher;
also with one multi-token prediction depth)
run through the plain ``GPTModel.forward`` and one autograd pass, or through ``forward_backward_no_pipelining``.
The same model (a copy) run through ``GPTModel.build_schedule_plan`` and the schedule nodes (pre-process, per layer
attn / dispatch / experts / combine, post-process), through ``combined_1f1b_schedule_for_no_pipelining`` and
through ``combined_1f1b_schedule_for_interleaved_pipelining`` must give the same losses and the same gradient on
every parameter. Plus the node machinery on a plain function (chain rule, freed inputs) and the refusals; and
(marked slow: 4 gloo ranks) the interleaved pipeline schedule with ``overlap_moe_expert_parallel_comm``.
"""
import gc

import pytest
import torch

from helpers.models_helpers import causal_mask, single_rank  # noqa: F401  (fixture)

H, SEQ, BATCH, VOCAB, M = 16, 8, 2, 64, 3


def _config(**extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=3, hidden_size=H, num_attention_heads=4, ffn_hidden_size=32, num_moe_experts=4,
                  moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=[1, 0, 1],
                  moe_shared_expert_intermediate_size=16, moe_aux_loss_coeff=0.01,
                  moe_token_dispatcher_type="alltoall", add_bias_linear=False, hidden_dropout=0.0,
                  attention_dropout=0.0, use_cpu_initialization=True, position_embedding_type="rope")
    fields.update(extra)
    return TransformerConfig(**fields)


def _model(**extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = _config(**extra)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_decoder_block_spec(config), VOCAB, SEQ)
    with torch.no_grad():  # routers that spread the tokens unevenly
        for layer in model.decoder.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.weight.normal_(0, 0.5)
    return model


def _batch(m):
    g = torch.Generator().manual_seed(10 + m)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return dict(input_ids=ids, position_ids=torch.arange(SEQ).expand(BATCH, SEQ), attention_mask=causal_mask(SEQ),
                labels=torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(ref, got):
    assert set(ref) == set(got), set(ref) ^ set(got)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def model(single_rank):  # noqa: F811
    return _model()


@pytest.mark.parametrize("case", ["decoder", "mtp", "dense_last", "packed"])
def test_schedule_plan_nodes_equal_plain_forward_backward(model, case):
    """``mtp``: one multi-token prediction depth (an MoE layer) whose loss rides on the main hidden states;
    ``dense_last``: the decoder's final norm follows a dense layer's MLP node; ``packed``: two documents packed
    in each row (``PackedSeqParams``, thd) reach every attention node."""
    from megatron.core.models.common.model_chunk_schedule_plan import (
        TransformerLayerSchedulePlan, TransformerModelChunkSchedulePlan)
    from megatron.core.models.gpt.fine_grained_callables import TransformerLayerNode
    from megatron.core.pipeline_parallel.utils import NoopScheduleNode

    mtp = int(case == "mtp")
    extra = {"mtp": {"mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.5},
             "dense_last": {"moe_layer_freq": [1, 0, 0]}}.get(case, {})
    ref, got = _model(**extra), _model(**extra)
    batch = dict(_batch(0), loss_mask=(_batch(0)["labels"] % 3 != 0).float())
    if case == "packed":
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor([0, 3, SEQ], dtype=torch.int32)
        batch.update(input_ids=batch["input_ids"][:1], labels=batch["labels"][:1],
                     loss_mask=batch["loss_mask"][:1], attention_mask=None,
                     position_ids=torch.cat([torch.arange(3), torch.arange(SEQ - 3)]).unsqueeze(0),
                     packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                       max_seqlen_q=SEQ - 3, max_seqlen_kv=SEQ - 3))
    loss_ref = ref(**batch)
    (loss_ref * torch.linspace(0.5, 1.5, loss_ref.numel()).view_as(loss_ref)).sum().backward()
    if mtp:
        assert ref.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0, "the MTP loss must train the MTP depth"

    plan = got.build_schedule_plan(**batch)
    assert isinstance(plan, TransformerModelChunkSchedulePlan) and plan.num_layers() == 3 + mtp
    kinds = [(type(p.moe_dispatch), type(p.moe_combine)) for p in plan._transformer_layers]
    assert kinds[0] == (TransformerLayerNode, TransformerLayerNode)
    assert kinds[1] == (NoopScheduleNode, NoopScheduleNode)  # the dense layer
    assert isinstance(plan.get_layer(2), TransformerLayerSchedulePlan)
    assert isinstance(plan.get_layer(2).moe_combine, NoopScheduleNode if case == "dense_last" else TransformerLayerNode)
    assert isinstance(plan.get_layer(2 + mtp).mtp_post_process, TransformerLayerNode if mtp else NoopScheduleNode)
    loss = TransformerModelChunkSchedulePlan.run(plan, None)
    assert loss.shape == loss_ref.shape
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-6, atol=1e-6)
    assert loss.grad_fn is not None and not any(p.grad is not None for p in got.parameters()), \
        "the forward of a plan must not backpropagate"
    TransformerModelChunkSchedulePlan.run(None, plan, b_grad=torch.linspace(0.5, 1.5, loss.numel()).view_as(loss))
    assert plan.num_layers() == 0 and plan.pre_process is None, "the backward consumes the plan"
    _assert_same_grads(_grads(ref), _grads(got))


def _loss_func(loss_mask, output_tensor):
    total = (output_tensor.float() * loss_mask).sum()
    n = loss_mask.sum().to(torch.int64)
    return total, n, {"lm loss": torch.stack([total.detach(), n.float()])}


def _forward_step(data_iterator, model, return_schedule_plan=False):
    from functools import partial

    batch = next(data_iterator)
    loss_mask = (batch["labels"] % 5 != 0).float()  # some tokens left out
    if return_schedule_plan:
        return model.build_schedule_plan(**batch, loss_mask=loss_mask), partial(_loss_func, loss_mask)
    return model(**batch, loss_mask=loss_mask), partial(_loss_func, loss_mask)


@pytest.mark.parametrize("how", ["direct", "attn_bwd_early", "config_flag"])
def test_combined_1f1b_no_pipelining_equals_plain_schedule(model, how, monkeypatch):
    """``attn_bwd_early``: megatron-core's ``ep_overlap_early_attn_memory_release`` order (a layer's attention
    backward before the other micro-batch's expert forward; not a config field here, set on the config object);
    ``config_flag``: ``forward_backward_no_pipelining`` with ``config.overlap_moe_expert_parallel_comm``."""
    import contextlib

    from megatron.core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_no_pipelining
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    ref, got = _model(), _model()
    if how == "attn_bwd_early":
        monkeypatch.setattr(got.config, "ep_overlap_early_attn_memory_release", True, raising=False)
    store_ref = forward_backward_no_pipelining(forward_step_func=_forward_step,
                                               data_iterator=iter([_batch(m) for m in range(M)]), model=ref,
                                               num_microbatches=M, seq_length=SEQ, micro_batch_size=BATCH)
    syncs = []

    @contextlib.contextmanager
    def no_sync():
        syncs.append("enter")
        yield
        syncs.append("exit")

    if how == "config_flag":
        monkeypatch.setattr(got.config, "overlap_moe_expert_parallel_comm", True)
        monkeypatch.setattr(got.config, "no_sync_func", no_sync)
        plans = []
        build = got.build_schedule_plan
        monkeypatch.setattr(got, "build_schedule_plan", lambda *a, **k: plans.append(1) or build(*a, **k))
        store = forward_backward_no_pipelining(forward_step_func=_forward_step,
                                               data_iterator=iter([_batch(m) for m in range(M)]), model=got,
                                               num_microbatches=M, seq_length=SEQ, micro_batch_size=BATCH)
        assert len(plans) == M, "the flag must take the combined path"
        total = sum(int(s["lm loss"][1]) for s in store_ref)
    else:
        store, total = combined_1f1b_schedule_for_no_pipelining(
            _forward_step, iter([_batch(m) for m in range(M)]), got, M, None, None, [], got.config, False, None,
            False, no_sync, torch.zeros((), dtype=torch.int64), lambda cond: cond)
    assert syncs == ["enter", "exit"]
    assert [layer.current_microbatch for layer in got.decoder.layers] == [M - 1] * 3
    assert len(store) == len(store_ref) == M
    for a, b in zip(store, store_ref):
        torch.testing.assert_close(a["lm loss"], b["lm loss"], rtol=1e-6, atol=1e-6)
    assert int(total) == sum(int(s["lm loss"][1]) for s in store_ref)
    _assert_same_grads(_grads(ref), _grads(got))


def test_combined_1f1b_interleaved_step_helpers(model):
    """Three merged steps on one chunk: forward(0); forward(1) + backward(0); backward(1), through the helper
    callbacks the interleaved schedule passes."""
    from megatron.core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_interleaved_pipelining

    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    ref, got = _model(), _model()
    ref_store = forward_backward_no_pipelining(forward_step_func=_forward_step,
                                               data_iterator=iter([_batch(m) for m in range(2)]), model=ref,
                                               num_microbatches=2, seq_length=SEQ, micro_batch_size=BATCH)
    outputs, calls, store = {}, [], []
    data = [iter([_batch(0), _batch(1)])]

    def f_pre(vmb, chunk, mb):
        calls.append(("f_pre", vmb, chunk, mb))
        return None

    def f_post(chunk, output, num_tokens):
        calls.append(("f_post", chunk))
        outputs[len(outputs)] = output

    def b_pre(vmb, chunk):
        calls.append(("b_pre", vmb, chunk))
        return None, outputs[vmb], None

    for f, b in ((0, None), (1, 0), (None, 1)):
        out, grad = combined_1f1b_schedule_for_interleaved_pipelining(
            got.config, _forward_step, data, [got], 2, store, f_pre, f_post, b_pre, lambda vmb: calls.append("x"),
            lambda vmb, forward: vmb, lambda vmb, forward: 0, lambda cond: cond,
            lambda vmb: vmb == 0, False, f_virtual_microbatch_id=f, b_virtual_microbatch_id=b)
        assert grad is None  # no pipelining: the chunk's input is the embedding's, no tensor to pass back
        assert (out is None) == (f is None)
    assert [c[0] for c in calls if c != "x"] == ["f_pre", "f_post", "f_pre", "b_pre", "f_post", "b_pre"]
    assert "x" not in calls, "as megatron-core: chunk 0's backward helper postprocess is not called"
    for a, b in zip(store, ref_store):
        torch.testing.assert_close(a["lm loss"], b["lm loss"], rtol=1e-6, atol=1e-6)
    _assert_same_grads(_grads(ref), _grads(got))


def test_schedule_node_chain_rule_and_freed_inputs():
    from megatron.core.pipeline_parallel.utils import NoopScheduleNode, ScheduleNode

    w1, w2 = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)

    first = ScheduleNode(lambda a: a @ w1, None, None, name="first")
    second = ScheduleNode(lambda a: a * 2.0 + 1.0, None, None, free_input=True, name="second")
    third = ScheduleNode(lambda a: torch.tanh(a @ w2), None, None, free_input=True, name="third")
    h1 = first.forward(x)
    h2 = second.forward(h1)
    assert h1.untyped_storage().nbytes() == 0, "an input that nothing saved for backward is released"
    h3 = third.forward(h2)
    assert h2.untyped_storage().nbytes() > 0, "an input saved for the backward (a @ w2 keeps a) is kept"
    assert NoopScheduleNode().forward(h3) is h3 and NoopScheduleNode().backward(h3) is h3
    gx = first.backward(second.backward(third.backward(2 * h3.detach())))
    x2, w1b, w2b = (t.detach().clone().requires_grad_() for t in (x, w1, w2))
    ((torch.tanh((x2 @ w1b * 2.0 + 1.0) @ w2b)) ** 2).sum().backward()
    torch.testing.assert_close(gx, x2.grad)
    torch.testing.assert_close(w1.grad, w1b.grad)
    torch.testing.assert_close(w2.grad, w2b.grad)
    assert first.inputs is None and not hasattr(first, "forward_func"), "a node's state is dropped after backward"


def test_weak_method_free_input_rules_and_refusals(model):
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan
    from megatron.core.models.gpt.fine_grained_callables import (
        build_layer_callables, build_mtp_layer_callables, should_free_input, weak_method)

    class Obj:
        def f(self, a):
            return a + 1

    obj = Obj()
    call = weak_method(obj.f)
    assert call(1) == 2
    del obj
    gc.collect()
    with pytest.raises(TypeError):
        call(1)  # the object is gone: the weak reference does not keep it alive

    cfg = model.config
    assert [should_free_input(n, True, cfg) for n in ("attn", "moe_dispatch", "mlp", "moe_combine")] == \
        [False, True, True, True]
    assert not any(should_free_input(n, False, cfg) for n in ("attn", "moe_dispatch", "mlp", "moe_combine"))

    with pytest.raises(ValueError, match="Unsupported layer type"):
        build_layer_callables(torch.nn.Linear(2, 2))
    mtp2 = _model(mtp_num_layers=2)
    with pytest.raises(NotImplementedError, match="mtp_num_layers=1"):
        build_mtp_layer_callables(mtp2.mtp.layers[0])
    forward_funcs, dw = build_layer_callables(model.decoder.layers[1])
    with pytest.raises(NotImplementedError, match="dense layer"):
        forward_funcs[1](None, None, None)
    assert forward_funcs[4] is None and set(dw) == {"attn", "mlp"}

    cfg.recompute_granularity = "full"
    try:
        with pytest.raises(NotImplementedError, match="full recompute"):
            TransformerModelChunkSchedulePlan(model, **_batch(0))
    finally:
        cfg.recompute_granularity = None
    for extra, message in (({"moe_token_dispatcher_type": "allgather"}, "alltoall or flex"),
                           ({"recompute_granularity": "full", "recompute_method": "uniform",
                             "recompute_num_layers": 1}, "no full recompute"),
                           ({"mtp_num_layers": 2}, "at most one multi-token")):
        with pytest.raises(ValueError, match=message):
            _config(overlap_moe_expert_parallel_comm=True, **extra)
    assert _config(overlap_moe_expert_parallel_comm=True).overlap_moe_expert_parallel_comm


def interleaved_body():
    """PP 4 x VPP 2 (8 layers, one per chunk; MoE and dense), deallocated pipeline outputs: the interleaved schedule
    with ``overlap_moe_expert_parallel_comm`` (every step a merged step of combined_1f1b) against without."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    parallel_state.initialize_model_parallel(1, 4, virtual_pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    rank = torch.distributed.get_rank()
    calls, out = [], {}

    def step(data_iterator, model, return_schedule_plan=False):
        calls.append(return_schedule_plan)
        return _forward_step(data_iterator, model, return_schedule_plan=return_schedule_plan)

    for flag in (False, True):
        chunks = []
        for vp in range(2):
            config = _config(num_layers=8, moe_layer_freq=[1, 0, 1, 1, 1, 0, 1, 1], pipeline_model_parallel_size=4,
                             virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                             deallocate_pipeline_outputs=True, overlap_moe_expert_parallel_comm=flag)
            torch.manual_seed(100 + vp)
            parallel_state.set_virtual_pipeline_model_parallel_rank(vp)
            chunks.append(GPTModel(config, get_gpt_decoder_block_spec(config), VOCAB, SEQ, vp_stage=vp,
                                   pre_process=rank == 0 and vp == 0, post_process=rank == 3 and vp == 1))
        store = forward_backward_pipelining_with_interleaving(
            forward_step_func=step, data_iterator=[iter([_batch(m) for m in range(4)]) for _ in range(2)],
            model=chunks, num_microbatches=4, seq_length=SEQ, micro_batch_size=BATCH)
        out[flag] = ([s["lm loss"] for s in store],
                     {f"{c}.{n}": p.grad.clone() for c, m in enumerate(chunks) for n, p in m.named_parameters()
                      if p.grad is not None})
    return calls, out


@pytest.mark.slow
def test_interleaved_pipeline_with_the_flag_equals_plain_interleaved():
    from helpers.dist_harness import run_distributed

    for rank, (calls, out) in enumerate(run_distributed(interleaved_body, 4, timeout=300)):
        assert calls.count(True) == calls.count(False) == 8, "4 micro-batches x 2 chunks on each path"
        (losses_ref, grads_ref), (losses, grads) = out[False], out[True]
        assert len(losses) == len(losses_ref) == (4 if rank == 3 else 0)
        for a, b in zip(losses, losses_ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        _assert_same_grads(grads_ref, grads)
