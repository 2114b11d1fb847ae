"""Megatron's pre-LN BertModel against a plain-PyTorch reference written here from the math (fp32, CPU)."""
import math

import torch
import torch.nn.functional as F

from helpers.numerics import rel_err
from helpers.models_helpers import bert_inputs, single_rank, tiny_config  # noqa: F401  (fixture)

from megatron.core.models.bert import BertModel as CoreBertModel
from megatron.core.models.conversion import keys
from megatron.model import BertModel

HEADS = 4


def reference_bert(sd, ids, padding, types, eps=1e-5):
    """BERT as Megatron computes it, from the state dict (legacy key names) with plain tensor ops.

    Attention: scores / sqrt(d), positions where query or key is padding filled with -10000, softmax.
    """
    def ln(x, prefix):
        return F.layer_norm(x, x.shape[-1:], sd[prefix + ".weight"], sd[prefix + ".bias"], eps)

    b, s = ids.shape
    x = (sd["language_model.embedding.word_embeddings.weight"][ids]
         + sd["language_model.embedding.position_embeddings.weight"][torch.arange(s)]
         + sd["language_model.embedding.tokentype_embeddings.weight"][types])
    masked = (padding[:, None, :] * padding[:, :, None]) < 0.5          # [b, s, s], True = masked
    h = x.shape[-1]
    hd = h // HEADS
    layer = 0
    while f"language_model.encoder.layers.{layer}.input_layernorm.weight" in sd:
        p = f"language_model.encoder.layers.{layer}."
        y = ln(x, p + "input_layernorm")
        qkv = y @ sd[p + "self_attention.query_key_value.weight"].T + sd[p + "self_attention.query_key_value.bias"]
        qkv = qkv.view(b, s, HEADS, 3, hd)                              # per head: [q, k, v]
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]       # [b, s, heads, hd]
        scores = torch.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(masked[:, None], -10000.0)
        probs = scores.softmax(-1)
        ctx = torch.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, h)
        x = x + ctx @ sd[p + "self_attention.dense.weight"].T + sd[p + "self_attention.dense.bias"]
        y = ln(x, p + "post_attention_layernorm")
        y = F.gelu(y @ sd[p + "mlp.dense_h_to_4h.weight"].T + sd[p + "mlp.dense_h_to_4h.bias"])
        x = x + y @ sd[p + "mlp.dense_4h_to_h.weight"].T + sd[p + "mlp.dense_4h_to_h.bias"]
        layer += 1
    x = ln(x, "language_model.encoder.final_layernorm")
    pooled = torch.tanh(x[:, 0] @ sd["language_model.pooler.dense.weight"].T + sd["language_model.pooler.dense.bias"])
    binary = pooled @ sd["binary_head.weight"].T + sd["binary_head.bias"]
    y = F.gelu(x @ sd["lm_head.dense.weight"].T + sd["lm_head.dense.bias"])
    y = ln(y, "lm_head.layernorm")
    logits = y @ sd["language_model.embedding.word_embeddings.weight"].T + sd["lm_head.bias"]
    return logits, binary


def _randomize(model):
    """Random biases and norm weights (Megatron initialises them to 0/1, which would hide mistakes)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))


def test_bert_matches_reference(single_rank):
    config = tiny_config(num_layers=2)
    model = BertModel(config, num_tokentypes=2, add_binary_head=True).eval()
    _randomize(model)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    ids, padding, types, labels = bert_inputs()

    with torch.no_grad():
        ref_logits, ref_binary = reference_bert(sd, ids, padding, types)
        logits, binary = model(ids, padding, tokentype_ids=types)
        loss, binary2 = model(ids, padding, tokentype_ids=types, lm_labels=labels)
    errs = {"mlm_logits": rel_err(logits, ref_logits), "binary_logits": rel_err(binary, ref_binary)}
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, ref_logits.shape[-1]), labels.reshape(-1), reduction="none")
    errs["mlm_loss"] = rel_err(loss.reshape(-1), ref_loss)
    print(f"BERT vs plain-PyTorch reference, max relative errors: {errs}")
    assert all(e <= 1e-5 for e in errs.values()), errs
    assert torch.equal(binary, binary2)

    # The explicit (unfused) attention path gives the same model, fully masked (padding) rows included.
    unfused_config = tiny_config(num_layers=2, attention_backend="unfused")
    unfused = BertModel(unfused_config, num_tokentypes=2).eval()
    unfused.load_state_dict(sd)
    with torch.no_grad():
        assert rel_err(unfused(ids, padding, tokentype_ids=types)[0], ref_logits) <= 1e-5

    # megatron-core's BertModel is the same model under megatron-core key names.
    core = CoreBertModel(config, 2, vocab_size=64, max_sequence_length=16,
                         share_embeddings_and_output_weights=True).eval()
    core.load_state_dict(keys.legacy_to_mcore(sd, "bert"))
    with torch.no_grad():
        core_logits, core_binary = core(ids, padding, tokentype_ids=types)
    assert rel_err(core_logits, ref_logits) <= 1e-5 and rel_err(core_binary, ref_binary) <= 1e-5
    assert keys.mcore_to_legacy(core.state_dict(), "bert").keys() == sd.keys()


def test_bert_checkpoint_layout(single_rank):
    """state_dict_for_save_checkpoint nests like Megatron's checkpoints and loads back."""
    model = BertModel(tiny_config(), num_tokentypes=2)
    nested = model.state_dict_for_save_checkpoint()
    assert set(nested) == {"language_model", "lm_head", "binary_head"}
    assert set(nested["language_model"]) == {"embedding", "encoder", "pooler"}
    assert set(nested["language_model"]["embedding"]) == {"word_embeddings", "position_embeddings",
                                                          "tokentype_embeddings"}
    assert "layers.0.self_attention.query_key_value.weight" in nested["language_model"]["encoder"]
    assert set(nested["lm_head"]) == {"bias", "dense.weight", "dense.bias", "layernorm.weight", "layernorm.bias"}
    other = BertModel(tiny_config(), num_tokentypes=2)
    other.load_state_dict(nested)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
