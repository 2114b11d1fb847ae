"""Zero-shot evaluation datasets (Megatron-LM's ``tasks/zeroshot_gpt/datasets.py``).

Every item is ``{'text': seq_len + 1 token ids, 'pad_mask': seq_len flags}``: the model reads ``text[:-1]``,
predicts ``text[1:]``, and ``pad_mask`` says which predictions count. Padding is the EOD token.

WikiText (``_LMDataset``): the whole file, detokenized, as one token stream of N tokens (N - 1 targets). With
stride ``k = max(1, --overlapping-eval)`` window i holds tokens ``[i k, i k + seq_len]``; the number of windows is
``max(ceil(max(N - 1 - k, 0) / k) + 1, 1)``. Window 0 counts all its targets; a later window (when ``k != seq_len``)
counts only its last k, so each target is counted exactly once and, after the first window, predicted with at least
``seq_len - k`` tokens of context.

LAMBADA (``_LambadaDataset``): one JSON object per line with the passage in ``text``. The target is the last BPE
token (default) or, with ``--strict-lambada``, the whole last word: context = the text before the last occurrence
of the last whitespace-separated word (stripped), target = ``tokenize(' ' + word)``. Only the target positions count.
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch

from megatron.training.errors import ConfigurationError
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.utils import print_rank_0
from tasks.zeroshot_gpt.detokenizer import get_detokenizer


def build_dataset(task):
    if task == "LAMBADA":
        return _build_lambada_dataset()
    if task == "WIKITEXT103":
        return _build_wikitext103_dataset()
    raise NotImplementedError("dataset for {} task is not implemented.".format(task))


class _LMDataset(torch.utils.data.Dataset):
    def __init__(self, tokens, seq_len, pad_idx, num_original_tokens, num_tokenized_tokens,
                 overalapping_eval=None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.pad_idx = pad_idx
        self.overalapping_eval = max(1, seq_len if overalapping_eval is None else overalapping_eval)
        self.num_original_tokens = num_original_tokens
        self.num_tokenized_tokens = num_tokenized_tokens
        self.total_targets = len(self.tokens) - 1
        targets = max(self.total_targets - self.overalapping_eval, 0)
        self.total_sequences = max(math.ceil(targets / self.overalapping_eval) + 1, 1)

    def __len__(self):
        return self.total_sequences

    def __getitem__(self, idx):
        start = idx * self.overalapping_eval
        tokens = list(self.tokens[start:start + self.seq_len + 1])
        pad_mask = [1] * len(tokens)
        num_pad = self.seq_len + 1 - len(tokens)
        if num_pad > 0:
            pad_mask += [0] * num_pad
            tokens += [self.pad_idx] * num_pad
        pad_mask = np.array(pad_mask[1:])
        if self.overalapping_eval != self.seq_len and idx != 0:
            pad_mask[:-self.overalapping_eval] *= 0
        return {"text": np.array(tokens), "pad_mask": pad_mask}


def read_lambada(path):
    """``[(line number, text), ...]`` of a LAMBADA JSON-lines file; a bad line is a one-line error."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigurationError(f"{path} line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str) or not text.split():
                raise ConfigurationError(f"{path} line {n}: expected a JSON object with a non-empty \"text\" string")
            out.append((n, text))
    return out


class _LambadaDataset(torch.utils.data.Dataset):
    def __init__(self, path, pad_idx, tokenizer, seq_len, strict=False):
        print_rank_0("> building lambada dataset from {} ...".format(path))
        self.seq_len = seq_len
        self.pad_idx = pad_idx
        self.tokenizer = tokenizer
        self.strict = strict
        self.tokens, self.labels = [], []
        for line, text in read_lambada(path):
            tokens, labels = self.get_tokens(text)
            if len(tokens) + len(labels) > seq_len + 1 or not labels:
                raise ConfigurationError(
                    f"--valid-data {path} line {line}: the passage has {len(tokens) + len(labels)} tokens; "
                    f"--seq-length ({seq_len}) must be at least one less (LAMBADA passages are not truncated)")
            self.tokens.append(tokens)
            self.labels.append(labels)

    def get_tokens(self, text):
        if not self.strict:
            tokens = self.tokenizer.tokenize(text)
            return tokens[:-1], tokens[-1:]
        last_word = text.split()[-1]
        context = text[:text.rfind(last_word)].strip()
        return self.tokenizer.tokenize(context), self.tokenizer.tokenize(" " + last_word)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, idx):
        context, labels = self.tokens[idx], self.labels[idx]
        tokens = list(context) + list(labels)
        pad_mask = [0] * len(context) + [1] * len(labels)
        num_pad = self.seq_len + 1 - len(tokens)
        if num_pad > 0:
            pad_mask += [0] * num_pad
            tokens += [self.pad_idx] * num_pad
        return {"text": np.array(tokens), "pad_mask": np.array(pad_mask[1:])}


def _build_lambada_dataset():
    args, tokenizer = get_args(), get_tokenizer()
    assert len(args.valid_data) == 1
    val_dataset = _LambadaDataset(args.valid_data[0], tokenizer.eod, tokenizer, args.seq_length, args.strict_lambada)
    print_rank_0(" > found {} samples.".format(len(val_dataset)))
    return val_dataset


def _build_wikitext103_dataset():
    args, tokenizer = get_args(), get_tokenizer()
    assert len(args.valid_data) == 1
    with open(args.valid_data[0], "rb") as reader:
        entire_data = reader.read().decode("utf-8")
    num_original_tokens = len(entire_data.strip().split(" "))
    entire_data = get_detokenizer(args.valid_data[0])(entire_data)
    tokenized_data = tokenizer.tokenize(entire_data)
    num_tokenized_tokens = len(tokenized_data)
    val_dataset = _LMDataset(tokenized_data, args.seq_length, tokenizer.eod, num_original_tokens,
                             num_tokenized_tokens, args.overlapping_eval)
    print_rank_0(" > number of original tokens: {}, number of detokenized tokens: {}".format(
        num_original_tokens, num_tokenized_tokens))
    return val_dataset
