"""Read and write Megatron's legacy ``torch`` checkpoints as one full (TP=1, PP=1) model state dict.

The full state dict uses the legacy model's flat key names with *global* layer numbers; the last pipeline stage's
tied embedding copy (``word_embeddings_for_head``) is dropped on read (it must equal the input embedding) and
re-created on write. Tensor-parallel split/merge rules (fused QKV per query group, swiglu halves, row/column
dims) are those of :mod:`megatron.core.models.conversion.tp`.
"""
from __future__ import annotations

import copy
import os
import re
from typing import Dict, Tuple

import torch

from megatron.core.models.conversion.tp import merge_tensor_parallel, split_tensor_parallel
from megatron.core.transformer.module import flatten_checkpoint_state_dict
from megatron.tokenizer.vocab_padding import vocab_size_with_padding

CHECKPOINT_VERSION = 3.0
# Heads of the legacy BERT / classifier models, each saved as its own nested entry (Megatron's layout).
_LEGACY_HEADS = ("lm_head", "binary_head", "classification_head", "multichoice_head")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
LAYER = re.compile(r"^(.*?layers\.)(\d+)(\..*)$")
_EMBEDDING_PREFIXES = ("language_model.embedding.", "embedding.")
WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
VOCAB_KEYS = (WORD_EMBEDDINGS, "language_model.output_layer.weight", "lm_head.bias", "embedding.word_embeddings.weight",
              "output_layer.weight", "output_layer.bias", "lm_head.output_layer.bias")
# megatron-core T5Model's second names of embedding.position_embeddings / lm_head.output_layer (not stored twice).
_T5_ALIASES = ("position_embeddings.", "output_layer.")


def is_t5(full) -> bool:
    """An encoder-decoder (T5) state dict: its decoder layers have cross-attention."""
    return any(".inter_attention." in k or ".cross_attention." in k for k in full)


def stack_layer_counts(args, full) -> Dict[str, int]:
    """{layer-key prefix: layer count}: T5's encoder has --num-layers layers, its decoder --decoder-num-layers
    (default --num-layers); other models have one stack of --num-layers."""
    counts = {}
    for key in full:
        m = LAYER.match(key)
        if m:
            prefix = m.group(1)
            decoder = is_t5(full) and ("decoder.layers." in prefix)
            counts[prefix] = (getattr(args, "decoder_num_layers", None) or args.num_layers) if decoder \
                else args.num_layers
    return counts


class ConversionError(RuntimeError):
    """A checkpoint or option combination the converter cannot handle; the message says what to do."""


def _tied_copy_key(args) -> str:
    mcore = getattr(args, "use_mcore_models", False)
    return "output_layer.weight" if mcore else "word_embeddings.weight"


def _is_tied(args) -> bool:
    return not getattr(args, "untie_embeddings_and_output_weights", False)


def read_tracker(load_dir: str) -> Tuple[int, bool]:
    path = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(path):
        raise ConversionError(f"{path} not found: --load-dir must be a Megatron checkpoint directory (torch format)")
    text = open(path).read().strip()
    if text == "release":
        return 0, True
    try:
        return int(text), False
    except ValueError:
        raise ConversionError(f"{path} must hold an iteration number or 'release', found {text!r}") from None


