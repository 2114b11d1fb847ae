"""Megatron's REST text-generation server (Flask): ``PUT /api`` and a small web page at ``/``.

Rank 0 serves HTTP. For every accepted request it broadcasts a command (GENERATE or BEAM_SEARCH) and then
calls the generation API with the request; the other ranks wait in ``follower_loop`` for the command and call
the same API with no arguments, receiving prompts and settings by broadcast. Requests are validated on rank 0
before anything is broadcast, so a bad request is answered with HTTP 400 and never reaches the other ranks.
"""
from __future__ import annotations

import os
import threading

import torch

from megatron.core import device
from megatron.inference.text_generation import beam_search_and_post_process, generate_and_post_process

GENERATE_NUM = 0
BEAM_NUM = 1
STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
MAX_PROMPTS = 128


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400 and this message."""


def _broadcast_command(command: int) -> int:
    choice = torch.tensor([command], dtype=torch.int64, device=device.current_device())
    torch.distributed.broadcast(choice, 0)
    return int(choice.item())


def send_do_generate():
    _broadcast_command(GENERATE_NUM)


def send_do_beam_search():
    _broadcast_command(BEAM_NUM)


def follower_loop(model):
    """Ranks other than 0: run whatever generation rank 0 announces, forever."""
    while True:
        choice = _broadcast_command(-1)
        try:
            if choice == GENERATE_NUM:
                generate_and_post_process(model)
            elif choice == BEAM_NUM:
                beam_search_and_post_process(model)
        except ValueError:
            # Every rank raises the same error at the same point (after the same broadcasts): rank 0 answers 400.
            pass


def _get(req, name, kinds, default, check=None, message=None):
    if name not in req:
        return default
    value = req[name]
    if isinstance(value, bool) and bool not in kinds:  # JSON true is not an integer here
        raise BadRequest(message)
    if not isinstance(value, kinds) or (check is not None and not check(value)):
        raise BadRequest(message)
    return value


def parse_request(req, defaults, tokenizer=None, max_position_embeddings=None):
    """Validate a ``PUT /api`` body with Megatron's fields and messages; return the generation arguments."""
    if not isinstance(req, dict):
        raise BadRequest("request body must be a JSON object with a \"prompts\" list")
    if "prompts" not in req:
        raise BadRequest("prompts argument required")
    if "max_len" in req:
        raise BadRequest("max_len is no longer used.  Replace with tokens_to_generate")
    if "sentences" in req:
        raise BadRequest("sentences is no longer used.  Replace with prompts")
    prompts = req["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("prompts is not a list of strings")
    if len(prompts) == 0:
        raise BadRequest("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"Maximum number of prompts is {MAX_PROMPTS}")

    out = {"prompts": prompts}
    out["tokens_to_generate"] = _get(req, "tokens_to_generate", (int,), defaults.get("tokens_to_generate", 64),
                                     lambda v: v >= 0,
                                     "tokens_to_generate must be an integer greater than or equal to 0")
    out["logprobs"] = _get(req, "logprobs", (bool,), False, None, "logprobs must be a boolean value")
    if out["tokens_to_generate"] == 0 and not out["logprobs"]:
        raise BadRequest("tokens_to_generate=0 implies logprobs should be True")
    out["temperature"] = _get(req, "temperature", (int, float), defaults.get("temperature", 1.0),
                              lambda v: 0.0 < v <= 100.0,
                              "temperature must be a positive number less than or equal to 100.0")
    out["top_k"] = _get(req, "top_k", (int,), defaults.get("top_k", 0), lambda v: 0 <= v <= 1000,
                        "top_k must be equal to or greater than 0 and less than or equal to 1000")
    out["top_p"] = _get(req, "top_p", (int, float), defaults.get("top_p", 0.0), lambda v: 0.0 <= v <= 1.0,
                        "top_p must be less than or equal to 1.0")
    if out["top_p"] > 0.0 and out["top_k"] > 0:
        raise BadRequest("cannot set both top-k and top-p samplings.")
    out["top_p_decay"] = _get(req, "top_p_decay", (int, float), 0.0, lambda v: 0.0 <= v <= 1.0,
                              "top_p_decay must be less than or equal to 1.0")
    if out["top_p_decay"] > 0.0 and out["top_p"] == 0.0:
        raise BadRequest("top_p_decay cannot be set without top_p")
    out["top_p_bound"] = _get(req, "top_p_bound", (int, float), 0.0, lambda v: 0.0 <= v <= 1.0,
                              "top_p_bound must be a float in [0, 1]")
    if out["top_p_bound"] > 0.0 and out["top_p_bound"] > out["top_p"]:
        raise BadRequest("top_p_bound should be greater than 0.0 and less than top_p")
    out["add_BOS"] = _get(req, "add_BOS", (bool,), False, None, "add_BOS must be a boolean value")
    if any(len(p) == 0 for p in prompts) and not out["add_BOS"]:
        raise BadRequest("Empty prompts require add_BOS=true")
    for flag in ("stop_on_double_eol", "stop_on_eol", "prevent_newline_after_colon", "no_log"):
        out[flag] = _get(req, flag, (bool,), False, None, f"{flag} must be a boolean value")
    out["random_seed"] = _get(req, "random_seed", (int,), -1, lambda v: v >= -1,
                              "random_seed must be a positive integer")
    out["beam_width"] = _get(req, "beam_width", (int,), None, lambda v: v >= 1,
                             "beam_width must be an integer > 0")
    if out["beam_width"] is not None and len(prompts) > 1:
        raise BadRequest("When doing beam_search, batch size must be 1")
    out["stop_token"] = _get(req, "stop_token", (int,), 50256, None, "stop_token must be an integer")
    out["length_penalty"] = _get(req, "length_penalty", (int, float), 1, None, "length_penalty must be a float")

    if tokenizer is not None and max_position_embeddings is not None:
        # Checked here so that the other ranks never start a request that cannot run.
        longest = max(len(tokenizer.tokenize(p)) + int(out["add_BOS"]) for p in prompts)
        if longest + out["tokens_to_generate"] > max_position_embeddings:
            raise BadRequest(f"Length of prompt + tokens_to_generate longer than allowed: {longest} prompt tokens "
                             f"+ {out['tokens_to_generate']} > {max_position_embeddings} positions")
    return out


def run_request(model, r):
    """Run a validated request on all ranks (call on rank 0); returns the response dictionary."""
    if r["beam_width"] is not None:
        send_do_beam_search()
        text, segments, scores = beam_search_and_post_process(
            model, prompts=r["prompts"], tokens_to_generate=r["tokens_to_generate"], beam_size=r["beam_width"],
            add_BOS=r["add_BOS"], stop_token=r["stop_token"], num_return_gen=r["beam_width"],
            length_penalty=r["length_penalty"], prevent_newline_after_colon=r["prevent_newline_after_colon"])
        return {"text": text, "segments": segments, "scores": scores}
    send_do_generate()
    text, segments, logprobs, _ = generate_and_post_process(
        model, prompts=r["prompts"], tokens_to_generate=r["tokens_to_generate"], return_output_log_probs=r["logprobs"],
        top_k_sampling=r["top_k"], top_p_sampling=r["top_p"], top_p_decay=r["top_p_decay"],
        top_p_bound=r["top_p_bound"], temperature=r["temperature"], add_BOS=r["add_BOS"],
        use_eod_token_for_early_termination=True, stop_on_double_eol=r["stop_on_double_eol"],
        stop_on_eol=r["stop_on_eol"], prevent_newline_after_colon=r["prevent_newline_after_colon"],
        random_seed=r["random_seed"])
    return {"text": text, "segments": segments, "logprobs": logprobs}


class MegatronServer:
    """``MegatronServer(model, defaults=None)``; ``run(url, port)`` serves until the process ends."""

    def __init__(self, model, defaults=None, tokenizer=None, max_position_embeddings=None):
        try:
            from flask import Flask, jsonify, request, send_from_directory
        except ImportError as e:
            raise ImportError("the text generation server needs Flask: pip install flask "
                              "(or install this package with the [test] extra)") from e
        self.model = model
        self.lock = threading.Lock()
        defaults = dict(defaults or {})
        self.app = app = Flask(__name__, static_folder=None)

        @app.route("/", methods=["GET"])
        def index():
            return send_from_directory(STATIC_DIR, "index.html")

        @app.route("/api", methods=["PUT"])
        def api():
            req = request.get_json(silent=True)
            if req is None:
                return "request body must be JSON (Content-Type: application/json) with a \"prompts\" list", 400
            try:
                parsed = parse_request(req, defaults, tokenizer, max_position_embeddings)
            except BadRequest as e:
                return str(e), 400
            with self.lock:  # one generation at a time: every rank must run the same request
                if not parsed["no_log"]:
                    print("request IP: " + str(request.remote_addr), flush=True)
                    print(req, flush=True)
                try:
                    return jsonify(run_request(self.model, parsed))
                except ValueError as e:
                    return str(e), 400

    def run(self, url, port):
        self.app.run(url, threaded=True, debug=False, port=port)
