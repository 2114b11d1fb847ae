"""Helpers to run ``pretrain`` for a few iterations inside dist_harness ranks and record what it logs.

Every parameter is re-initialised from a generator keyed by its *global* name (layer indices shifted by the
pipeline offset) and sliced for this TP rank, so every (TP, PP, DP) layout starts from the same model; the
layout-independent losses are then the test.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import zlib

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GPT_ARGS = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", "20", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "2", "--weight-decay", "0.01", "--clip-grad", "1.0",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--seed", "1234",
    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(REPO, "data/tokenizers/gpt2/vocab.json"),
    "--merge-file", os.path.join(REPO, "data/tokenizers/gpt2/merges.txt"), "--split", "98,1,1", "--eval-iters", "1", "--eval-interval", "1000", "--log-interval", "5",
    "--distributed-backend", "gloo", "--num-workers", "0",
    # The tests written for the legacy one-file-per-rank layout keep it; torch_dist tests pass --ckpt-format torch_dist.
    "--ckpt-format", "torch",
]


def preprocess_corpus_slice(out_dir, num_docs=400, tokenizer="gpt2"):
    """Tokenise the first ``num_docs`` documents of the shipped corpus; return the dataset prefix."""
    import gzip
    import subprocess

    src = os.path.join(REPO, "data", "stdlib_prose.jsonl.gz")
    jsonl = os.path.join(out_dir, "slice.jsonl")
    with gzip.open(src, "rt") as f, open(jsonl, "w") as out:
        for i, line in enumerate(f):
            if i >= num_docs:
                break
            out.write(line)
    if tokenizer == "gpt2":
        tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(REPO, "data/tokenizers/gpt2/vocab.json"),
               "--merge-file", os.path.join(REPO, "data/tokenizers/gpt2/merges.txt"), "--append-eod"]
        suffix = "_text_document"
    else:
        tok = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
               os.path.join(REPO, "data/tokenizers/bert/vocab.txt"), "--split-sentences"]
        suffix = "_text_sentence"
    prefix = os.path.join(out_dir, tokenizer)
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", jsonl,
                    "--output-prefix", prefix, "--workers", "1", *tok], check=True, capture_output=True)
    return prefix + suffix


def load_entry_point(name):
    """Import pretrain_gpt.py / pretrain_bert.py from the repository root as a module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _global_name(name: str, layer_offset: int, tied: bool = False) -> str:
    if name.startswith("word_embeddings."):  # legacy model: the last stage's tied copy of the input embedding
        name = "language_model.embedding." + name
    if tied and name == "output_layer.weight":  # megatron-core model: the tied output layer is the embedding
        name = "embedding.word_embeddings.weight"
    return re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + layer_offset}.", name)


_GATED_FC1 = ("linear_fc1.weight", "linear_fc1.bias", "dense_h_to_4h.weight", "dense_h_to_4h.bias")


