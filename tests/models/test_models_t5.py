"""T5 (legacy megatron.model.T5Model and megatron-core T5Model) against a plain-PyTorch reference written from the
math with the same weights, and against Hugging Face BlenderbotForConditionalGeneration (reference section 3.2)."""
import pytest
import torch

from helpers.models_helpers import single_rank, tiny_config  # noqa: F401  (fixture)
from helpers.numerics import rel_err
from helpers.t5_helpers import (VOCAB, blenderbot_from_core, randomize_, reference_loss, reference_t5, t5_inputs,
                                t5_masks)

from megatron.core.models.T5 import T5Model as CoreT5Model
from megatron.core.models.T5.t5_spec import (get_t5_decoder_with_local_block_spec,
                                             get_t5_encoder_with_local_block_spec)
from megatron.core.models.conversion import keys
from megatron.model import T5Model

HEADS = 4


def _core_model(config, layers=2):
    return CoreT5Model(config, config, get_t5_encoder_with_local_block_spec(layers),
                       get_t5_decoder_with_local_block_spec(layers), vocab_size=VOCAB, max_sequence_length=16,
                       share_embeddings_and_output_weights=True)


def _core_masks(enc, dec):
    return [m.unsqueeze(1) for m in t5_masks(enc, dec)]


def test_t5_legacy_and_core_match_reference(single_rank):
    config = tiny_config(num_layers=2, init_method_std=0.2)
    model = T5Model(config).eval()
    randomize_(model)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    # Megatron's legacy key names (reference 1.1), one per parameter.
    assert "language_model.decoder.layers.1.inter_attention.key_value.weight" in sd
    assert "language_model.decoder.layers.0.post_inter_attention_layernorm.bias" in sd
    assert sd["language_model.decoder.layers.0.inter_attention.query.weight"].shape == (32, 32)
    assert sd["lm_head.bias"].shape == (VOCAB,)
    nested = model.state_dict_for_save_checkpoint()
    assert set(nested) == {"language_model", "lm_head"}
    assert set(nested["language_model"]) == {"embedding", "encoder", "decoder"}

    enc, dec, labels, loss_mask = t5_inputs()
    with torch.no_grad():
        ref_logits = reference_t5(sd, enc, dec, HEADS)
        masks = t5_masks(enc, dec)
        logits = model(enc, dec, *masks)
        loss = model(enc, dec, *masks, lm_labels=labels)
    ref_loss = reference_loss(ref_logits, labels)
    keep = loss_mask.bool()
    errs = {"legacy_logits": rel_err(logits[keep], ref_logits[keep]),
            "legacy_loss": rel_err(loss[keep], ref_loss[keep])}
    # Megatron's micro-batch loss: sum(loss * loss_mask) / sum(loss_mask); -1 labels stay finite.
    assert torch.isfinite(loss).all()
    errs["legacy_mean_loss"] = rel_err((loss * loss_mask).sum() / loss_mask.sum(),
                                       (ref_loss * loss_mask).sum() / loss_mask.sum())

    core = _core_model(config).eval()
    core_sd = keys.legacy_to_mcore(sd, "t5")
    core.load_state_dict(core_sd)
    with torch.no_grad():
        core_logits = core(enc, dec, *_core_masks(enc, dec))
        core_loss = core(enc, dec, *_core_masks(enc, dec), lm_labels=labels)
    errs["core_logits"] = rel_err(core_logits[keep], ref_logits[keep])
    errs["core_loss"] = rel_err(core_loss[keep], ref_loss[keep])
    print(f"T5 vs plain-PyTorch reference, max relative errors: {errs}")
    assert all(e <= 1e-5 for e in errs.values()), errs
    # megatron-core names: its aliases appear in the state dict, and map back onto the legacy keys one to one.
    core_keys = set(core.state_dict())
    assert {"output_layer.bias", "position_embeddings.weight", "lm_head.output_layer.bias",
            "decoder.layers.0.cross_attention.linear_kv.weight", "decoder.final_layernorm.weight"} <= core_keys
    assert keys.mcore_to_legacy(core.state_dict(), "t5").keys() == sd.keys()

    # The explicit (unfused) attention path, and the nested checkpoint layout, load and give the same model.
    unfused = T5Model(tiny_config(num_layers=2, attention_backend="unfused")).eval()
    unfused.load_state_dict(nested)
    with torch.no_grad():
        assert rel_err(unfused(enc, dec, *masks)[keep], ref_logits[keep]) <= 1e-5


