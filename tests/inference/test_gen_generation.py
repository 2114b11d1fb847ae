"""Text generation against references computed by hand from the model's full-sequence logits (no KV cache).

One spawned run per layout: TP=1 (all the reference checks), TP=2 and PP=2 (same weights: the tokens and
log-probabilities must equal TP=1's).
"""
import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.gen_helpers import PROMPTS, build_tiny_gpt, full_logits

NEW_TOKENS = 12


def _hand_greedy(model, prompt_ids, total_len, vocab_size):
    tokens = torch.tensor([prompt_ids])
    while tokens.size(1) < total_len:
        nxt = full_logits(model, tokens)[0, -1, :vocab_size].argmax()
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    return tokens[0]


def _reference_log_probs(model, tokens):
    log_probs = torch.log_softmax(full_logits(model, tokens), dim=2)
    return torch.gather(log_probs[:, :-1], 2, tokens[:, 1:].unsqueeze(2)).squeeze(2)


def _greedy(model, **kw):
    from megatron.inference.text_generation import generate

    return generate(model, prompts=PROMPTS, tokens_to_generate=NEW_TOKENS, return_output_log_probs=True,
                    top_k_sampling=1, use_eod_token_for_early_termination=False, **kw)


def tp1_body():
    from megatron.inference.text_generation import beam_search, generate, generate_and_post_process
    from megatron.training import get_tokenizer

    model = build_tiny_gpt()
    tok = get_tokenizer()
    out = {}
    tokens, lengths, log_probs, _ = _greedy(model)
    out["tokens"], out["log_probs"] = tokens, log_probs

    # 1. Greedy = argmax decoding by hand, each prompt alone, full forward at every step.
    for i, prompt in enumerate(PROMPTS):
        ref = _hand_greedy(model, tok.tokenize(prompt), tokens.size(1), tok.vocab_size)
        assert torch.equal(tokens[i], ref), (i, tokens[i].tolist(), ref.tolist())
    # 2. Log-probabilities of every next token (prompt and generated) = log_softmax of the full logits.
    ref_lp = _reference_log_probs(model, tokens)
    assert torch.allclose(log_probs, ref_lp, atol=1e-4), (log_probs - ref_lp).abs().max()

    # 3. KV cache = recomputing the whole prefix at every step.
    tokens_nc, _, log_probs_nc, _ = _greedy(model, use_cache=False)
    assert torch.equal(tokens_nc, tokens)
    assert torch.allclose(log_probs_nc, log_probs, atol=1e-5)

    # 4. Post-processing: Megatron's (texts, segments, logprobs, tokens).
    texts, segments, lp_lists, token_lists = generate_and_post_process(
        model, prompts=PROMPTS, tokens_to_generate=NEW_TOKENS, return_output_log_probs=True, top_k_sampling=1,
        use_eod_token_for_early_termination=False)
    for i in range(len(PROMPTS)):
        assert texts[i] == tok.detokenize(tokens[i].tolist()) and texts[i].startswith(PROMPTS[i])
        assert "".join(segments[i]) == texts[i] and len(segments[i]) == len(token_lists[i])
        assert len(lp_lists[i]) == len(segments[i]) - 1

    # 5. Top-k sampling: every sampled token is among the k best of its position; a seed reproduces it.
    k = 5
    sampled = [generate(model, prompts=PROMPTS, tokens_to_generate=NEW_TOKENS, top_k_sampling=k, temperature=0.7,
                        use_eod_token_for_early_termination=False, random_seed=7)[0] for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])
    logits = full_logits(model, sampled[0])[..., :tok.vocab_size]
    lens = [len(tok.tokenize(p)) for p in PROMPTS]
    for i in range(len(PROMPTS)):
        for t in range(lens[i], sampled[0].size(1)):
            top = logits[i, t - 1].topk(k).indices
            assert sampled[0][i, t] in top, (i, t)
    other_seed = generate(model, prompts=PROMPTS, tokens_to_generate=NEW_TOKENS, top_k_sampling=k,
                          temperature=5.0, use_eod_token_for_early_termination=False, random_seed=8)[0]
    assert not torch.equal(other_seed, sampled[0])
    # Top-p so small that only the best token survives = greedy.
    nucleus = generate(model, prompts=PROMPTS, tokens_to_generate=NEW_TOKENS, top_p_sampling=1e-6,
                       use_eod_token_for_early_termination=False, random_seed=3)[0]
    assert torch.equal(nucleus, tokens)

    # 6. tokens_to_generate=0 scores the prompts.
    score_tokens, _, score_lp, _ = generate(model, prompts=PROMPTS[:1], tokens_to_generate=0,
                                            return_output_log_probs=True)
    assert torch.allclose(score_lp, _reference_log_probs(model, score_tokens), atol=1e-4)

    # 7. Beam search: width 1 is greedy; width 3 returns 3 hypotheses sorted by their mean log-probability,
    # which equals the reference log-probabilities of their generated tokens.
    beam1, _ = beam_search(model, prompts=PROMPTS[:1], tokens_to_generate=NEW_TOKENS, beam_size=1, stop_token=-1)
    greedy_len = len(tok.tokenize(PROMPTS[0])) + NEW_TOKENS
    assert torch.equal(beam1[0], tokens[0, :greedy_len])
    beams, scores = beam_search(model, prompts=PROMPTS[:1], tokens_to_generate=NEW_TOKENS, beam_size=3,
                                stop_token=-1, num_return_gen=3)
    assert beams.shape == (3, greedy_len) and torch.all(scores[:-1] >= scores[1:])
    ref_scores = _reference_log_probs(model, beams)[:, -NEW_TOKENS:].sum(1) / NEW_TOKENS
    assert torch.allclose(scores, ref_scores, atol=1e-4), (scores, ref_scores)
    assert scores[0] >= ref_scores.new_tensor(_reference_log_probs(model, tokens[:1, :greedy_len])[0, -NEW_TOKENS:]
                                              .sum() / NEW_TOKENS) - 1e-5
    out["beams"], out["scores"] = beams, scores
    return out


def parallel_body(tp, pp):
    from megatron.core import parallel_state
    from megatron.inference.text_generation import beam_search, generate_and_post_process

    model = build_tiny_gpt(tp=tp, pp=pp)
    tokens, _, log_probs, _ = _greedy(model)
    beams, scores = beam_search(model, prompts=PROMPTS[:1], tokens_to_generate=NEW_TOKENS, beam_size=3,
                                stop_token=-1, num_return_gen=3)
    result = generate_and_post_process(model, prompts=PROMPTS, tokens_to_generate=4, top_k_sampling=1)
    assert (result is not None) == parallel_state.is_pipeline_first_stage()
    return {"tokens": tokens, "log_probs": log_probs, "beams": beams, "scores": scores}


@pytest.fixture(scope="module")
def tp1():
    return run_distributed(tp1_body, 1, timeout=120)[0]


def test_gen_greedy_cache_sampling_beam_against_hand_decoding(tp1):
    assert tp1["tokens"].shape[1] > NEW_TOKENS


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_gen_parallel_layouts_match_tp1(tp1, tp, pp):
    results = run_distributed(parallel_body, tp * pp, tp, pp, timeout=120)
    for rank, res in enumerate(results):
        assert torch.equal(res["tokens"], tp1["tokens"]), rank
        assert torch.allclose(res["log_probs"], tp1["log_probs"], atol=1e-4), rank
        assert torch.equal(res["beams"], tp1["beams"]), rank
        assert torch.allclose(res["scores"], tp1["scores"], atol=1e-4), rank
