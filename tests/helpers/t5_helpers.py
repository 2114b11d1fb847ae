"""T5 test helpers: inputs and masks, a plain-PyTorch T5 written from the math (legacy key names), and the
Hugging Face Blenderbot weight mapping of reference section 3.2 (megatron-core key names)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

VOCAB = 64  # padded vocabulary of the tiny configs (tiny_config's padded_vocab_size)


def t5_inputs(batch=3, se=10, sd=7, vocab=60, seed=0):
    """Encoder / decoder ids with trailing padding (id 0) of different lengths, labels padded with -1."""
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(1, vocab, (batch, se), generator=g)
    dec = torch.randint(1, vocab, (batch, sd), generator=g)
    labels = torch.randint(1, vocab, (batch, sd), generator=g)
    for i in range(batch):
        enc[i, se - 2 * i:] = 0
        dec[i, sd - i:] = 0
        labels[i, sd - i:] = -1
    loss_mask = (dec >= 1).float()
    return enc, dec, labels, loss_mask


def t5_masks(enc, dec):
    """Megatron's T5 masks from ids (id >= 1 is a token), boolean True = masked: enc [b,se,se], dec [b,sd,sd]
    (padding x lower-triangular), enc-dec [b,sd,se]."""
    ek, dk = enc >= 1, dec >= 1
    sd = dec.shape[1]
    tril = torch.tril(torch.ones(sd, sd, dtype=torch.bool))
    enc_mask = ~(ek[:, None, :] & ek[:, :, None])
    dec_mask = ~(dk[:, None, :] & dk[:, :, None] & tril)
    enc_dec_mask = ~(dk[:, :, None] & ek[:, None, :])
    return enc_mask, dec_mask, enc_dec_mask


def reference_t5(sd, enc, dec, heads, eps=1e-5, act=F.gelu):
    """Logits [b, sd, V] of Megatron's T5 from a legacy-named state dict, with plain tensor ops (fp32).

    Pre-LN layers; attention softmax(q k^T / sqrt(hd), masked -10000) v; the fused QKV rows hold per head
    [q | k | v], the cross-attention key_value rows per head [k | v]; logits = y E^T + lm_head.bias.
    """
    sd = {k: v.double() for k, v in sd.items()}
    E = sd["language_model.embedding.word_embeddings.weight"]
    P = sd["language_model.embedding.position_embeddings.weight"]
    enc_mask, dec_mask, x_mask = t5_masks(enc, dec)

    def lin(x, p):
        return x @ sd[p + ".weight"].T + sd[p + ".bias"]

    def ln(x, p):
        return F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps)

    def attend(q, k, v, mask):  # q [b,sq,n,hd], k/v [b,sk,n,hd], mask [b,sq,sk]
        scores = torch.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(q.shape[-1])
        probs = scores.masked_fill(mask[:, None], -10000.0).softmax(-1)
        ctx = torch.einsum("bnqk,bknd->bqnd", probs, v)
        return ctx.reshape(ctx.shape[0], ctx.shape[1], -1)

    def self_attn(x, p, mask):
        b, s, _ = x.shape
        qkv = lin(x, p + "query_key_value").view(b, s, heads, 3, -1)
        return lin(attend(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], mask), p + "dense")

    def mlp(x, p):
        return lin(act(lin(x, p + "dense_h_to_4h")), p + "dense_4h_to_h")

    b = enc.shape[0]
    x = E[enc] + P[torch.arange(enc.shape[1])]
    i = 0
    while f"language_model.encoder.layers.{i}.input_layernorm.weight" in sd:
        p = f"language_model.encoder.layers.{i}."
        x = x + self_attn(ln(x, p + "input_layernorm"), p + "self_attention.", enc_mask)
        x = x + mlp(ln(x, p + "post_attention_layernorm"), p + "mlp.")
        i += 1
    enc_out = ln(x, "language_model.encoder.final_layernorm")

    y = E[dec] + P[torch.arange(dec.shape[1])]
    i = 0
    while f"language_model.decoder.layers.{i}.input_layernorm.weight" in sd:
        p = f"language_model.decoder.layers.{i}."
        y = y + self_attn(ln(y, p + "input_layernorm"), p + "self_attention.", dec_mask)
        z = ln(y, p + "post_attention_layernorm")
        q = lin(z, p + "inter_attention.query").view(b, dec.shape[1], heads, -1)
        kv = lin(enc_out, p + "inter_attention.key_value").view(b, enc.shape[1], heads, 2, -1)
        y = y + lin(attend(q, kv[..., 0, :], kv[..., 1, :], x_mask), p + "inter_attention.dense")
        y = y + mlp(ln(y, p + "post_inter_attention_layernorm"), p + "mlp.")
        i += 1
    y = ln(y, "language_model.decoder.final_layernorm")
    return y @ E.T + sd["lm_head.bias"]


def reference_loss(logits, labels):
    """Per-token cross entropy [b, sd]; -1 labels give 0 here (callers compare under the loss mask)."""
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1), reduction="none")
    return flat.view(labels.shape) * (labels >= 0)


def randomize_(model, seed=5):
    """Random biases and norm parameters (Megatron initialises them to 0/1, which would hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + base)


