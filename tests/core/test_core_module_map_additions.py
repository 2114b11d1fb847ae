"""Behaviour of the megatron-core names added for the public module map (test_core_module_map.py counts them):
each checked against an independent computation (plain PyTorch, hand-worked rank tables, the rule written out)."""
import types

import pytest
import torch

from helpers.models_helpers import single_rank  # noqa: F401  (fixture)

from megatron.core import parallel_state
from megatron.core.rank_grid import RankGenerator


def test_masked_orthogonal_groups_and_embedding_ranks():
    gen = parallel_state.generate_masked_orthogonal_rank_groups
    # sizes (tp, dp, pp) = (2, 3, 4): rank = tp + 2 dp + 6 pp; the dp groups vary dp inside, (tp, pp) outside.
    dp = gen(24, [2, 3, 4], [False, True, False])
    assert dp[:3] == [[0, 2, 4], [1, 3, 5], [6, 8, 10]] and len(dp) == 8
    assert gen(8, [2, 2, 2], [True, False, True]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1).get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(RuntimeError, match="not the product"):
        gen(7, [2, 2], [True, False])
    assert parallel_state.default_embedding_ranks([3, 7, 11]) == [3, 11]
    assert parallel_state.default_embedding_ranks([5]) == [5]
    assert parallel_state.default_position_embedding_ranks([3, 7, 11]) == [3]


def test_all_ranks_data_parallel_override_and_create_group(single_rank):
    assert parallel_state.get_all_ranks() == "0_0_0_0_0"
    parallel_state.set_data_parallel_rank(3)
    try:
        assert parallel_state.get_data_parallel_rank() == 3 and parallel_state.get_all_ranks() == "0_3_0_0_0"
    finally:
        parallel_state.set_data_parallel_rank(None)
    assert parallel_state.get_data_parallel_rank() == 0
    group = parallel_state.create_group([0], group_desc="test-group")
    x = torch.ones(2)
    torch.distributed.all_reduce(x, group=group)
    assert torch.equal(x, torch.ones(2)) and torch.distributed.get_world_size(group) == 1


def test_window_attention_rule():
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import is_layer_window_attention

    assert not is_layer_window_attention(None, 2, 1)
    assert [is_layer_window_attention((4, 0), 2, n) for n in (1, 2, 3, 4)] == [True, False, True, False]
    assert is_layer_window_attention((4, 0), None, 7)
    assert [is_layer_window_attention((4, 0), [1, 0, 1], n) for n in (1, 2, 3)] == [True, False, True]
    cfg = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2, window_size=(4, 0),
                            window_attn_skip_freq=2)
    assert [cfg.is_window_attention_layer(n) for n in (1, 2, 3, 4)] == [True, False, True, False]


def test_fast_gelu_and_fp8_align():
    from megatron.core.activations import fast_gelu
    from megatron.core.fp8_utils import get_fp8_align_size
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    x = torch.linspace(-4, 4, 33)
    torch.testing.assert_close(fast_gelu(x), torch.nn.functional.gelu(x, approximate="tanh"))
    assert get_fp8_align_size("mxfp8") == 32 and get_fp8_align_size("delayed") == 16
    assert get_align_size_for_quantization(types.SimpleNamespace(fp8=None)) == 16
    assert get_align_size_for_quantization(types.SimpleNamespace(fp8="e4m3", fp8_recipe="mxfp8")) == 32


def test_moe_routing_helpers(single_rank):
    from megatron.core.transformer.moe import moe_utils

    routing = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 0], [0, 0, 1]], dtype=torch.int)
    padded = moe_utils.pad_routing_map(routing.clone(), 3)
    # counts (2, 2, 1) -> 3 each: expert 0 takes its first unrouted token (1), expert 1 token 0, expert 2 tokens 0, 1.
    expected = routing.clone()
    expected[1, 0] = expected[0, 1] = expected[0, 2] = expected[1, 2] = 1
    assert torch.equal(padded, expected) and (padded.sum(0) % 3 == 0).all()

    group = parallel_state.get_tensor_model_parallel_group()
    per_expert, local, total = moe_utils.get_tokens_per_expert_and_token_count(routing.bool(), group)
    assert per_expert.tolist() == [2, 2, 1] and local == 5 and total == 5
    _, local, total = moe_utils.get_tokens_per_expert_and_token_count(routing.bool(), group, topk=1,
                                                                       with_padding_mask=True)
    assert float(local) == 5.0 and float(total) == 5.0

    counts, bias = torch.tensor([4.0, 1.0, 1.0]), torch.zeros(3)
    updated = moe_utils.get_updated_expert_bias(counts, bias, 0.1)
    torch.testing.assert_close(updated, torch.tensor([-0.1, 0.1, 0.1]))
    assert moe_utils.maybe_move_tensor_to_cpu(counts) is counts


