"""tools/checkpoint/convert.py with --loader/--saver torch_dist: Hugging Face -> torch_dist -> torch (TP=2) equals
Hugging Face -> torch (TP=2) directly, and Hugging Face -> torch_dist -> Hugging Face is exact."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _convert(*argv):
    from tools.checkpoint import convert
    convert.convert(convert.get_args(["--model-type", "GPT", *argv]))


def test_torch_dist_loader_and_saver(tmp_path):
    from megatron.training.checkpointing.torch_dist import load_full_checkpoint

    src, dist, via, direct, back = (str(tmp_path / n) for n in ("hf", "dist", "via", "direct", "back"))
    _llama().save_pretrained(src, safe_serialization=True)
    _convert("--loader", "hf", "--saver", "torch_dist", "--load-dir", src, "--save-dir", dist)
    ckpt = load_full_checkpoint(os.path.join(dist, "release"))
    assert ckpt["checkpoint_version"] == 3.0
    assert ckpt["model"]["decoder.layers.self_attention.linear_qkv.weight"].shape == (2, 128, 64)
    assert ckpt["model"]["decoder.layers.mlp.linear_fc1.layer_norm_weight"].shape == (2, 64)
    # --use-checkpoint-args reads the model shape from a torch_dist checkpoint's common.pt.
    import argparse

    from megatron.training.checkpointing import load_args_from_checkpoint
    args, ckpt_args = load_args_from_checkpoint(argparse.Namespace(load=dist, ckpt_step=None))
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.swiglu) == (2, 64, 4, True)
    # No --loader: the converter detects torch_dist, then Hugging Face, from the directory.
    _convert("--saver", "legacy", "--load-dir", dist, "--save-dir", via, "--target-tensor-parallel-size", "2")
    _convert("--saver", "legacy", "--load-dir", src, "--save-dir", direct, "--target-tensor-parallel-size", "2")
    from tools.checkpoint.convert import detect_loader
    assert (detect_loader(dist), detect_loader(src), detect_loader(via)) == ("torch_dist", "hf", "legacy")
    from megatron.core.models.conversion.keys import legacy_to_mcore
    for rank in ("mp_rank_00", "mp_rank_01"):
        a = torch.load(os.path.join(via, "release", rank, "model_optim_rng.pt"), weights_only=False)["model"]
        b = torch.load(os.path.join(direct, "release", rank, "model_optim_rng.pt"), weights_only=False)["model"]

        def flat(d, prefix=""):
            out = {}
            for k, v in d.items():
                if isinstance(v, dict):
                    out.update(flat(v, prefix + k + "."))
                elif torch.is_tensor(v):
                    out[prefix + k] = v
            return out
        fa, fb = legacy_to_mcore(flat(a)), legacy_to_mcore(flat(b))
        assert set(fa) == set(fb), set(fa) ^ set(fb)
        for k in fa:
            assert torch.equal(fa[k], fb[k]), (rank, k)
    _convert("--loader", "torch_dist", "--saver", "hf", "--load-dir", dist, "--save-dir", back)
    original, exported = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert set(original) == set(exported)
    for k in original:
        assert torch.equal(original[k], exported[k]), k
