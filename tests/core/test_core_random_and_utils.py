"""Single-process tests: RNG tracker fork semantics, activation recompute, core utils and config validation.

The TP rank needed by model_parallel_cuda_manual_seed comes from parallel_state's override setters, so no
process group is needed here.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tpl
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import GlobalMemoryBuffer, divide, make_viewless_tensor


@pytest.fixture
def tp_rank_1():
    ps.set_tensor_model_parallel_world_size(2)
    ps.set_tensor_model_parallel_rank(1)
    yield
    ps.destroy_model_parallel()


def test_tracker_add_errors():
    tracker = tpl.CudaRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(Exception, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(Exception, match="cuda rng state a already exists"):
        tracker.add("a", 2)
    with pytest.raises(Exception, match="is not added"):
        with tracker.fork("missing"):
            pass


def test_fork_semantics():
    """Forked draws continue the named stream; the default stream is untouched by forks."""
    tracker = tpl.CudaRNGStatesTracker()
    torch.manual_seed(100)
    tracker.add("s", 7)
    with tracker.fork("s"):
        a = torch.rand(5)
    b = torch.rand(5)
    with tracker.fork("s"):
        c = torch.rand(5)
    named = torch.Generator().manual_seed(7)
    assert torch.equal(a, torch.rand(5, generator=named))
    assert torch.equal(c, torch.rand(5, generator=named))  # continues where the first fork stopped
    assert torch.equal(b, torch.rand(5, generator=torch.Generator().manual_seed(100)))
    # get_states / set_states rewind the tracked stream.
    states = tracker.get_states()
    with tracker.fork("s"):
        d = torch.rand(5)
    tracker.set_states(states)
    with tracker.fork("s"):
        assert torch.equal(torch.rand(5), d)


def test_model_parallel_seed(tp_rank_1):
    tpl.model_parallel_cuda_manual_seed(1234)
    default_draw = torch.rand(4)
    with tpl.get_cuda_rng_tracker().fork():
        tp_draw = torch.rand(4)
    assert torch.equal(default_draw, torch.rand(4, generator=torch.Generator().manual_seed(1234)))
    assert torch.equal(tp_draw, torch.rand(4, generator=torch.Generator().manual_seed(1234 + 2718 + 1)))
    # megatron-core's three tracked states: data parallel (the seed), tensor parallel, expert parallel
    assert set(tpl.get_cuda_rng_tracker().get_states()) == {"model-parallel-rng", "data-parallel-rng",
                                                            "expert-parallel-rng"}
    tpl.model_parallel_cuda_manual_seed(99, ep_rank=2, etp_rank=1)
    with tpl.get_cuda_rng_tracker().fork(tpl.get_expert_parallel_rng_tracker_name()):
        expert_draw = torch.rand(4)
    assert torch.equal(expert_draw, torch.rand(4, generator=torch.Generator().manual_seed(99 + 1024 + 201)))


def _block(x, w1, w2):
    h = F.dropout(torch.relu(x @ w1), p=0.4)  # default stream
    with tpl.get_cuda_rng_tracker().fork():
        h = F.dropout(h, p=0.3)  # tracked stream
    return torch.tanh(h @ w2), h.sum()


def test_checkpoint_matches_plain_gradients_with_dropout(tp_rank_1):
    tpl.model_parallel_cuda_manual_seed(9)
    g = torch.Generator().manual_seed(0)
    x0, w1_0, w2_0 = torch.randn(6, 8, generator=g), torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    cpu_state, tracker_states = torch.get_rng_state(), tpl.get_cuda_rng_tracker().get_states()

    def grads(recompute):
        torch.set_rng_state(cpu_state)
        tpl.get_cuda_rng_tracker().set_states(dict(tracker_states))
        x, w1, w2 = (t.clone().requires_grad_(True) for t in (x0, w1_0, w2_0))
        if recompute:
            out, extra = tpl.checkpoint(_block, False, x, w1, w2)
        else:
            out, extra = _block(x, w1, w2)
        (out.sum() + 0.5 * extra).backward()
        return out.detach(), x.grad, w1.grad, w2.grad, torch.get_rng_state()

    plain, recomputed = grads(False), grads(True)
    for a, b in zip(plain[:4], recomputed[:4]):
        assert torch.equal(a, b)
    # Recompute restores the RNG afterwards: later draws are the same as without recompute.
    assert torch.equal(plain[4], recomputed[4])
    # And dropout really was active (otherwise the test proves nothing).
    torch.set_rng_state(cpu_state)
    tpl.get_cuda_rng_tracker().set_states(dict(tracker_states))
    no_drop = torch.tanh(torch.relu(x0 @ w1_0) @ w2_0)
    assert not torch.allclose(plain[0], no_drop)


def test_checkpoint_without_output_frees_and_recomputes(tp_rank_1):
    """megatron-core's CheckpointWithoutOutput: the output's storage is freed after use and recomputed (same RNG,
    same tensor object) when the hook tensor's gradient arrives; gradients equal a plain run's."""
    tpl.model_parallel_cuda_manual_seed(5)
    g = torch.Generator().manual_seed(1)
    x0, w0 = torch.randn(6, 8, generator=g), torch.randn(8, 4, generator=g)
    cpu_state, tracker_states = torch.get_rng_state(), tpl.get_cuda_rng_tracker().get_states()

    def act(t):
        with tpl.get_cuda_rng_tracker().fork():
            return F.dropout(F.gelu(t), p=0.5)

    def run(recompute):
        torch.set_rng_state(cpu_state)
        tpl.get_cuda_rng_tracker().set_states(dict(tracker_states))
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if recompute:
            ckpt = tpl.CheckpointWithoutOutput()
            h = ckpt.checkpoint(act, x)
            y = h @ w
            ckpt.discard_output_and_register_recompute(y)
            assert h.untyped_storage().size() == 0  # freed
        else:
            h = act(x)
            y = h @ w
        y.sum().backward()
        return h.detach().clone(), x.grad, w.grad

    plain, recomputed = run(False), run(True)
    for a, b in zip(plain, recomputed):
        assert torch.equal(a, b)
    assert (plain[0] == 0).any()  # dropout was active


def test_checkpoint_non_tensor_args(tp_rank_1):
    tpl.model_parallel_cuda_manual_seed(3)
    x = torch.randn(3, 3, requires_grad=True)
    y = tpl.checkpoint(lambda t, scale, flag: t * scale if flag else t, False, x, 3.0, True)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3, 3), 3.0))


def test_split_helpers_and_vocab_utility():
    t = torch.arange(24.0).view(2, 12)
    parts = tpl.split_tensor_along_last_dim(t, 3)
    assert [p.shape for p in parts] == [torch.Size([2, 4])] * 3 and torch.equal(parts[1], t[:, 4:8])
    assert all(p.is_contiguous() for p in tpl.split_tensor_along_last_dim(t, 3, contiguous_split_chunks=True))
    assert tpl.VocabUtility.vocab_range_from_global_vocab_size(1024, 2, 4) == (512, 768)
    assert tpl.VocabUtility.vocab_range_from_per_partition_vocab_size(100, 3, 4) == (300, 400)
    with pytest.raises(AssertionError):
        tpl.VocabUtility.vocab_range_from_global_vocab_size(1000, 0, 3)


def test_divide_buffer_viewless():
    assert divide(12, 4) == 3
    with pytest.raises(AssertionError, match="not divisible"):
        divide(10, 4)
    buf = GlobalMemoryBuffer()
    a = buf.get_tensor((2, 3), torch.float32, "x")
    b = buf.get_tensor((3, 2), torch.float32, "x")
    assert a.data_ptr() == b.data_ptr() and b.shape == (3, 2)
    c = buf.get_tensor((10,), torch.float32, "x")  # grows
    assert c.numel() == 10
    assert buf.get_tensor((2,), torch.float16, "x").dtype == torch.float16
    base = torch.randn(4, 4, requires_grad=True)
    view = base[1:3]
    out = make_viewless_tensor(view, requires_grad=True, keep_graph=True)
    assert out._base is None and torch.equal(out, view)
    out.sum().backward()
    assert torch.equal(base.grad[1:3], torch.ones(2, 4)) and base.grad[0].abs().sum() == 0


def test_model_parallel_config_validation():
    with pytest.raises(ValueError, match="sequence parallelism without tensor parallelism"):
        ModelParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match="pipeline_dtype must be specified"):
        ModelParallelConfig(pipeline_model_parallel_size=2)
    cfg = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                              async_tensor_model_parallel_allreduce=True, params_dtype=torch.bfloat16)
    assert cfg.async_tensor_model_parallel_allreduce is False and cfg.autocast_dtype == torch.bfloat16


def test_transformer_config_derived_values_and_errors():
    cfg = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=8, init_method_std=0.02)
    assert cfg.ffn_hidden_size == 256 and cfg.kv_channels == 8 and cfg.num_query_groups == 8
    assert cfg.attention_softmax_in_fp32
    w = torch.empty(2000, 200)
    cfg.output_layer_init_method(w)
    assert abs(w.std().item() - 0.02 / 4.0) < 2e-4  # std / sqrt(2 * num_layers)
    bad = [
        (dict(fp16=True, bf16=True), "Only one of"),
        (dict(num_attention_heads=6, tensor_model_parallel_size=4), "num_attention_heads \\(6\\) must be a multiple"),
        (dict(num_query_groups=2, tensor_model_parallel_size=4, num_attention_heads=8), "num_query_groups \\(2\\)"),
        (dict(recompute_granularity="partial"), "must be \"full\" or \"selective\""),
        (dict(recompute_granularity="full"), "recompute_method must be"),
        (dict(recompute_granularity="full", recompute_method="uniform"), "recompute_num_layers must be"),
        (dict(recompute_granularity="full", recompute_method="sideways", recompute_num_layers=1), "recompute_method"),
        (dict(virtual_pipeline_model_parallel_size=3, pipeline_model_parallel_size=2, pipeline_dtype=torch.float),
         "must be divisible by virtual"),
        (dict(bias_gelu_fusion=True, add_bias_linear=False), "add_bias_linear"),
        (dict(bias_gelu_fusion=True, activation_func=F.silu), "activation_func must be F.gelu"),
        (dict(normalization="BatchNorm"), "normalization"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True, recompute_granularity="full",
              recompute_method="block", recompute_num_layers=1, distribute_saved_activations=True),
         "distribute_saved_activations"),
    ]
    for kwargs, msg in bad:
        base = dict(num_layers=8, hidden_size=64, num_attention_heads=8)
        base.update(kwargs)
        with pytest.raises(ValueError, match=msg):
            TransformerConfig(**base)


def test_import_does_not_touch_cuda():
    import subprocess
    import sys

    code = ("import torch, megatron.core, megatron.core.tensor_parallel, megatron.core.parallel_state, "
            "megatron.core.transformer; assert not torch.cuda.is_initialized(); print('clean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "clean" in out.stdout


def test_transformer_layer_offset():
    """megatron-core's get_transformer_layer_offset for even splits (8 layers, PP 2, VPP 2: stage 0 holds layers
    [0, 1] and [4, 5], stage 1 [2, 3] and [6, 7])."""
    import types

    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = types.SimpleNamespace(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert [get_transformer_layer_offset(cfg, vp, pp) for pp in (0, 1) for vp in (0, 1)] == [0, 4, 2, 6]
    cfg.virtual_pipeline_model_parallel_size = None
    assert [get_transformer_layer_offset(cfg, None, pp) for pp in (0, 1)] == [0, 4]
    cfg.pipeline_model_parallel_size = 1
    assert get_transformer_layer_offset(cfg, None, 0) == 0


def test_num_microbatches_calculator_core_api():
    """megatron-core's process-wide calculator: init / ramp-up updates / reconfigure / decrease_batch_size_if_needed."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core.errors import ConfigurationError

    nmc.unset_num_microbatches_calculator()
    try:
        nmc.init_num_microbatches_calculator(0, [4, 4, 90], 16, 2, 1)
        assert (nmc.get_num_microbatches(), nmc.get_current_global_batch_size(), nmc.get_micro_batch_size()) == (2, 4, 2)
        nmc.update_num_microbatches(60)
        assert (nmc.get_num_microbatches(), nmc.get_current_running_global_batch_size()) == (6, 12)
        with pytest.raises(RuntimeError, match="already initialized"):
            nmc.init_num_microbatches_calculator(0, None, 16, 2, 1)
        with pytest.raises(ConfigurationError, match=r"global batch size \(10\) is not divisible"):
            nmc.reconfigure_num_microbatches_calculator(0, None, 10, 4, 1)
        nmc.reconfigure_num_microbatches_calculator(0, None, 10, 4, 1, decrease_batch_size_if_needed=True)
        assert (nmc.get_current_global_batch_size(), nmc.get_current_running_global_batch_size(),
                nmc.get_num_microbatches()) == (10, 8, 2)
    finally:
        nmc.destroy_num_microbatches_calculator()