def test_router_gating_linear_matches_fp32_linear_and_saves_low_precision():
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    torch.manual_seed(0)
    x = torch.randn(3, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        out = router_gating_linear(x, w, b, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (3, 2, 4)
    assert saved == [torch.bfloat16] * 3  # x, W, b as given: no float32 copy is kept for backward
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    ref = torch.nn.functional.linear(x32, w32, b32)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    for ours, theirs in ((x.grad, x32.grad), (w.grad, w32.grad), (b.grad, b32.grad)):
        torch.testing.assert_close(ours.float(), theirs, atol=2e-2, rtol=2e-2)


def test_mtp_placement(single_rank):
    from megatron.core.transformer import multi_token_prediction as mtp

    cfg = types.SimpleNamespace(mtp_num_layers=2)
    assert mtp.get_mtp_ranks([0, 4, 8], cfg) == [8] and mtp.get_mtp_ranks([0, 4], types.SimpleNamespace(
        mtp_num_layers=None)) == []
    # one pipeline stage: it is the last, so it builds every depth
    assert mtp.mtp_on_this_rank(cfg) and mtp.get_mtp_num_layers_to_build(cfg) == 2
    assert mtp.get_mtp_layer_offset(cfg) == 0
    assert not mtp.mtp_on_this_rank(types.SimpleNamespace(mtp_num_layers=None))
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    try:
        assert mtp.get_mtp_num_layers_to_build(cfg, vp_stage=0) == 0
        assert mtp.get_mtp_num_layers_to_build(cfg, vp_stage=1) == 2
        assert mtp.mtp_on_this_rank(cfg, ignore_virtual=True, vp_stage=0)
        assert not mtp.mtp_on_this_rank(cfg, ignore_virtual=False, vp_stage=0)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def test_rank_utils_log_on_one_rank(monkeypatch, caplog):
    import logging

    from megatron.core._rank_utils import log_single_rank, safe_get_rank
    from megatron.core.datasets.utils import log_single_rank as datasets_log

    assert datasets_log is log_single_rank
    if not torch.distributed.is_initialized():
        monkeypatch.setenv("RANK", "2")
        assert safe_get_rank() == 2
        logger = logging.getLogger("module-map-test")
        with caplog.at_level(logging.INFO, logger="module-map-test"):
            log_single_rank(logger, logging.INFO, "rank zero only")
            log_single_rank(logger, logging.INFO, "rank two", rank=2)
        assert [r.getMessage() for r in caplog.records] == ["rank two"]
        monkeypatch.setenv("RANK", "x")
        assert safe_get_rank() == 0


def test_moe_module_spec_and_vision_module():
    from megatron.core.models.common.vision_module.vision_module import VisionModule
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    spec = get_moe_module_spec(use_te=False, num_experts=4)
    assert spec.module is MoELayer and spec.submodules.experts.module is SequentialMLP
    assert get_moe_module_spec(False, 4, moe_grouped_gemm=True).submodules.experts.module is GroupedMLP
    with pytest.raises(ImportError, match="(?i)transformer engine|transformer_engine"):
        get_moe_module_spec(num_experts=4)  # megatron-core's default asks for Transformer Engine layers
    config = types.SimpleNamespace(num_layers=1)
    vision = VisionModule(config)
    assert isinstance(vision, MegatronModule) and vision.config is config


def test_schedule_table_and_first_val_step():
    from megatron.core.pipeline_parallel.schedules import check_first_val_step, get_schedule_table

    assert get_schedule_table(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    # an uneven last group takes the remaining micro-batches
    assert get_schedule_table(3, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]
    assert check_first_val_step(None, True, True) and not check_first_val_step(False, True, True)
    assert check_first_val_step(False, False, True) and not check_first_val_step(True, True, False)


def test_layer_and_attention_classes_and_optimizer_configs(single_rank):
    from helpers.models_helpers import tiny_config

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.optimizer_config import AdamOptimizerConfig, SGDOptimizerConfig
    from megatron.core.transformer.attention import Attention, CrossAttention, SelfAttention
    from megatron.core.transformer.transformer_layer import (BaseTransformerLayer, MoETransformerLayer,
                                                             NoopTransformerLayer, TransformerLayer)

    assert issubclass(SelfAttention, Attention) and issubclass(CrossAttention, Attention)
    layer = TransformerLayer(tiny_config(), get_gpt_layer_local_spec().submodules)
    assert isinstance(layer, BaseTransformerLayer) and isinstance(NoopTransformerLayer(1), BaseTransformerLayer)
    assert mamba_stack_spec.submodules.moe_layer.module is MoETransformerLayer
    moe = MoETransformerLayer(tiny_config(), get_gpt_layer_local_spec().submodules)
    assert moe.is_moe_layer and isinstance(moe, TransformerLayer)

    model = torch.nn.Linear(4, 4)
    model.config = tiny_config()
    sgd = get_megatron_optimizer(SGDOptimizerConfig(lr=0.1, sgd_momentum=0.5), [model])
    adam = get_megatron_optimizer(AdamOptimizerConfig(lr=0.1, adam_beta2=0.95), [model])
    inner = [getattr(o, "optimizer", o) for o in (sgd, adam)]
    assert isinstance(inner[0], torch.optim.SGD) and inner[0].param_groups[0]["momentum"] == 0.5
    assert isinstance(inner[1], torch.optim.Adam | torch.optim.AdamW) and inner[1].param_groups[0]["betas"][1] == 0.95


def test_gpt_spec_helpers_and_cp_rope_rows(single_rank):
    from helpers.models_helpers import tiny_config

    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    assert specs.get_mlp_module_spec(use_te=False).module is MLP
    assert specs.get_mlp_module_spec(use_te=False, num_experts=4).module is MoELayer
    with pytest.raises(ImportError):
        specs.get_mlp_module_spec()  # megatron-core's default: Transformer Engine layers
    cfg = tiny_config(num_layers=4, num_moe_experts=4, moe_layer_freq=[0, 1, 0, 1], moe_router_topk=2)
    layer_specs = specs.get_gpt_decoder_layer_specs(cfg, use_transformer_engine=False)
    kinds = [s.submodules.mlp.module for s in layer_specs]
    assert kinds == [MLP, MoELayer, MLP, MoELayer]
    assert specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False).layer_specs == layer_specs

    angles = torch.arange(8.0).view(8, 1, 1, 1)
    group = parallel_state.get_context_parallel_group()  # one rank: the rows are all of them
    assert torch.equal(get_pos_emb_on_this_cp_rank(angles, 0, group), angles)
    with pytest.raises(ValueError, match="cp_group"):
        get_pos_emb_on_this_cp_rank(angles, 0, None)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bias_matches_hf_t5(bidirectional):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    from megatron.core.models.common.embeddings.relative_pos_embedding import RelativePositionEmbedding

    torch.manual_seed(0)
    ours = RelativePositionEmbedding(bidirectional, torch.nn.init.normal_, num_attention_heads=3,
                                     relative_attention_num_buckets=16, relative_attention_max_distance=20)
    hf_config = T5Config(d_model=12, d_kv=4, num_heads=3, relative_attention_num_buckets=16,
                         relative_attention_max_distance=20, is_decoder=not bidirectional)
    theirs = T5Attention(hf_config, has_relative_attention_bias=True)
    theirs.relative_attention_bias.weight.data.copy_(ours.relative_attention_bias.weight)
    offsets = torch.arange(-40, 41)
    assert torch.equal(ours._relative_position_bucket(offsets, bidirectional, 16, 20),
                       T5Attention._relative_position_bucket(offsets, bidirectional, 16, 20))
    torch.testing.assert_close(ours(7, 30), theirs.compute_bias(7, 30))
    block = types.SimpleNamespace(input_tensor=None)
    cfg = types.SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=2)
    assert RelativePositionEmbedding.get_relative_seq_len(None, block, torch.zeros(5, 1, 4), cfg) == 10


def test_reset_model_temporary_tensors_and_model_xattn():
    from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
    from megatron.core.utils import get_model_xattn

    class Router(torch.nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.expert_bias = torch.zeros(3) if bias else None
            self.local_tokens_per_expert = torch.tensor([2.0, 1.0, 0.0])
            self.global_tokens_per_expert = torch.tensor([5.0, 5.0, 5.0])

        def reset_global_aux_loss_tracker(self):
            self.global_tokens_per_expert.zero_()

    with_bias, without_bias = Router(True), Router(False)
    reset_model_temporary_tensors(None, [torch.nn.Sequential(with_bias), torch.nn.Sequential(without_bias)])
    assert with_bias.local_tokens_per_expert.sum() == 0 and with_bias.global_tokens_per_expert.sum() == 0
    assert without_bias.local_tokens_per_expert.sum() == 3 and without_bias.global_tokens_per_expert.sum() == 0

    inner = torch.nn.Linear(2, 2)
    wrapper = types.SimpleNamespace(module=inner)
    assert get_model_xattn(wrapper) is False
    inner.xattn_needed = True
    assert get_model_xattn(wrapper) is True


def test_frozen_weight_linears_save_no_input_and_give_input_grads(single_rank):
    from helpers.models_helpers import tiny_config

    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer, MegatronTokenizer
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    assert MegatronLegacyTokenizer is MegatronTokenizer
    cfg = tiny_config()
    torch.manual_seed(0)
    for cls, kwargs in ((ColumnParallelLinear, dict(gather_output=True)), (RowParallelLinear,
                                                                          dict(input_is_parallel=True))):
        layer = cls(8, 6, config=cfg, init_method=torch.nn.init.normal_, bias=True, skip_bias_add=False, **kwargs)
        layer.weight.requires_grad_(False)
        x = torch.randn(5, 2, 8, requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            out, _ = layer(x)
        assert (5, 2, 8) not in saved, f"{cls.__name__} saved its input for a frozen weight"
        ref_x = x.detach().clone().requires_grad_()
        ref = torch.nn.functional.linear(ref_x, layer.weight, layer.bias)
        torch.testing.assert_close(out, ref)
        g = torch.randn_like(ref)
        out.backward(g)
        ref.backward(g)
        torch.testing.assert_close(x.grad, ref_x.grad)
        assert layer.weight.grad is None and layer.bias.grad is not None


def test_base_data_parallel_template_and_ddp_derives_from_it():
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    assert issubclass(DistributedDataParallel, _BaseDataParallel)
    inner = torch.nn.Linear(3, 2)
    wrapper = _BaseDataParallel(config=None, module=inner)
    x = torch.randn(4, 3)
    with wrapper.no_sync():
        torch.testing.assert_close(wrapper(x), inner(x))
    wrapper.start_grad_sync(), wrapper.finish_grad_sync(), wrapper.zero_grad_buffer(), wrapper.broadcast_params()
    assert list(wrapper.state_dict()) == ["weight", "bias"] == list(wrapper.state_dict_for_save_checkpoint())
    wrapper.load_state_dict({"weight": torch.zeros(2, 3), "bias": torch.ones(2)})
    assert torch.equal(inner(x), torch.ones(4, 2))


def test_torch_strategy_flatten_and_legacy_metadata_classes():
    import pickle

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as torch_flatten

    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies import torch as strategy

    obj = ShardedObject("k", {"x": 1}, (1,), (0,), replica_id=0)
    nested = {"a": {"b": [torch.ones(1), torch.zeros(1)], "c": [1, 2]}, "d": obj, "e": 3}
    flat, paths = strategy.flatten_state_dict(nested)
    assert flat["d"] is obj and paths["d"] == ("d",)
    plain = {k: v for k, v in nested.items() if k != "d"}
    theirs, their_paths = torch_flatten(plain)
    assert {k: v for k, v in flat.items() if k != "d"}.keys() == theirs.keys() == {"a.b.0", "a.b.1", "a.c", "e"}
    assert {k: p for k, p in paths.items() if k != "d"} == their_paths
    with pytest.raises(ValueError, match="duplicated"):
        strategy.flatten_state_dict({"a.b": 1, "a": {"b": 2}})
    for cls in (strategy.MCoreMetadata, strategy.MCoreSavePlan):
        assert type(pickle.loads(pickle.dumps(cls()))) is cls


def test_forward_step_calc_loss_contracts():
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    config = types.SimpleNamespace(calculate_per_token_loss=False, timers=None, num_moe_experts=None,
                                   mtp_num_layers=None)
    store = []
    out = torch.tensor(6.0)
    loss, tokens = forward_step_calc_loss(None, out, lambda t: (t, torch.tensor(3), {"lm loss": t}), config, None,
                                          False, 2, store, cp_group_size=1, is_last_stage=True)
    assert float(loss) == 1.0 and int(tokens) == 3 and store == [{"lm loss": out}]  # 6 / 3 tokens / 2 micro-batches
    loss, tokens = forward_step_calc_loss(None, out, lambda t: (t, {"lm loss": t}), config, None, False, 2, store,
                                          cp_group_size=2, is_last_stage=True)
    assert float(loss) == 6.0 and int(tokens) == 0  # the 2023 contract: x CP / micro-batches
    loss, _ = forward_step_calc_loss(None, out, None, config, None, False, 2, store, 1, False)
    assert loss is out and len(store) == 2  # not the last stage: nothing stored
    with pytest.raises(ValueError, match="both"):
        forward_step_calc_loss(None, out, None, config, None, False, 2, store, cp_group_size=1)


def test_mtp_layer_submodules(single_rank):
    from helpers.models_helpers import tiny_config

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionLayer,
                                                                  MultiTokenPredictionLayerSubmodules,
                                                                  get_mtp_layer_spec)
    from megatron.core.transformer.spec_utils import build_module

    cfg = tiny_config(style="llama", mtp_num_layers=1)
    spec = get_mtp_layer_spec(get_gpt_layer_local_spec(), use_transformer_engine=False)
    assert isinstance(spec.submodules, MultiTokenPredictionLayerSubmodules)
    from_spec = build_module(spec, config=cfg, layer_number=1)
    from_layer_spec = MultiTokenPredictionLayer(cfg, get_gpt_layer_local_spec())  # the layer spec alone
    shapes = {k: tuple(v.shape) for k, v in from_spec.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in from_layer_spec.state_dict().items()}
    assert shapes["eh_proj.weight"] == (32, 64) and type(from_spec.enorm).__name__ == "RMSNorm"
    assert from_spec.transformer_layer.layer_number == cfg.num_layers + 1


def test_backend_spec_builders(single_rank):
    from helpers.models_helpers import tiny_config

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    local = LocalSpecProvider()
    dense = specs.get_mlp_module_spec_for_backend(local)
    assert (dense.submodules.linear_fc1, dense.submodules.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)
    moe = get_moe_module_spec_for_backend(local, num_experts=4)
    assert moe.module is MoELayer and moe.submodules.experts.module is SequentialMLP
    assert moe.submodules.shared_experts.submodules.linear_fc1 is ColumnParallelLinear
    cfg = tiny_config(style="llama", mtp_num_layers=2, num_moe_experts=4, moe_router_topk=2)
    layer = specs.get_gpt_layer_local_spec(num_experts=4)
    block = specs.get_gpt_mtp_block_spec_for_backend(cfg, layer, local)  # one stage: it is the last
    assert [s.module for s in block.layer_specs] == [MultiTokenPredictionLayer] * 2
    assert block.layer_specs[0].submodules.transformer_layer is layer
    model_layer = MoELayer(cfg, moe.submodules)  # the MoE spec builds
    assert len(model_layer.experts.local_experts) == 4
    assert specs.get_gpt_mtp_block_spec_for_backend(tiny_config(), layer, local) is None


def test_mock_multimodal_dataset():
    from helpers.data_support import tokenizer_args

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.multimodal_dataset import MockMultimodalDataset, MultimodalDatasetConfig
    from megatron.tokenizer import build_tokenizer

    fields = dict(random_seed=1, sequence_length=8, blend=None, split="1,0,0",
                  tokenizer=build_tokenizer(tokenizer_args("NullTokenizer", vocab_size=100)),
                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    with pytest.raises(ValueError, match="image_w"):
        MultimodalDatasetConfig(image_h=4, **fields)
    config = MultimodalDatasetConfig(image_h=4, image_w=6, preprocess_func=lambda s: {**s, "seen": True}, **fields)
    train = BlendedMegatronDatasetBuilder(MockMultimodalDataset, [3, None, None], lambda: True, config).build()[0]
    sample = train[0]
    assert sample["image"].shape == (3, 4, 6) and not sample["image"].any() and sample["seen"]
    assert sample["tokens"].shape == (8,)


def test_set_model_to_sequence_parallel_flags(single_rank):
    # The numerics were checked once at TP=2 (decoder output [s/2, b, h] with SP, [s, b, h] without, logits equal).
    from helpers.models_helpers import tiny_config

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.utils import set_model_to_sequence_parallel

    model = GPTModel(tiny_config(), get_gpt_layer_local_spec(), 64, 16)
    model.reduce_scatter_embeddings = False  # not touched for learned absolute positions (megatron-core's rule)
    keep = model.decoder.layers[0]
    set_model_to_sequence_parallel(model, True, exclude_modules=[keep])
    kept = {id(m) for m in keep.modules()}
    flags = [(id(m) in kept, m.sequence_parallel) for m in model.modules() if hasattr(m, "sequence_parallel")]
    assert model.config.sequence_parallel is True and model.embedding.scatter_to_sequence_parallel is True
    assert all(on for inside, on in flags if not inside) and not any(on for inside, on in flags if inside)
    assert model.reduce_scatter_embeddings is False
    set_model_to_sequence_parallel(model, False)
    assert not any(m.sequence_parallel for m in model.modules() if hasattr(m, "sequence_parallel"))


def test_cached_metadata_reader_reads_metadata_once(tmp_path):
    import os

    import torch.distributed.checkpoint as dcp

    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader)

    dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    reader = CachedMetadataFileSystemReader(str(tmp_path))
    first = reader.read_metadata()
    os.remove(tmp_path / ".metadata")  # a second read from disk would fail now
    assert reader.read_metadata() is first and "w" in first.state_dict_metadata
    loaded = {"w": torch.zeros(6)}
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(6.0))


def test_reduce_scatter_with_fp32_accumulation_one_rank(single_rank):
    # Checked once on 3 gloo ranks: bf16 output equal to the fp32 sum of the ranks' shards, sync and async.
    from megatron.core.distributed.reduce_scatter_with_fp32_accumulation import reduce_scatter_with_fp32_accumulation

    x = torch.randn(6).to(torch.bfloat16)
    out = torch.empty(6, dtype=torch.bfloat16)
    handle = reduce_scatter_with_fp32_accumulation(out, x, torch.distributed.ReduceOp.SUM, None, True)
    handle.wait()
    assert torch.equal(out, x)
    with pytest.raises(ValueError, match="SUM"):
        reduce_scatter_with_fp32_accumulation(out, x, torch.distributed.ReduceOp.MAX, None, False)


def test_pipeline_parallel_layer_layout():
    from megatron.core.transformer.enums import LayerType as T
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout as Layout

    E, t, m, L = T.embedding, T.decoder, T.mtp, T.loss
    assert Layout.parse_str_to_list("Ettt|(tt|)*2,m|L") == [[E, t, t, t], [t, t], [t, t], [m], [L]]
    assert Layout.get_num_stages_from_str("Ettt|(tt|)*29,m|L") == 32
    assert Layout.parse_str_to_list("Et*3|L") == [[E, t, t, t], [L]]
    # 2 ranks x 3 virtual stages: stage i is virtual stage i // 2 of rank i % 2.
    layout = Layout("Et|t|tt|t|m|L", 2)
    assert layout.layout == [[[E, t], [t, t], [m]], [[t], [t], [L]]]
    assert layout.flatten_layout == [E, t, t, t, t, t, m, L]
    assert [layout.get_num_layers_to_build(t, v, r) for v in range(3) for r in range(2)] == [1, 1, 2, 1, 0, 0]
    assert layout.get_layer_id_list(t, vp_stage=1, pp_rank=0) == [2, 3]
    assert layout.get_layer_id_list(t, vp_stage=1, pp_rank=1) == [4]
    assert layout.get_layer_offset(m, vp_stage=2, pp_rank=0) == 0
    assert layout.validate_layer_layout(num_layers=5, mtp_num_layers=1) is True  # MTP not on the last rank
    with pytest.raises(ValueError, match="last virtual stage"):
        Layout("Et|t|tt|tm|L|", 2).validate_layer_layout(5, 1)
    assert Layout("Ett|m|L|", 1).layout == [[[E, t, t], [m], [L], []]]
    assert Layout([["embedding", "decoder", "mtp"], ["loss"]], 2).validate_layer_layout(1, 1) is True
    assert Layout([["embedding", "decoder"], ["mtp", "loss"]], 2).validate_layer_layout(1, 1) is False
    with pytest.raises(ValueError, match="num_layers"):
        layout.validate_layer_layout(num_layers=4, mtp_num_layers=1)
    with pytest.raises(ValueError, match="multiple"):
        Layout("Et|L", 3)
    with pytest.raises(ValueError, match="invalid layer character"):
        Layout.parse_str_to_list("Ex|L")
    assert Layout.from_str("Et|L", 2) is Layout.from_str("Et|L", 2) and "PP rank" in layout.pretty_repr()
