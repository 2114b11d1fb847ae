"""GPTModel against Hugging Face GPT2LMHeadModel and LlamaForCausalLM with the same random weights (fp32, CPU).

The HF models are built from small configs with random weights (no download); their state dicts are converted
with megatron.core.models.conversion.hf and loaded into our legacy and megatron-core GPTModels.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from helpers.numerics import rel_err
from helpers.models_helpers import causal_mask, single_rank  # noqa: F401  (fixture)

transformers = pytest.importorskip("transformers")

from megatron.core.models.conversion import hf, keys  # noqa: E402
from megatron.core.models.gpt import GPTModel as CoreGPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.model import GPTModel  # noqa: E402

SEQ, BATCH = 12, 2


def _hf_gpt2(vocab_size):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab_size, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return cfg, transformers.GPT2LMHeadModel(cfg).eval()


def _hf_llama(vocab_size, tie=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1: make them random so a missing norm weight would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return cfg, model


def _inputs(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return ids, pos, causal_mask(SEQ)


def _check_family(hf_cfg, hf_model, to_config, to_megatron, to_hf, make_divisible_by):
    """Logits of legacy + megatron-core GPTModel vs HF, loss vs HF's loss, and the conversion round trip."""
    V = hf_cfg.vocab_size
    config = to_config(hf_cfg, make_vocab_size_divisible_by=make_divisible_by, use_cpu_initialization=True)
    sd = to_megatron(hf_model.state_dict(), hf_cfg, config.padded_vocab_size)
    legacy = GPTModel(config).eval()
    legacy.load_state_dict(sd)
    untied = config.untie_embeddings_and_output_weights
    core = CoreGPTModel(config, get_gpt_layer_local_spec(), config.padded_vocab_size, config.max_position_embeddings,
                        share_embeddings_and_output_weights=not untied,
                        position_embedding_type=config.position_embedding_type,
                        rotary_base=config.rotary_base).eval()
    core.load_state_dict(keys.legacy_to_mcore(sd, "gpt"))

    unfused_config = dataclasses.replace(config, attention_backend="unfused")  # explicit masked-softmax attention
    unfused = GPTModel(unfused_config).eval()
    unfused.load_state_dict(sd)

    ids, pos, mask = _inputs(V)
    with torch.no_grad():
        ref = hf_model(ids).logits
        errs = {"legacy": rel_err(legacy(ids, pos, mask)[..., :V], ref),
                "mcore": rel_err(core(ids, pos, mask)[..., :V], ref),
                "legacy-unfused-attention": rel_err(unfused(ids, pos, mask)[..., :V], ref)}
        # Loss: HF shifts labels inside; ours takes per-position labels and returns the per-token loss.
        labels = torch.roll(ids, -1, dims=1)
        hf_loss = hf_model(ids, labels=ids).loss
        our_loss = legacy(ids, pos, mask, labels=labels)[:, :-1].mean()
        if config.padded_vocab_size == V:
            assert abs(our_loss.item() - hf_loss.item()) <= 1e-5 * abs(hf_loss.item()), (our_loss, hf_loss)
        else:  # padded vocabulary: the padded logits are 0 and take part in the softmax, as in Megatron
            ref_padded = F.pad(ref, (0, config.padded_vocab_size - V))
            expect = F.cross_entropy(ref_padded[:, :-1].reshape(-1, config.padded_vocab_size), ids[:, 1:].reshape(-1))
            assert abs(our_loss.item() - expect.item()) <= 1e-5 * abs(expect.item())
    for name, err in errs.items():
        assert err <= 1e-5, f"{name} GPTModel logits differ from HF: relative error {err:.2e}"

    back = to_hf(legacy.state_dict(), hf_cfg)
    hf_sd = hf_model.state_dict()
    assert set(back) == set(hf_sd)
    for k in hf_sd:
        assert torch.equal(back[k], hf_sd[k]), k
    back_mcore = to_hf(core.state_dict(), hf_cfg, key_format="mcore")
    assert all(torch.equal(back_mcore[k], hf_sd[k]) for k in hf_sd)
    return errs


