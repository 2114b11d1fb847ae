"""Tiny random Hugging Face models of today's transformer families (built offline from configs), their conversion to
torch_dist with tools/checkpoint/convert.py, and loading such a checkpoint into a megatron-core GPTModel at any
TP/EP (shared by the model tests and the training tests)."""
from __future__ import annotations

import os

import torch

VOCAB = 96          # padded to 128 by --make-vocab-size-divisible-by 128
PADDED_VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0,
              eos_token_id=0, pad_token_id=None)
LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192, rope_theta=500000.0)

# family -> (transformers model class, config class, config fields beyond COMMON)
FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(intermediate_size=48)),
    # head_dim 16 != hidden / heads (as Qwen3's 128 with hidden 1024 and 16 heads); tied like Qwen3-0.6B
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, intermediate_size=48, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_local_experts=4,
                       num_experts_per_tok=2, norm_topk_prob=True)),
    # Llama 3.2's RoPE scaling (factor 32); head_dim 16 so that several frequencies are scaled
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(head_dim=16, intermediate_size=48, rope_parameters=LLAMA3_ROPE)),
    # attention sinks, sliding window 4 on layers 1 and 3 (of 4) and full attention on 2 and 4, quick GeGLU experts
    # with biases, the offset and a clamp small enough to act (gpt-oss: 7), YaRN as gpt-oss has it (factor 32, no
    # rounding of the correction range) with a short original context so that it changes the tiny model's
    # frequencies; sequences of 12 make the window matter
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig",
                dict(num_hidden_layers=4, head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=4, swiglu_limit=0.2, rms_norm_eps=1e-5, max_position_embeddings=4096,
                     rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                          truncate=False, original_max_position_embeddings=128,
                                          rope_theta=150000.0))),
    # Llama 4 Scout's shape: every layer MoE (top-1 sigmoid routing on the expert input, shared expert), the QK L2 norm,
    # interleaved RoPE with llama3 scaling, NoPE on layer 4 of 4 (Hugging Face's default interval)
    "llama4_text": ("Llama4ForCausalLM", "Llama4TextConfig",
                    dict(num_hidden_layers=4, head_dim=8, intermediate_size=16, intermediate_size_mlp=48,
                         num_local_experts=4, interleave_moe_layer_step=1, use_qk_norm=True,
                         rope_parameters=dict(LLAMA3_ROPE, factor=16.0))),
    # Nemotron-Mini's shape: LayerNorm 1p with biases, squared-ReLU MLP, RoPE on half of each head (head_dim 16)
    "nemotron": ("NemotronForCausalLM", "NemotronConfig",
                 dict(head_dim=16, intermediate_size=48, norm_eps=1e-5,
                      rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
}
# Llama 4 Maverick's shape: dense and MoE layers interleaved, no QK norm (as its checkpoint)
LLAMA4_INTERLEAVED = dict(interleave_moe_layer_step=2, use_qk_norm=False)


def tiny_hf(family: str, seed: int = 0, **overrides):
    """A 2-layer ``transformers`` model of ``family`` in eval mode, random weights from ``seed``: norms U(0.5, 1.5),
    biases N(0, 0.3), routers N(0, 0.5) (HF initialises norms to 1 and biases to 0, which would hide a missing one;
    the wide router spreads the top-k choices away from ties)."""
    import transformers

    model_cls, config_cls, fields = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **fields, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
            elif name.endswith(("mlp.gate.weight", "router.weight")):
                p.normal_(0, 0.5)
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)
    return model


def convert(*argv):
    """tools/checkpoint/convert.py in this process."""
    from tools.checkpoint import convert as tool

    tool.convert(tool.get_args(["--model-type", "GPT", *argv]))


def inputs(batch: int = 2, seq: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def megatron_config(hf_config, tp: int = 1, **config_kwargs):
    """The TransformerConfig of ``hf_config``'s family (fp32, CPU initialisation, the padded vocabulary of the
    torch_dist checkpoints the tests write)."""
    from megatron.core.models.conversion import hf_registry

    bridge = hf_registry.bridge_for(hf_config.model_type)
    return bridge.config_to_megatron(hf_config, make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp,
                                     use_cpu_initialization=True, padded_vocab_size=PADDED_VOCAB, **config_kwargs)


def gpt_model(config, parallel_output: bool = True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return GPTModel(config, get_gpt_decoder_block_spec(config), config.padded_vocab_size,
                    config.max_position_embeddings, parallel_output=parallel_output,
                    share_embeddings_and_output_weights=not config.untie_embeddings_and_output_weights).eval()


def load_torch_dist(model, directory: str) -> None:
    """Load a converter-written (release) torch_dist checkpoint into ``model`` at this process's TP/EP layout."""
    from megatron.training.checkpointing.dist_state import apply_loaded_model, model_sharded_state
    from megatron.training.checkpointing.torch_dist import load_sharded_checked

    request = model_sharded_state([model], None, for_load=True)
    loaded = load_sharded_checked(request, os.path.join(directory, "release"))
    apply_loaded_model([model], loaded)


def logits(model, ids):
    """Our model's logits ``[b, s, VOCAB]`` (causal attention, positions 0..s-1), gathered over the TP ranks."""
    from megatron.core import tensor_parallel

    b, s = ids.shape
    with torch.no_grad():
        out = model(ids, torch.arange(s).expand(b, s), None)
        if model.parallel_output:
            out = tensor_parallel.gather_from_tensor_model_parallel_region(out)
        return out[..., :VOCAB]
