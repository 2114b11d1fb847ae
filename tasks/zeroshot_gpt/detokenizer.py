"""Megatron's detokenizers for zero-shot perplexity: undo the tokenisation of the WikiText / PTB release files
(spaces around punctuation, ``@-@`` number separators, ``<unk>``-era conventions) so that the GPT tokenizer sees
natural text. ``get_detokenizer(path)`` picks one by a substring of the file path, in the order ``ptb``, ``wiki``,
``lambada`` (None when none matches). The rules are plain string replacements applied in the order listed.
"""
from __future__ import annotations

import re


def ptb_detokenizer(string: str) -> str:
    for old, new in ((" '", "'"), (" \n", "\n"), ("\n ", "\n"), (" n't", "n't"), (" N ", "1 "), ("$ 1", "$1"),
                     ("# 1", "#1")):
        string = string.replace(old, new)
    return string


def wikitext_detokenizer(string: str) -> str:
    # contractions
    string = string.replace("s '", "s'")
    # number separators
    for old, new in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")):
        string = string.replace(old, new)
    # punctuation
    for mark in ":;.!?,":
        string = string.replace(f" {mark} ", f"{mark} ")
    # spaces inside brackets and quotes
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # headings and the rest
    for old, new in (("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u00b0 ", "\u00b0"), (" \n", "\n"),
                     ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")):
        string = string.replace(old, new)
    return string


def lambada_detokenizer(string: str) -> str:
    return string


_DETOKENIZERS = {"ptb": ptb_detokenizer, "wiki": wikitext_detokenizer, "lambada": lambada_detokenizer}


def get_detokenizer(path):
    for key, detokenizer in _DETOKENIZERS.items():
        if key in path:
            return detokenizer
    return None
