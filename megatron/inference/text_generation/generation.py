"""The generation loops: sampling (greedy / top-k / top-p), scoring, beam search.

All ranks run the same loop. Each step feeds only the positions not yet in the KV cache; the last pipeline
stage samples from the full-vocabulary logits, TP rank 0's choice is kept, and the new tokens (and the
"everyone is done" flag) are broadcast over the pipeline group so that every stage feeds the same tokens next.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.fusions import causal_mask

from .communication import broadcast_from_last_pipeline_stage, broadcast_within_tensor_parallel_group
from .forward_step import ForwardStep
from .sampling import sample


def _attention_mask_and_position_ids(tokens: torch.Tensor):
    """The causal mask ``[1, 1, s, s]`` (bool, True = masked) and positions ``[b, s]`` of the padded batch."""
    seq = tokens.size(1)
    position_ids = torch.arange(seq, dtype=torch.long, device=tokens.device).unsqueeze(0).expand_as(tokens)
    return causal_mask(seq, seq, tokens.device), position_ids


def _check_length(max_length: int, max_position_embeddings: int):
    if max_length > max_position_embeddings:
        raise ValueError(f"Length of prompt + tokens_to_generate longer than allowed: {max_length} tokens, the model "
                         f"has {max_position_embeddings} positions (--max-position-embeddings)")


def _special_ids(tokenizer):
    """Ids of "\\n", "\\n\\n" and ":" in this vocabulary (GPT-2: 198, 628, 25), or -1 when not one token."""
    def one(text):
        try:
            ids = tokenizer.tokenize(text)
        except Exception:  # noqa: BLE001 - tokenizers without plain text support
            return -1
        return ids[0] if len(ids) == 1 else -1
    return one("\n"), one("\n\n"), one(":")


def score_and_return_on_first_stage(model, tokens, lengths, max_position_embeddings):
    """``tokens_to_generate == 0``: the log-probability of every prompt token given the ones before it."""
    batch_size, max_length = tokens.shape
    _check_length(max_length, max_position_embeddings)
    attention_mask, position_ids = _attention_mask_and_position_ids(tokens)
    forward_step = ForwardStep(model, batch_size, max_length)
    logits = forward_step(tokens, position_ids, attention_mask)
    output_log_probs = None
    if parallel_state.is_pipeline_last_stage():
        log_probs = F.log_softmax(logits, dim=2)
        output_log_probs = torch.gather(log_probs[:, :-1], 2, tokens[:, 1:].unsqueeze(2)).squeeze(2)
    output_log_probs = broadcast_from_last_pipeline_stage((batch_size, max_length - 1), torch.float32,
                                                          output_log_probs)
    return tokens, lengths, output_log_probs, None


def generate_tokens_probs_and_return_on_first_stage(
        model, tokens, lengths, return_output_log_probs=False, top_k=0, top_p=0.0, top_p_decay=0.0,
        top_p_bound=0.0, temperature=1.0, use_eod_token_for_early_termination=True, stop_on_double_eol=False,
        stop_on_eol=False, prevent_newline_after_colon=False, *, tokenizer, max_position_embeddings,
        use_cache=True):
    """Generate into the padding of ``tokens [b, max_len]`` (prompts of ``lengths`` tokens).

    Returns ``(tokens [b, L], generated_sequence_lengths [b], output_log_probs [b, L-1] or None, None)`` where
    ``L`` is one past the last position generated; a sequence's length stops after its end token.
    """
    batch_size, max_length = tokens.shape
    _check_length(max_length, max_position_embeddings)
    min_prompt_length = int(lengths.min().item())
    termination_id = tokenizer.eod
    newline_id, double_newline_id, colon_id = _special_ids(tokenizer)
    vocab_size = tokenizer.vocab_size
    forward_step = ForwardStep(model, batch_size, max_length, use_cache=use_cache)
    last_stage = parallel_state.is_pipeline_last_stage()
    tokens = tokens.clone()

    output_log_probs = None
    if last_stage and return_output_log_probs:
        output_log_probs = torch.zeros(batch_size, max_length - 1, dtype=torch.float32, device=tokens.device)
    generated_sequence_lengths = torch.full((batch_size,), max_length, dtype=torch.int64, device=tokens.device)
    is_generation_done = torch.zeros(batch_size, dtype=torch.bool, device=tokens.device)
    attention_mask, position_ids = _attention_mask_and_position_ids(tokens)

    prev_context_length = 0
    context_length = min_prompt_length
    for context_length in range(min_prompt_length, max_length):
        start = prev_context_length if use_cache else 0
        tokens2use = tokens[:, start:context_length]
        logits = forward_step(tokens2use, position_ids[:, start:context_length],
                              attention_mask[..., start:context_length, :context_length])
        started = lengths <= context_length  # rows whose prompt is exhausted: their token is generated
        if last_stage:
            if prevent_newline_after_colon and colon_id >= 0 and newline_id >= 0:
                logits[tokens2use[:, -1] == colon_id, -1, newline_id] = -1e10
            new_sample = sample(logits[:, -1, :], top_k=top_k, top_p=top_p, temperature=temperature,
                                vocab_size=vocab_size)
            new_sample = broadcast_within_tensor_parallel_group(new_sample.contiguous())
            if top_p > 0.0 and top_p_decay > 0.0:
                top_p = top_p * top_p_decay
                if top_p_bound > 0.0:
                    top_p = max(top_p, top_p_bound)
            tokens[started, context_length] = new_sample[started]
            if return_output_log_probs:
                # Log-probability of each actual next token (prompt or generated) of the positions fed now.
                log_probs = F.log_softmax(logits, dim=2)
                nxt = tokens[:, prev_context_length + 1:context_length + 1].unsqueeze(2)
                output_log_probs[:, prev_context_length:context_length] = torch.gather(
                    log_probs[:, prev_context_length - start:], 2, nxt).squeeze(2)
        tokens[:, context_length] = broadcast_from_last_pipeline_stage(
            batch_size, torch.int64, tokens[:, context_length] if last_stage else None)
        new_token = tokens[:, context_length]

        if stop_on_double_eol:
            done_token = ((new_token == double_newline_id)
                          | ((new_token == newline_id) & (tokens[:, context_length - 1] == newline_id)))
        elif stop_on_eol:
            done_token = (new_token == double_newline_id) | (new_token == newline_id)
        else:
            done_token = new_token == termination_id
        done_token = done_token & started
        just_finished = done_token & ~is_generation_done
        generated_sequence_lengths[just_finished] = context_length + 1
        is_generation_done |= done_token
        prev_context_length = context_length
        if use_eod_token_for_early_termination and bool(is_generation_done.all()):
            break

    tokens = tokens[:, :context_length + 1]
    if return_output_log_probs:
        if last_stage:
            output_log_probs = output_log_probs[:, :context_length].contiguous()
        output_log_probs = broadcast_from_last_pipeline_stage((batch_size, context_length), torch.float32,
                                                              output_log_probs)
    return tokens, generated_sequence_lengths, output_log_probs, None


class BeamHypotheses:
    """The ``num_beams`` best finished hypotheses, scored by sum of log-probs / length ** length_penalty."""

    def __init__(self, num_beams: int, length_penalty: float = 1.0, early_stopping: bool = False):
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.beams = []
        self.worst_score = 1e9

    def __len__(self):
        return len(self.beams)

    def add(self, hyp: torch.Tensor, sum_logprobs: float, length: int):
        score = float(sum_logprobs) / length ** self.length_penalty
        if len(self) < self.num_beams or score > self.worst_score:
            self.beams.append((score, hyp))
            if len(self) > self.num_beams:
                self.beams.sort(key=lambda x: x[0])
                del self.beams[0]
            self.worst_score = min(s for s, _ in self.beams)

    def is_done(self, best_sum_logprobs: float, cur_len: int) -> bool:
        """No running beam can beat the worst kept hypothesis any more."""
        if len(self) < self.num_beams:
            return False
        if self.early_stopping:
            return True
        return self.worst_score >= best_sum_logprobs / cur_len ** self.length_penalty


def beam_search_and_return_on_first_stage(model, tokens, lengths, beam_size, stop_token, num_return_gen,
                                          length_penalty, prevent_newline_after_colon=False, *, tokenizer,
                                          max_position_embeddings):
    """Beam search for one prompt; returns ``(tokens [n, L], scores [n])`` of the ``num_return_gen`` best."""
    if tokens.size(0) != 1:
        raise ValueError("When doing beam_search, batch size must be 1")
    prompt_length = int(lengths.item())
    final_length = tokens.size(1)
    _check_length(final_length, max_position_embeddings)
    newline_id, _, colon_id = _special_ids(tokenizer)
    last_stage = parallel_state.is_pipeline_last_stage()
    forward_step = ForwardStep(model, beam_size, final_length)
    hypotheses = BeamHypotheses(beam_size, length_penalty)
    tokens = tokens.repeat(beam_size, 1)
    scores = torch.zeros(beam_size, 1, dtype=torch.float32, device=tokens.device)
    attention_mask, position_ids = _attention_mask_and_position_ids(tokens)
    prev_context_length, done = 0, False
    context_length = prompt_length
    for context_length in range(prompt_length, final_length):
        tokens2use = tokens[:, prev_context_length:context_length]
        logits = forward_step(tokens2use, position_ids[:, prev_context_length:context_length],
                              attention_mask[..., prev_context_length:context_length, :context_length])
        best_batches = None
        if last_stage:
            if prevent_newline_after_colon and colon_id >= 0 and newline_id >= 0:
                logits[tokens2use[:, -1] == colon_id, -1, newline_id] = -1e10
            logits = logits[:, -1, :tokenizer.vocab_size]
            vocab_size = logits.size(1)
            new_scores = F.log_softmax(logits, dim=1) + scores
            # At the first step every beam holds the same prompt: expand from beam 0 only.
            flat = new_scores[0] if context_length == prompt_length else new_scores.view(-1)
            sorted_scores, indices = torch.sort(flat, descending=True)
            candidates = zip(indices[:2 * beam_size].tolist(), sorted_scores[:2 * beam_size].tolist())
            next_beams = []
            for rank_in_step, (index, beam_score) in enumerate(candidates):
                beam_id, token_id = index // vocab_size, index % vocab_size
                if token_id == stop_token:
                    if rank_in_step < num_return_gen:
                        hypotheses.add(tokens[beam_id].clone(), beam_score, context_length + 1 - prompt_length)
                else:
                    next_beams.append((token_id, beam_score, beam_id))
                if len(next_beams) == beam_size:
                    break
            done = hypotheses.is_done(sorted_scores.max().item(), context_length + 1 - prompt_length)
            best_batches = torch.tensor([b for _, _, b in next_beams], dtype=torch.int64, device=tokens.device)
            tokens = tokens[best_batches]
            tokens[:, context_length] = torch.tensor([t for t, _, _ in next_beams], device=tokens.device)
            scores = torch.tensor([s for _, s, _ in next_beams], device=tokens.device).unsqueeze(1)
        done = bool(broadcast_from_last_pipeline_stage(1, torch.uint8,
                                                       torch.tensor([done], dtype=torch.uint8) if last_stage
                                                       else None).item())
        if done:
            break
        tokens = broadcast_from_last_pipeline_stage(tokens.shape, torch.int64, tokens if last_stage else None)
        best_batches = broadcast_from_last_pipeline_stage(beam_size, torch.int64, best_batches)
        forward_step.inference_params.swap_key_value_dict(best_batches)
        prev_context_length = context_length

    out_tokens = out_scores = None
    if last_stage:
        if not done:
            for beam_id in range(beam_size):
                hypotheses.add(tokens[beam_id].clone(), scores[beam_id].item(), context_length + 1 - prompt_length)
        ranked = sorted(hypotheses.beams, key=lambda x: x[0], reverse=True)[:min(num_return_gen, len(hypotheses))]
        out_scores = torch.tensor([s for s, _ in ranked], dtype=torch.float32, device=tokens.device)
        out_tokens = torch.stack([t for _, t in ranked])
        sizes = torch.tensor(list(out_tokens.shape), dtype=torch.int64)
    sizes = broadcast_from_last_pipeline_stage(2, torch.int64, sizes if last_stage else None).tolist()
    out_tokens = broadcast_from_last_pipeline_stage(sizes, torch.int64, out_tokens)
    out_scores = broadcast_from_last_pipeline_stage(sizes[0], torch.float32, out_scores)
    return out_tokens, out_scores