def blenderbot_from_core(core_sd, *, hidden, heads, ffn, layers, dec_layers, vocab, max_pos, activation="gelu"):
    """A Hugging Face BlenderbotForConditionalGeneration holding a megatron-core T5 state dict (reference 3.2)."""
    from transformers import BlenderbotConfig, BlenderbotForConditionalGeneration

    cfg = BlenderbotConfig(vocab_size=vocab, max_position_embeddings=max_pos, d_model=hidden,
                           encoder_layers=layers, decoder_layers=dec_layers, encoder_attention_heads=heads,
                           decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
                           activation_function=activation, scale_embedding=False, dropout=0.0, attention_dropout=0.0,
                           activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
                           tie_word_embeddings=True, pad_token_id=0)
    hf = BlenderbotForConditionalGeneration(cfg).eval()
    hd = hidden // heads
    new = {}

    def split(w, parts):  # fused rows [heads, parts, hd, ...] -> parts tensors [heads*hd, ...]
        w = w.view(heads, parts, hd, *w.shape[1:])
        return [w[:, j].reshape(heads * hd, *w.shape[3:]) for j in range(parts)]

    E = core_sd["embedding.word_embeddings.weight"]
    new["model.shared.weight"] = E
    for stack in ("encoder", "decoder"):
        new[f"model.{stack}.embed_tokens.weight"] = E
        new[f"model.{stack}.embed_positions.weight"] = core_sd["embedding.position_embeddings.weight"]
        new[f"model.{stack}.layer_norm.weight"] = core_sd[f"{stack}.final_layernorm.weight"]
        new[f"model.{stack}.layer_norm.bias"] = core_sd[f"{stack}.final_layernorm.bias"]
        for i in range(layers if stack == "encoder" else dec_layers):
            c, h = f"{stack}.layers.{i}.", f"model.{stack}.layers.{i}."
            for t in ("weight", "bias"):
                q, k, v = split(core_sd[c + f"self_attention.linear_qkv.{t}"], 3)
                new[h + f"self_attn.q_proj.{t}"], new[h + f"self_attn.k_proj.{t}"] = q, k
                new[h + f"self_attn.v_proj.{t}"] = v
                new[h + f"self_attn.out_proj.{t}"] = core_sd[c + f"self_attention.linear_proj.{t}"]
                new[h + f"self_attn_layer_norm.{t}"] = core_sd[c + f"input_layernorm.{t}"]
                new[h + f"final_layer_norm.{t}"] = core_sd[c + f"pre_mlp_layernorm.{t}"]
                new[h + f"fc1.{t}"] = core_sd[c + f"mlp.linear_fc1.{t}"]
                new[h + f"fc2.{t}"] = core_sd[c + f"mlp.linear_fc2.{t}"]
                if stack == "decoder":
                    new[h + f"encoder_attn_layer_norm.{t}"] = core_sd[c + f"pre_cross_attn_layernorm.{t}"]
                    new[h + f"encoder_attn.q_proj.{t}"] = core_sd[c + f"cross_attention.linear_q.{t}"]
                    k, v = split(core_sd[c + f"cross_attention.linear_kv.{t}"], 2)
                    new[h + f"encoder_attn.k_proj.{t}"], new[h + f"encoder_attn.v_proj.{t}"] = k, v
                    new[h + f"encoder_attn.out_proj.{t}"] = core_sd[c + f"cross_attention.linear_proj.{t}"]
    new["lm_head.weight"] = E
    missing, unexpected = hf.load_state_dict(new, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"final_logits_bias"}, missing
    with torch.no_grad():
        hf.final_logits_bias.copy_(core_sd["lm_head.output_layer.bias"].view(1, -1))
    return hf
