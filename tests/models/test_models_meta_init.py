"""--init-model-with-meta-device (megatron/core/distributed/fsdp/meta_init.py): a model built on the meta device and
materialised owner by owner holds bitwise the weights of the ordinary build from the same seeds, and leaves the
generators (dropout) where the ordinary build leaves them.

The reference is the ordinary eager build (every layer drawing in its constructor); the meta build allocates and
draws nothing. Covered: GPT-2 (tied, learned positions), Llama-style MoE (RoPE, GQA-free, learnable attention
sinks, sigmoid routing with expert bias, shared expert with gate), grouped experts with a latent projection,
DeepSeek-style MLA with dense + MoE layers and MTP, a hybrid Mamba model, BERT (token types, pooler, binary head),
each with and without --use-cpu-initialization. The FSDP2 shards of the same materialisation are checked against
the run without the flag in tests/training/test_train_fsdp.py.
"""
import pytest
import torch
import torch.nn.functional as F

from helpers.models_helpers import single_rank  # noqa: F401 - fixture

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1,
            padded_vocab_size=64, max_position_embeddings=16)


def _build(kind, cpu_init, meta):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = dict(BASE, use_cpu_initialization=cpu_init, init_model_with_meta_device=meta)
    glu = dict(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    if kind == "gpt2":
        return GPTModel(TransformerConfig(**base), get_gpt_layer_local_spec(), 64, 16,
                        share_embeddings_and_output_weights=True)
    if kind == "llama_moe":
        cfg = TransformerConfig(**base, **glu, normalization="RMSNorm", num_moe_experts=4, moe_router_topk=2,
                                ffn_hidden_size=48, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                                moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                                position_embedding_type="rope", softmax_type="learnable")
        return GPTModel(cfg, get_gpt_layer_local_spec(num_experts=4), 64, 16, position_embedding_type="rope")
    if kind == "grouped":
        cfg = TransformerConfig(**base, **glu, num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True,
                                moe_latent_size=16)
        return GPTModel(cfg, get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True), 64, 16)
    if kind == "mla_mtp":
        cfg = MLATransformerConfig(**dict(base, num_layers=3), **glu, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                                   qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True, mtp_num_layers=1,
                                   original_max_position_embeddings=16, position_embedding_type="rope",
                                   num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1, 1],
                                   moe_shared_expert_intermediate_size=16)
        return GPTModel(cfg, get_gpt_decoder_block_spec(cfg), 64, 16, position_embedding_type="rope")
    if kind == "hybrid":
        from megatron.core.models.mamba.mamba_layer_specs import get_mamba_stack_spec
        from megatron.core.models.mamba.mamba_model import MambaModel

        cfg = TransformerConfig(**dict(base, num_layers=4), normalization="RMSNorm", add_bias_linear=False,
                                mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, num_moe_experts=4,
                                moe_router_topk=2, moe_ffn_hidden_size=16)
        return MambaModel(cfg, get_mamba_stack_spec(), 64, 16, hybrid_layer_pattern="M*-E")
    from megatron.core.models.bert.bert_model import BertModel

    return BertModel(TransformerConfig(**base), num_tokentypes=2, vocab_size=64, max_sequence_length=16,
                     add_binary_head=True)


def _seed():
    from megatron.core import tensor_parallel

    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(7)


def _generators():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return torch.get_rng_state(), get_cuda_rng_tracker().get_states()


def _same_generators(a, b):
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("cpu_init", [True, False])
@pytest.mark.parametrize("kind", ["gpt2", "llama_moe", "grouped", "mla_mtp", "hybrid", "bert"])
def test_meta_build_then_materialise_equals_the_ordinary_build(single_rank, kind, cpu_init):  # noqa: F811
    from megatron.core.distributed.fsdp.meta_init import RngStates, materialize
    from megatron.core.transformer.norms import init_device

    _seed()
    eager = _build(kind, cpu_init, meta=False)
    want = {k: v for k, v in eager.state_dict().items() if torch.is_tensor(v)}
    after_eager = _generators()

    _seed()
    rng = RngStates.capture()
    model = _build(kind, cpu_init, meta=True)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated ...
    assert _same_generators(_generators(), (rng.cpu, rng.tracker))  # ... and nothing drawn
    materialize(model, rng, {n: p.dtype for n, p in model.named_parameters()}, init_device(model.config))
    got = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, differ
    assert _same_generators(_generators(), after_eager)  # dropout draws the same masks afterwards
    assert not any(p.is_meta for p in model.parameters())


def test_materialise_needs_the_build_generator_states_and_a_reset_for_every_parameter(single_rank):  # noqa: F811
    """Without the build's generator states the weights differ (the comparison above can fail); a module with
    parameters and no reset_parameters() is refused, naming it."""
    from megatron.core.distributed.fsdp.meta_init import MetaInitError, RngStates, materialize

    _seed()
    want = _build("gpt2", True, meta=False).state_dict()
    model = _build("gpt2", True, meta=True)
    materialize(model, RngStates.capture(), {}, torch.device("cpu"))  # the states after the eager build
    assert not torch.equal(model.state_dict()["decoder.layers.0.mlp.linear_fc1.weight"],
                           want["decoder.layers.0.mlp.linear_fc1.weight"])

    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.empty(3, device="meta"))

    holder = torch.nn.Sequential(torch.nn.LayerNorm(3, device="meta"), Bare())
    with pytest.raises(MetaInitError, match=r"Bare \(1\) has parameters but no reset_parameters"):
        materialize(holder, None, {}, torch.device("cpu"))