def test_t5_gradients_match_reference(single_rank):
    """Backward of the masked mean loss: gradients of every parameter against autograd through the reference."""
    config = tiny_config(num_layers=1, init_method_std=0.2)
    model = T5Model(config)
    randomize_(model)
    enc, dec, labels, loss_mask = t5_inputs(seed=3)
    loss = (model(enc, dec, *t5_masks(enc, dec), lm_labels=labels) * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    sd = {k: v.detach().double().requires_grad_() for k, v in model.state_dict().items()}
    ref = (reference_loss(reference_t5(sd, enc, dec, HEADS), labels) * loss_mask).sum() / loss_mask.sum()
    ref.backward()
    worst = 0.0
    for name, p in model.state_dict(keep_vars=True).items():  # legacy names -> the parameters themselves
        assert sd[name].grad is not None and p.grad is not None, name
        worst = max(worst, rel_err(p.grad, sd[name].grad))
    print(f"T5 gradients vs reference: max relative error {worst:.2e}")
    assert worst <= 1e-5


def test_t5_core_matches_hf_blenderbot(single_rank):
    pytest.importorskip("transformers")
    config = tiny_config(num_layers=2, init_method_std=0.2)
    core = _core_model(config).eval()
    randomize_(core)
    core_sd = {k: v.detach() for k, v in core.state_dict().items()}
    hf = blenderbot_from_core(core_sd, hidden=32, heads=HEADS, ffn=128, layers=2, dec_layers=2, vocab=VOCAB,
                              max_pos=16)
    enc, dec, labels, loss_mask = t5_inputs(seed=1)
    with torch.no_grad():
        logits = core(enc, dec, *_core_masks(enc, dec))
        loss = core(enc, dec, *_core_masks(enc, dec), lm_labels=labels)
        out = hf(input_ids=enc, attention_mask=(enc >= 1).long(), decoder_input_ids=dec,
                 decoder_attention_mask=(dec >= 1).long())
    keep = loss_mask.bool()
    hf_loss = reference_loss(out.logits.double(), labels)
    errs = {"logits": rel_err(logits[keep], out.logits[keep]), "loss": rel_err(loss[keep], hf_loss[keep])}
    print(f"megatron-core T5 vs HF Blenderbot, max relative errors: {errs}")
    assert all(e <= 1e-5 for e in errs.values()), errs


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_t5_half_precision_close_to_fp32(single_rank, dtype):
    """Float16Module(fp16/bf16) T5: finite loss and gradients, per-token loss within half-precision rounding."""
    from megatron.core.transformer.module import Float16Module

    enc, dec, labels, loss_mask = t5_inputs(seed=2)
    ref = T5Model(tiny_config(num_layers=2, init_method_std=0.2))
    with torch.no_grad():
        ref_loss = ref(enc, dec, *t5_masks(enc, dec), lm_labels=labels)
    config = tiny_config(num_layers=2, init_method_std=0.2, **{dtype: True})
    half = T5Model(config)
    half.load_state_dict(ref.state_dict())
    wrapped = Float16Module(config, half)
    loss = wrapped(enc, dec, *t5_masks(enc, dec), lm_labels=labels)
    assert loss.dtype == torch.float32
    ((loss * loss_mask).sum() / loss_mask.sum()).backward()
    keep = loss_mask.bool()
    err = rel_err(loss[keep], ref_loss[keep])
    print(f"T5 {dtype} vs fp32 per-token loss: max relative error {err:.2e}")
    assert err < (2e-2 if dtype == "bf16" else 3e-3)
    assert all(torch.isfinite(p.grad).all() for p in half.parameters() if p.grad is not None)