def load_legacy(load_dir: str) -> Tuple[Dict[str, torch.Tensor], object, dict]:
    """(full state dict, the checkpoint's args, info {'iteration', 'release', 'tp', 'pp'}) of ``load_dir``."""
    iteration, release = read_tracker(load_dir)
    iter_dir = os.path.join(load_dir, "release" if release else "iter_{:07d}".format(iteration))
    if not os.path.isdir(iter_dir):
        raise ConversionError(f"{iter_dir} (named by the tracker file) does not exist")
    if os.path.isfile(os.path.join(iter_dir, "metadata.json")):
        raise ConversionError(f"{iter_dir} is a torch_dist checkpoint: convert it with --loader torch_dist (it needs "
                              "no converter to change TP/PP: load it with --ckpt-format torch_dist)")
    ranks = {}
    for name in os.listdir(iter_dir):
        m = _RANK_DIR.match(name)
        if m:
            if m.group(3) is not None:
                raise ConversionError(f"{iter_dir}/{name}: expert-parallel checkpoints are not supported")
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(iter_dir, name, "model_optim_rng.pt")
    if not ranks:
        raise ConversionError(f"{iter_dir} holds no mp_rank_* directory")
    tp = max(t for t, _ in ranks) + 1
    pp = max(p for _, p in ranks) + 1
    missing = [f"mp_rank_{t:02d}_{p:03d}" for t in range(tp) for p in range(pp) if (t, p) not in ranks]
    if missing:
        raise ConversionError(f"{iter_dir} is incomplete: missing {missing}")
    states = {}
    for key, path in ranks.items():
        try:
            states[key] = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - name the file
            raise ConversionError(f"could not read {path}: {e}") from e
    args = states[(0, 0)].get("args")
    if args is None:
        raise ConversionError(f"{ranks[(0, 0)]} has no 'args': cannot tell the model configuration")
    if "model" not in states[(0, 0)]:
        found = sorted(k for k in states[(0, 0)] if k.startswith("model"))
        raise ConversionError(f"{ranks[(0, 0)]} holds {found or 'no model'}: checkpoints with virtual pipeline stages "
                              "(model0, model1, ...) are not supported by this converter; use --ckpt-format torch_dist")
    gated = bool(getattr(args, "swiglu", False))
    tied_keys = {_tied_copy_key(args), "lm_head.output_layer.weight"}
    # Layers are numbered per stage and per stack (T5: encoder and decoder stacks, the decoder after the split).
    full, tied_copy, layers_seen = {}, None, {}
    for p in range(pp):
        merged = merge_tensor_parallel([flatten_checkpoint_state_dict(states[(t, p)]["model"]) for t in range(tp)],
                                       gated_linear_unit=gated)
        stage_layers = {}
        for k in merged:
            if (m := LAYER.match(k)):
                stage_layers.setdefault(m.group(1), set()).add(int(m.group(2)))
        for prefix, numbers in stage_layers.items():
            if sorted(numbers) != list(range(len(numbers))):
                raise ConversionError(f"pipeline stage {p} has {prefix[:-1]} {sorted(numbers)}; expected "
                                      f"0..{len(numbers) - 1}")
        for key, value in merged.items():
            if pp > 1 and p == pp - 1 and _is_tied(args) and key in tied_keys and not any(
                    k.startswith(_EMBEDDING_PREFIXES) for k in merged):
                tied_copy = value
                continue
            if key.startswith(_T5_ALIASES) and "lm_head.output_layer.bias" in merged:
                continue
            m = LAYER.match(key)
            if m:
                key = f"{m.group(1)}{int(m.group(2)) + layers_seen.get(m.group(1), 0)}{m.group(3)}"
            full[key] = value
        for prefix, numbers in stage_layers.items():
            layers_seen[prefix] = layers_seen.get(prefix, 0) + len(numbers)
    expected = stack_layer_counts(args, full)
    for prefix, count in layers_seen.items():
        if count != expected[prefix]:
            raise ConversionError(f"found {count} {prefix[:-1]} over {pp} pipeline stages, the checkpoint's args "
                                  f"say {expected[prefix]} (num_layers / decoder_num_layers)")
    if tied_copy is not None:
        emb = full.get(WORD_EMBEDDINGS, full.get("embedding.word_embeddings.weight"))
        if emb is not None and not torch.equal(emb, tied_copy):
            print("WARNING: the last stage's tied word embedding copy differs from the first stage's; using the "
                  "first stage's", flush=True)
    return full, args, {"iteration": iteration, "release": release, "tp": tp, "pp": pp}


def repad_vocab(full: Dict[str, torch.Tensor], true_vocab_size, make_divisible_by: int, tp: int) -> int:
    """Trim the vocabulary tensors to ``true_vocab_size`` and pad them for ``tp``; return the padded size."""
    rows = {k: v.shape[0] for k, v in full.items() if k in VOCAB_KEYS}
    current = next(iter(rows.values()))
    if true_vocab_size is None:
        if current % (make_divisible_by * tp) != 0:
            raise ConversionError(f"the padded vocabulary ({current} rows) is not a multiple of "
                                  f"make_vocab_size_divisible_by x TP = {make_divisible_by} x {tp}: pass "
                                  "--true-vocab-size (the tokenizer's vocabulary size) to re-pad it")
        return current
    if true_vocab_size > current:
        raise ConversionError(f"--true-vocab-size {true_vocab_size} is larger than the checkpoint's vocabulary "
                              f"({current} rows)")
    padded = vocab_size_with_padding(true_vocab_size, make_divisible_by, tp, log=False)
    for key in rows:
        v = full[key][:true_vocab_size]
        full[key] = torch.cat([v, v.new_zeros(padded - true_vocab_size, *v.shape[1:])]) if padded > v.shape[0] else v
    return padded