def test_gpt2_parity(single_rank):
    cfg, model = _hf_gpt2(vocab_size=100)  # padded to 128
    errs = _check_family(cfg, model, hf.gpt2_config_to_megatron, hf.gpt2_hf_to_megatron, hf.gpt2_megatron_to_hf, 128)
    print(f"GPT-2 logits max relative error: {errs}")
    cfg, model = _hf_gpt2(vocab_size=96)  # no padding: the loss must equal HF's exactly
    _check_family(cfg, model, hf.gpt2_config_to_megatron, hf.gpt2_hf_to_megatron, hf.gpt2_megatron_to_hf, 32)


def test_llama_parity(single_rank):
    cfg, model = _hf_llama(vocab_size=96)
    errs = _check_family(cfg, model, hf.llama_config_to_megatron, hf.llama_hf_to_megatron, hf.llama_megatron_to_hf, 32)
    print(f"Llama (GQA, RoPE, RMSNorm, swiglu, untied) logits max relative error: {errs}")
    cfg, model = _hf_llama(vocab_size=100, tie=True)
    _check_family(cfg, model, hf.llama_config_to_megatron, hf.llama_hf_to_megatron, hf.llama_megatron_to_hf, 128)


def test_fused_qkv_layout_is_group_major():
    """Megatron's fused QKV rows: for each query group its query heads, then K, then V."""
    nh, ng, hd = 4, 2, 3
    q = torch.arange(nh * hd).float().unsqueeze(1)
    k = 100 + torch.arange(ng * hd).float().unsqueeze(1)
    v = 200 + torch.arange(ng * hd).float().unsqueeze(1)
    fused = hf.fuse_qkv(q, k, v, nh, ng).squeeze(1).tolist()
    expected = list(range(0, 6)) + [100, 101, 102] + [200, 201, 202] + list(range(6, 12)) + [103, 104, 105] + [203, 204, 205]
    assert fused == expected
    q2, k2, v2 = hf.split_qkv(hf.fuse_qkv(q, k, v, nh, ng), nh, ng)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_gpt2_training_steps_with_kept_cpu_logits_buffer(single_rank, monkeypatch):
    """The megatron-core head writes its logits into the kept CPU buffer (threshold lowered to 0 so the tiny model
    takes that path) and three SGD steps follow HF GPT-2's losses and gradients: the loss's in-place work in the
    buffer and its reuse across steps change nothing."""
    from megatron.core.tensor_parallel.layers import CpuOutputBuffer

    monkeypatch.setattr(CpuOutputBuffer, "min_bytes", 0)
    hf_cfg, hf_model = _hf_gpt2(vocab_size=96)
    hf_model.train()
    config = hf.gpt2_config_to_megatron(hf_cfg, make_vocab_size_divisible_by=32, use_cpu_initialization=True,
                                        hidden_dropout=0.0, attention_dropout=0.0)
    sd = hf.gpt2_hf_to_megatron(hf_model.state_dict(), hf_cfg, config.padded_vocab_size)
    core = CoreGPTModel(config, get_gpt_layer_local_spec(), config.padded_vocab_size, config.max_position_embeddings,
                        share_embeddings_and_output_weights=True).train()
    core.load_state_dict(keys.legacy_to_mcore(sd, "gpt"))
    hf_model.config.resid_pdrop = hf_model.config.embd_pdrop = hf_model.config.attn_pdrop = 0.0
    for m in hf_model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ids, pos, mask = _inputs(96)
    labels = torch.roll(ids, -1, dims=1)
    opt_ours = torch.optim.SGD(core.parameters(), lr=0.5)
    opt_hf = torch.optim.SGD(hf_model.parameters(), lr=0.5)
    pointers = []
    for _ in range(3):
        opt_ours.zero_grad()
        opt_hf.zero_grad()
        ours = core(ids, pos, mask, labels=labels)[:, :-1].mean()
        ours.backward()
        pointers.append(core.output_layer.output_buffer._storage.data_ptr())
        theirs = hf_model(ids, labels=ids).loss
        theirs.backward()
        assert abs(ours.item() - theirs.item()) <= 1e-5 * abs(theirs.item()), (ours.item(), theirs.item())
        g_ours = core.embedding.word_embeddings.weight.grad[:96]
        assert rel_err(g_ours, hf_model.transformer.wte.weight.grad) <= 1e-5
        opt_ours.step()
        opt_hf.step()
    assert len(set(pointers)) == 1, "the head did not keep its logits buffer between steps"
