"""Tiny hybrid (Nemotron-H) models for the tests: a random Hugging Face ``NemotronHForCausalLM`` whose every weight
matters, and the HF -> torch_dist conversion of it."""
from __future__ import annotations

import os

import torch

HF_VOCAB = 100
# Mamba, attention, MoE, MLP, Mamba: every layer type of the pattern
HF_BLOCKS = ["linear_attention", "full_attention", "moe", "mlp", "linear_attention"]


def tiny_hf_nemotron_h(seed: int = 0, blocks=None):
    """A 5-layer ``NemotronHForCausalLM`` (hidden 32, 4 heads / 2 groups, Mamba 8 heads x 8 in 2 groups of state 8,
    4 experts top-2 on a latent width 16 with a shared expert, routed scaling 2.5), eval mode. Norm weights, A, D,
    the conv bias and the expert bias are randomised; ``dt_bias`` is drawn so that Δ stays well above transformers'
    clamp at ``time_step_min`` (Megatron does not clamp)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.NemotronHConfig(
        vocab_size=HF_VOCAB, hidden_size=32, layers_block_type=list(blocks or HF_BLOCKS), num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
        ssm_state_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24, moe_latent_size=16, routed_scaling_factor=2.5, chunk_size=4,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = transformers.NemotronHForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.uniform_(-3.0, 0.0)
            elif name.endswith(("norm.weight", "norm_f.weight")):
                p.normal_(1.0, 0.2)
            elif name.endswith(("A_log", "mixer.D", "conv1d.bias")):
                p.normal_(0.3, 0.3)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return cfg, model


def convert(*argv):
    from tools.checkpoint import convert as tool

    tool.convert(tool.get_args(["--model-type", "GPT", *argv]))


def hf_to_torch_dist(model, directory: str) -> str:
    """Save ``model`` under ``directory/hf`` and convert it to torch_dist in ``directory/dist``; return the latter."""
    src, dist = os.path.join(directory, "hf"), os.path.join(directory, "dist")
    model.save_pretrained(src, safe_serialization=True)
    convert("--loader", "hf", "--saver", "torch_dist", "--load-dir", src, "--save-dir", dist)
    return dist


def tiny_corpus(directory: str, vocab: int = HF_VOCAB) -> str:
    """A small indexed dataset of random tokens below ``vocab`` (64 documents of 20-59 tokens, the last one EOD
    ``vocab``); returns its prefix. Faster to index than --mock-data's 100000 synthetic documents."""
    from helpers.data_support import write_indexed

    g = torch.Generator().manual_seed(7)
    docs = [[torch.randint(0, vocab, (int(n),), generator=g).tolist() + [vocab]]
            for n in torch.randint(20, 60, (64,), generator=g)]
    prefix = os.path.join(directory, "tiny_text_document")
    write_indexed(prefix, docs)
    return prefix


def ids(batch: int = 2, seq: int = 12, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, HF_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
