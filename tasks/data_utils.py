"""Text cleaning and BERT sample building shared by the finetuning tasks (Megatron-LM's ``tasks/data_utils.py``).

A sample of a text pair (A, B) with maximum length L is::

    ids     = [CLS] A [SEP] B [SEP] pad ... pad
    types   =   0   0   0   1   1    pad ... pad      (the padding of types is the pad id too, as Megatron)
    padding =   1   1   1   1   1     0  ...  0

Without B it is ``[CLS] A`` (no closing [SEP]) unless the sequence had to be cut: a sequence of L tokens or more
is cut to L - 1 tokens and closed with [SEP] (type 1 when B exists, else 0).
"""
from __future__ import annotations

import re

import numpy as np


def clean_text(text: str) -> str:
    """Newlines to spaces, runs of white space to one space, ``' . '`` to ``'. '`` (three passes)."""
    text = re.sub(r"\s+", " ", text.replace("\n", " "))
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def build_sample(ids, types, paddings, label, unique_id):
    """``{text, types, padding_mask}`` as int64 arrays plus the int ``label`` and ``uid``."""
    return {"text": np.array(ids, dtype=np.int64), "types": np.array(types, dtype=np.int64),
            "padding_mask": np.array(paddings, dtype=np.int64), "label": int(label), "uid": int(unique_id)}


def build_tokens_types_paddings_from_text(text_a, text_b, tokenizer, max_seq_length):
    """Tokenize A (and B when not None) and build the sample lists (see the module docstring)."""
    ids_a = tokenizer.tokenize(text_a)
    ids_b = tokenizer.tokenize(text_b) if text_b is not None else None
    return build_tokens_types_paddings_from_ids(ids_a, ids_b, max_seq_length, tokenizer.cls, tokenizer.sep,
                                                tokenizer.pad)


def build_tokens_types_paddings_from_ids(text_a_ids, text_b_ids, max_seq_length, cls_id, sep_id, pad_id):
    """(ids, types, paddings) lists of length ``max_seq_length`` (see the module docstring)."""
    ids = [cls_id] + list(text_a_ids)
    types = [0] * len(ids)
    if text_b_ids is not None:
        ids += [sep_id] + list(text_b_ids)
        types += [0] + [1] * len(text_b_ids)
    paddings = [1] * len(ids)
    trimmed = len(ids) >= max_seq_length
    if trimmed:
        ids, types, paddings = ids[:max_seq_length - 1], types[:max_seq_length - 1], paddings[:max_seq_length - 1]
    if text_b_ids is not None or trimmed:
        ids.append(sep_id)
        types.append(0 if text_b_ids is None else 1)
        paddings.append(1)
    padding = max_seq_length - len(ids)
    if padding > 0:
        ids += [pad_id] * padding
        types += [pad_id] * padding
        paddings += [0] * padding
    return ids, types, paddings
