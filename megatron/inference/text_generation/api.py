"""Megatron's generation API: ``generate_and_post_process`` and ``beam_search_and_post_process``.

Rank 0 passes the prompts and settings; every other rank calls the same function with no arguments (the REST
server's followers do) and receives them by broadcast. Results are returned on the first pipeline stage (None
elsewhere), as in Megatron.
"""
from __future__ import annotations

import torch

from megatron.core import device, parallel_state

from .communication import broadcast_float_list
from .generation import (beam_search_and_return_on_first_stage, generate_tokens_probs_and_return_on_first_stage,
                         score_and_return_on_first_stage)
from .tokenization import detokenize_generations, tokenize_prompts


def _context():
    from megatron.training import get_args, get_tokenizer

    return get_tokenizer(), get_args().max_position_embeddings


def _seed(random_seed: int):
    if random_seed != -1:
        torch.random.manual_seed(random_seed)
        device.manual_seed(random_seed)


def generate_and_post_process(model, prompts=None, tokens_to_generate=0, return_output_log_probs=False,
                              top_k_sampling=0, top_p_sampling=0.0, top_p_decay=0.0, top_p_bound=0.0,
                              temperature=1.0, add_BOS=False, use_eod_token_for_early_termination=True,
                              stop_on_double_eol=False, stop_on_eol=False, prevent_newline_after_colon=False,
                              random_seed=-1):
    """Generate and detokenise. On the first stage returns ``(prompts_plus_generations, segments,
    output_log_probs (a list per prompt, or None), tokens)``; None on other stages."""
    tokens, lengths, output_log_probs, _ = generate(
        model, prompts=prompts, tokens_to_generate=tokens_to_generate,
        return_output_log_probs=return_output_log_probs, top_k_sampling=top_k_sampling,
        top_p_sampling=top_p_sampling, top_p_decay=top_p_decay, top_p_bound=top_p_bound, temperature=temperature,
        add_BOS=add_BOS, use_eod_token_for_early_termination=use_eod_token_for_early_termination,
        stop_on_double_eol=stop_on_double_eol, stop_on_eol=stop_on_eol,
        prevent_newline_after_colon=prevent_newline_after_colon, random_seed=random_seed)
    if not parallel_state.is_pipeline_first_stage():
        return None
    tokens, prompts_plus_generations, segments = detokenize_generations(tokens, lengths, True)
    if return_output_log_probs:
        output_log_probs = output_log_probs.cpu().tolist()
        output_log_probs = [probs[:len(seg) - 1] for probs, seg in zip(output_log_probs, segments)]
    return prompts_plus_generations, segments, output_log_probs, tokens


def generate(model, prompts=None, tokens_to_generate=0, return_output_log_probs=False, top_k_sampling=0,
             top_p_sampling=0.0, top_p_decay=0.0, top_p_bound=0.0, temperature=1.0, add_BOS=False,
             use_eod_token_for_early_termination=True, stop_on_double_eol=False, stop_on_eol=False,
             prevent_newline_after_colon=False, random_seed=-1, use_cache=True):
    """Token-level generation: ``(tokens, lengths, output_log_probs, None)`` on every rank."""
    values = [tokens_to_generate, return_output_log_probs, top_k_sampling, top_p_sampling, top_p_decay,
              top_p_bound, temperature, add_BOS, use_eod_token_for_early_termination, stop_on_double_eol,
              stop_on_eol, prevent_newline_after_colon, random_seed]
    values = broadcast_float_list(len(values), [float(v) for v in values]).tolist()
    tokens_to_generate = int(values[0])
    return_output_log_probs = bool(values[1])
    top_k_sampling, top_p_sampling, top_p_decay, top_p_bound = int(values[2]), values[3], values[4], values[5]
    temperature, add_BOS, use_eod = values[6], bool(values[7]), bool(values[8])
    stop_on_double_eol, stop_on_eol, prevent_newline_after_colon = bool(values[9]), bool(values[10]), bool(values[11])
    random_seed = int(values[12])
    _seed(random_seed)

    tokenizer, max_position_embeddings = _context()
    tokens, lengths = tokenize_prompts(prompts=prompts, tokens_to_generate=tokens_to_generate, add_BOS=add_BOS)
    if tokens_to_generate == 0:
        return score_and_return_on_first_stage(model, tokens, lengths, max_position_embeddings)
    return generate_tokens_probs_and_return_on_first_stage(
        model, tokens, lengths, return_output_log_probs=return_output_log_probs, top_k=top_k_sampling,
        top_p=top_p_sampling, top_p_decay=top_p_decay, top_p_bound=top_p_bound, temperature=temperature,
        use_eod_token_for_early_termination=use_eod, stop_on_double_eol=stop_on_double_eol,
        stop_on_eol=stop_on_eol, prevent_newline_after_colon=prevent_newline_after_colon, tokenizer=tokenizer,
        max_position_embeddings=max_position_embeddings, use_cache=use_cache)


def beam_search_and_post_process(model, prompts=None, tokens_to_generate=0, beam_size=0, add_BOS=False,
                                 stop_token=50256, num_return_gen=1, length_penalty=1,
                                 prevent_newline_after_colon=False):
    """Beam search and detokenise. On the first stage returns ``(prompts_plus_generations, segments, scores)``."""
    tokens, scores = beam_search(model, prompts=prompts, tokens_to_generate=tokens_to_generate, beam_size=beam_size,
                                 add_BOS=add_BOS, stop_token=stop_token, num_return_gen=num_return_gen,
                                 length_penalty=length_penalty, prevent_newline_after_colon=prevent_newline_after_colon)
    if not parallel_state.is_pipeline_first_stage():
        return None
    lengths = torch.full((tokens.size(0),), tokens.size(1), dtype=torch.int64)
    tokens, prompts_plus_generations, segments = detokenize_generations(tokens, lengths, True)
    return prompts_plus_generations, segments, scores.cpu().tolist()


def beam_search(model, prompts=None, tokens_to_generate=0, beam_size=0, add_BOS=False, stop_token=50256,
                num_return_gen=1, length_penalty=1, prevent_newline_after_colon=False):
    values = [tokens_to_generate, beam_size, add_BOS, stop_token, num_return_gen, length_penalty,
              prevent_newline_after_colon]
    values = broadcast_float_list(len(values), [float(v) for v in values]).tolist()
    tokens_to_generate, beam_size, add_BOS = int(values[0]), int(values[1]), bool(values[2])
    stop_token, num_return_gen, length_penalty = int(values[3]), int(values[4]), values[5]
    prevent_newline_after_colon = bool(values[6])
    if beam_size < 1:
        raise ValueError("beam_size must be an integer greater than or equal to 1")
    tokenizer, max_position_embeddings = _context()
    tokens, lengths = tokenize_prompts(prompts=prompts, tokens_to_generate=tokens_to_generate, add_BOS=add_BOS)
    return beam_search_and_return_on_first_stage(
        model, tokens, lengths, beam_size, stop_token, num_return_gen, length_penalty,
        prevent_newline_after_colon, tokenizer=tokenizer, max_position_embeddings=max_position_embeddings)
