"""Shared helpers of the model tests: a one-rank process group, tiny configs, error metrics."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer import TransformerConfig


@pytest.fixture(scope="module")
def single_rank():
    """A 1-rank gloo group with TP=PP=1, for single-process model tests (torn down after the module)."""
    created = False
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="models_pg_")
        os.close(fd)
        os.remove(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        created = True
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()



def causal_mask(s: int) -> torch.Tensor:
    """Megatron's causal mask: [1, 1, s, s] boolean, True = masked (above the diagonal)."""
    return torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)


def tiny_config(tp: int = 1, pp: int = 1, sp: bool = False, style: str = "gpt2", **overrides) -> TransformerConfig:
    """A small TransformerConfig (vocabulary 64, 16 positions).

    ``style='gpt2'``: LayerNorm, gelu, biases, learned positions, tied output layer.
    ``style='llama'``: RMSNorm, swiglu, RoPE, grouped-query attention (8 heads, 4 groups), no biases, untied.
    """
    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                  use_cpu_initialization=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  sequence_parallel=sp, pipeline_dtype=torch.float32 if pp > 1 else None)
    kwargs.update(padded_vocab_size=64, max_position_embeddings=16)
    if style == "llama":
        import torch.nn.functional as F

        kwargs.update(num_attention_heads=8, num_query_groups=4, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                      add_bias_linear=False, ffn_hidden_size=48, layernorm_epsilon=1e-6)
        kwargs.update(position_embedding_type="rope", untie_embeddings_and_output_weights=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gpt_inputs(batch: int = 2, seq: int = 8, vocab: int = 60, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    return ids, pos, causal_mask(seq), labels


def bert_inputs(batch: int = 2, seq: int = 8, vocab: int = 60, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    types = torch.randint(0, 2, (batch, seq), generator=g)
    padding = torch.ones(batch, seq, dtype=torch.long)
    padding[1, seq - 3:] = 0  # the second sample is padded: exercises fully masked attention rows
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, padding, types, labels


def tiny_hf_mixtral(vocab_size: int = 96, num_experts: int = 4, topk: int = 2):
    """(config, model): a 2-layer Hugging Face ``MixtralForCausalLM`` (hidden 32, GQA 4 heads / 2 groups), eval mode,
    seed 0; norms U(0.5, 1.5), experts N(0, 0.05) and router weights N(0, 0.5), which spreads the router scores so
    that top-k choices are far from ties."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=num_experts,
                                     num_experts_per_tok=topk, max_position_embeddings=32, rms_norm_eps=1e-6,
                                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = transformers.MixtralForCausalLM(cfg).eval()
    spread_moe_weights(model, expert_std=0.05)
    return cfg, model


def spread_moe_weights(model, expert_std: float):
    """Re-draw a random Hugging Face MoE model's weights in place: norms U(0.5, 1.5), router (``gate.weight``)
    N(0, 0.5), experts N(0, expert_std), so that top-k choices are far from ties."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "gate.weight" in name:
                p.normal_(0, 0.5)
            elif "experts" in name:
                p.normal_(0, expert_std)


def set_global_weights(model):
    """Give every tensor of the model the values of one global tensor drawn from its checkpoint key, sliced by its
    sharded_state_dict's offsets: the same weights whatever the layout (a pipeline stage draws its layers from another
    point of the RNG stream at construction). Norm weights keep their ones."""
    import zlib

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def leaves(tree):
        for value in tree.values() if isinstance(tree, dict) else tree:
            yield from leaves(value) if isinstance(value, (dict, list)) else [value]

    with torch.no_grad():
        for sh in leaves(model.sharded_state_dict()):
            assert not isinstance(sh, ShardedTensorFactory), sh
            if not isinstance(sh, ShardedTensor) or "norm" in sh.key:
                continue
            g = torch.Generator().manual_seed(zlib.crc32(sh.key.encode()))
            full = 0.05 * torch.randn(sh.global_shape, generator=g)
            pre = sh.prepend_axis_num  # leading axes (the expert index) the local tensor does not have
            index = tuple(off if axis < pre else slice(off, off + sh.local_shape[axis - pre])
                          for axis, off in enumerate(sh.global_offset))
            sh.data.copy_(full[index])