def _nest(flat: Dict[str, torch.Tensor]) -> dict:
    """Megatron's nested layout: {'language_model': {'embedding': {...}, 'encoder': {...}, 'output_layer': ...},
    'word_embeddings_for_head': ..., 'lm_head': {...}, 'classification_head': {...}, ...} (a legacy model loads
    each head from its own entry); megatron-core names stay flat."""
    out: dict = {}
    legacy = any(key.startswith("language_model.") for key in flat)
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if legacy and head in _LEGACY_HEADS and rest:
            out.setdefault(head, {})[rest] = value
            continue
        if key.startswith("language_model.embedding."):
            sub, rest = key[len("language_model.embedding."):].split(".", 1)
            out.setdefault("language_model", {}).setdefault("embedding", {}).setdefault(sub, {})[rest] = value
        elif key.startswith("language_model."):
            sub, rest = key[len("language_model."):].split(".", 1)
            out.setdefault("language_model", {}).setdefault(sub, {})[rest] = value
        elif key.startswith("word_embeddings."):
            out.setdefault("word_embeddings_for_head", {})[key[len("word_embeddings."):]] = value
        else:
            out[key] = value
    return out


def save_legacy(full: Dict[str, torch.Tensor], args, save_dir: str, tp: int, pp: int, iteration: int,
                release: bool = False):
    """Write ``full`` as a TP x PP legacy checkpoint (model_optim_rng.pt per rank, tracker file)."""
    if is_t5(full) and pp > 1:
        raise ConversionError(f"--target-pipeline-parallel-size {pp}: T5 torch checkpoints are written with PP=1 only "
                              "(the pipeline split rank is a training choice); save with --saver torch_dist, which "
                              "loads with any PP and --pipeline-model-parallel-split-rank")
    num_layers = args.num_layers
    if num_layers % pp != 0:
        raise ConversionError(f"--target-pipeline-parallel-size {pp} does not divide num_layers {num_layers}")
    heads, groups = args.num_attention_heads, getattr(args, "num_query_groups", None) or args.num_attention_heads
    if not getattr(args, "group_query_attention", False):
        groups = heads
    if heads % tp or groups % tp:
        raise ConversionError(f"--target-tensor-parallel-size {tp} must divide the {heads} attention heads and the "
                              f"{groups} query groups")
    per_stage = num_layers // pp
    gated = bool(getattr(args, "swiglu", False))
    out_args = copy.deepcopy(args)
    out_args.tensor_model_parallel_size, out_args.pipeline_model_parallel_size = tp, pp
    out_args.virtual_pipeline_model_parallel_size = None
    out_args.pipeline_model_parallel_split_rank = None
    out_args.world_size = tp * pp * getattr(args, "data_parallel_size", 1)
    iter_dir = os.path.join(save_dir, "release" if release else "iter_{:07d}".format(iteration))
    emb_key = "embedding.word_embeddings.weight" if getattr(args, "use_mcore_models", False) else WORD_EMBEDDINGS
    for p in range(pp):
        stage = {}
        for key, value in full.items():
            m = LAYER.match(key)
            if m:
                layer = int(m.group(2))
                if p * per_stage <= layer < (p + 1) * per_stage:
                    stage[f"{m.group(1)}{layer - p * per_stage}{m.group(3)}"] = value
            elif key.startswith(_EMBEDDING_PREFIXES):
                if p == 0:
                    stage[key] = value
            elif p == pp - 1:
                stage[key] = value
        if pp > 1 and p == pp - 1 and _is_tied(args) and emb_key in full:
            stage[_tied_copy_key(args)] = full[emb_key]
        for t, shard in enumerate(split_tensor_parallel(stage, tp, gated_linear_unit=gated)):
            name = "mp_rank_{:02d}".format(t) + ("_{:03d}".format(p) if pp > 1 else "")
            path = os.path.join(iter_dir, name, "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"args": out_args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                        "model": _nest({k: v.clone() for k, v in shard.items()}),
                        "num_floating_point_operations_so_far": 0}, path)
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release" if release else str(iteration))