def deterministic_init(model, num_layers):
    """Give every parameter a value that depends only on its global name and this rank's TP slice."""
    from megatron.core import parallel_state as ps

    pp, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    per_stage = num_layers // pp
    if vpp is None:
        offset = r * per_stage
    else:
        per_virtual = per_stage // vpp
        offset = ps.get_virtual_pipeline_model_parallel_rank() * (num_layers // vpp) + r * per_virtual
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
    gated = bool(getattr(getattr(model, "config", None), "gated_linear_unit", False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if getattr(p, "is_expert", False):
                continue  # experts: deterministic_expert_init (global expert index, expert-TP slices)
            gname = _global_name(name, offset, tied)
            shape = list(p.shape)
            dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
            if dim >= 0:
                shape[dim] *= tp
            g = torch.Generator().manual_seed(zlib.crc32(gname.encode()))
            full = torch.randn(shape, generator=g) * 0.02
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                full = 1.0 + 10 * full
            if dim == 0 and gated and name.endswith(_GATED_FC1):
                # A gated fc1 is [gate; up]: each TP rank holds [gate_r; up_r] (megatron.core's swiglu split).
                gate, up = full.chunk(2, dim=0)
                full = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
            elif dim >= 0:
                full = full.chunk(tp, dim=dim)[tp_rank]
            p.copy_(full.to(p.dtype))
    deterministic_expert_init(model, offset)


def _expert_full(gname: str, shape):
    g = torch.Generator().manual_seed(zlib.crc32(gname.encode()))
    return torch.randn(shape, generator=g) * 0.02


def deterministic_expert_init(model, layer_offset: int):
    """Experts from a generator keyed by (global layer, global expert): fc1 ``[rows, h]``, fc2 ``[h, F]``, this
    rank's expert-TP slices ([gate_r; up_r] rows for gated units), so every EP/ETP layout and both SequentialMLP
    and GroupedMLP hold the same model."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP

    etp, etp_rank = ps.get_expert_tensor_parallel_world_size() or 1, ps.get_expert_tensor_parallel_rank() or 0
    for name, module in model.named_modules():
        if not isinstance(module, (SequentialMLP, GroupedMLP)):
            continue
        cfg = module.config
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1)) + layer_offset
        ffn, h = cfg.moe_ffn_hidden_size, cfg.hidden_size
        rows = 2 * ffn if cfg.gated_linear_unit else ffn
        shard = ffn // etp
        ep_rank, n = ps.get_expert_model_parallel_rank() or 0, module.num_local_experts
        fc1s, fc2s = [], []
        for j in range(n):
            e = ep_rank * n + j
            fc1 = _expert_full(f"layers.{layer}.experts.{e}.fc1", [rows, h])
            fc2 = _expert_full(f"layers.{layer}.experts.{e}.fc2", [h, ffn])
            parts = [fc1[etp_rank * shard:(etp_rank + 1) * shard]]
            if cfg.gated_linear_unit:
                parts.append(fc1[ffn + etp_rank * shard:ffn + (etp_rank + 1) * shard])
            fc1s.append(torch.cat(parts))
            fc2s.append(fc2[:, etp_rank * shard:(etp_rank + 1) * shard])
        with torch.no_grad():
            if isinstance(module, SequentialMLP):
                for expert, w1, w2 in zip(module.local_experts, fc1s, fc2s):
                    expert.linear_fc1.weight.copy_(w1)
                    expert.linear_fc2.weight.copy_(w2)
            else:
                module.weight1.copy_(torch.cat([w.t() for w in fc1s], dim=1))
                module.weight2.copy_(torch.cat([w.t() for w in fc2s], dim=0))


def run_pretrain(entry: str, extra_args, record_model=False, extra_args_provider=None, deterministic=True):
    """Run ``pretrain`` of ``entry`` with GPT_ARGS + extra_args (and the entry point's ``extra_args_provider``, e.g.
    the ModelOpt flags); return the per-iteration records.

    ``deterministic=False`` keeps the model's own initialisation from ``--seed`` (as ``pretrain_gpt.py`` run as a
    script), instead of the layout-independent one of :func:`deterministic_init`."""
    from megatron.core import parallel_state as ps
    from megatron.training import global_vars
    from megatron.training import training as training_mod

    module = load_entry_point(entry)
    records = []
    original_log = training_mod.training_log

    def recording_log(state, loss_dict, learning_rate, iteration, loss_scale, skipped_iter, grad_norm, *rest):
        records.append({"iteration": iteration, "loss": {k: float(v) for k, v in loss_dict.items()},
                        "lr": learning_rate, "loss_scale": float(loss_scale), "skipped": skipped_iter,
                        "grad_norm": grad_norm})
        line = original_log(state, loss_dict, learning_rate, iteration, loss_scale, skipped_iter, grad_norm, *rest)
        if line is not None:
            records[-1]["line"] = line
        return line

    argv_all = GPT_ARGS + list(extra_args)  # argparse keeps the last --num-layers: so do the pipeline offsets
    num_layers = int(argv_all[len(argv_all) - 1 - argv_all[::-1].index("--num-layers") + 1])
    original_provider = module.model_provider

    def provider(pre_process=True, post_process=True):
        model = original_provider(pre_process=pre_process, post_process=post_process)
        if deterministic:
            deterministic_init(model, num_layers)
        return model

    training_mod.training_log = recording_log
    argv = sys.argv
    sys.argv = [f"{entry}.py"] + GPT_ARGS + list(extra_args)
    try:
        module.pretrain(module.train_valid_test_datasets_provider, provider, module.ModelType.encoder_or_decoder,
                        module.forward_step, extra_args_provider=extra_args_provider, args_defaults={})
    finally:
        sys.argv = argv
        training_mod.training_log = original_log
        global_vars.destroy_global_vars()
        ps.destroy_model_parallel()
    return records
