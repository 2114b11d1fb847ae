"""tools/checkpoint/convert.py --model-type T5: a legacy T5 torch checkpoint written with PP=2 and split rank 1
(encoder stage, decoder stage, the embedding on both) and TP=2 -> torch_dist -> torch TP=1 (megatron-core names).
Checks: the torch_dist checkpoint holds megatron-core's T5 keys (two stacked layer stacks, cross-attention,
lm_head.output_layer.bias, megatron-core's alias keys); every tensor survives; the megatron-core T5Model loaded from the
result gives the legacy model's logits; target PP > 1 for a torch T5 checkpoint is a one-line error."""
import os
import types

import pytest
import torch

from helpers.models_helpers import single_rank, tiny_config  # noqa: F401  (fixture)
from helpers.numerics import rel_err
from helpers.t5_helpers import VOCAB, randomize_, t5_inputs, t5_masks

from megatron.core.models.conversion import keys
from megatron.core.models.conversion.tp import split_tensor_parallel
from megatron.model import T5Model


def _args():
    return types.SimpleNamespace(num_layers=2, decoder_num_layers=2, hidden_size=32, num_attention_heads=4,
                                 ffn_hidden_size=128, kv_channels=8, swiglu=False, untie_embeddings_and_output_weights=False,
                                 use_mcore_models=False, make_vocab_size_divisible_by=16, tensor_model_parallel_size=2,
                                 pipeline_model_parallel_size=2, pipeline_model_parallel_split_rank=1,
                                 group_query_attention=False, num_query_groups=None, padded_vocab_size=VOCAB,
                                 max_position_embeddings=16, seq_length=16, data_parallel_size=1)


def _write_pp2_split_checkpoint(sd, root):
    """What a PP=2, split-rank-1, TP=2 legacy T5 run saves: stage 0 embedding + encoder, stage 1 embedding +
    decoder + lm_head (Megatron's nested layout, stage-local layer numbers)."""
    from tools.checkpoint.legacy_io import _nest

    stages = [{k: v for k, v in sd.items() if k.startswith(("language_model.embedding.", "language_model.encoder."))},
              {k: v for k, v in sd.items() if not k.startswith("language_model.encoder.")}]
    it = os.path.join(root, "iter_0000005")
    for p, stage in enumerate(stages):
        for t, shard in enumerate(split_tensor_parallel(stage, 2)):
            path = os.path.join(it, f"mp_rank_{t:02d}_{p:03d}", "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path))
            torch.save({"args": _args(), "checkpoint_version": 3.0, "iteration": 5, "model": _nest(shard)}, path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")


def _convert(*argv):
    from tools.checkpoint import convert

    convert.convert(convert.get_args(["--model-type", "T5", *argv]))


def test_t5_legacy_pp2_split_to_torch_dist_to_torch(single_rank, tmp_path):
    model = T5Model(tiny_config(num_layers=2, init_method_std=0.2)).eval()
    randomize_(model)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _write_pp2_split_checkpoint(sd, str(tmp_path / "legacy"))

    _convert("--loader", "legacy", "--saver", "torch_dist", "--load-dir", str(tmp_path / "legacy"),
             "--save-dir", str(tmp_path / "dist"))
    from megatron.training.checkpointing.torch_dist import load_full_checkpoint

    ckpt = load_full_checkpoint(str(tmp_path / "dist" / "iter_0000005"))
    disk = ckpt["model"]
    assert disk["decoder.layers.cross_attention.linear_kv.weight"].shape == (2, 64, 32)
    assert disk["encoder.layers.self_attention.linear_qkv.layer_norm_weight"].shape == (2, 32)
    assert disk["decoder.layers.pre_cross_attn_layernorm.weight"].shape == (2, 32)
    assert disk["lm_head.output_layer.bias"].shape == (VOCAB,)
    # megatron-core's T5Model aliases are stored too (it writes and reads both keys).
    assert torch.equal(disk["output_layer.bias"], disk["lm_head.output_layer.bias"])
    assert torch.equal(disk["position_embeddings.weight"], disk["embedding.position_embeddings.weight"])
    core_sd = keys.legacy_to_mcore(sd, "t5")
    assert torch.equal(disk["decoder.layers.mlp.linear_fc1.weight"][1], core_sd["decoder.layers.1.mlp.linear_fc1.weight"])

    _convert("--loader", "torch_dist", "--saver", "legacy", "--load-dir", str(tmp_path / "dist"),
             "--save-dir", str(tmp_path / "tp1"), "--target-tensor-parallel-size", "1",
             "--target-pipeline-parallel-size", "1")
    back = torch.load(tmp_path / "tp1" / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    from megatron.core.transformer.module import flatten_checkpoint_state_dict

    flat = flatten_checkpoint_state_dict(back["model"])
    assert flat.keys() == core_sd.keys()
    assert all(torch.equal(flat[k], core_sd[k]) for k in flat)

    # megatron-core's T5Model loads it (its aliases filled in) and computes the legacy model's logits.
    from megatron.core.models.T5 import T5Model as CoreT5Model
    from megatron.core.models.T5.t5_spec import (get_t5_decoder_with_local_block_spec,
                                                 get_t5_encoder_with_local_block_spec)

    core = CoreT5Model(tiny_config(num_layers=2), None, get_t5_encoder_with_local_block_spec(2),
                       get_t5_decoder_with_local_block_spec(2), vocab_size=VOCAB, max_sequence_length=16,
                       share_embeddings_and_output_weights=True).eval()
    core.load_state_dict(back["model"])
    enc, dec, _, _ = t5_inputs()
    with torch.no_grad():
        expected = model(enc, dec, *t5_masks(enc, dec))
        got = core(enc, dec, *[m.unsqueeze(1) for m in t5_masks(enc, dec)])
    assert rel_err(got, expected) <= 1e-6

    from tools.checkpoint.legacy_io import ConversionError

    with pytest.raises(ConversionError, match="T5 torch checkpoints are written with PP=1 only") as error:
        _convert("--loader", "torch_dist", "--saver", "legacy", "--load-dir", str(tmp_path / "dist"),
                 "--save-dir", str(tmp_path / "pp2"), "--target-pipeline-parallel-size", "2")
    assert "\n" not in str(error.value)
