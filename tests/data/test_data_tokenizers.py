"""Tokenizers against independent references, Megatron's properties, vocab padding, offline loading, errors."""
import json
import os
import unicodedata

import pytest
import regex

from helpers.data_support import BERT_VOCAB, GPT2_MERGES, GPT2_VOCAB, SPM_MODEL, sample_texts, tokenizer_args
from megatron.tokenizer import build_tokenizer

TRICKY = [
    "Hello world! It's, they'll, we've, I'm, you'd, she's -- don't.",
    "  leading spaces, trailing spaces   \n\n\tTabs\tand\r\nCRLF  ",
    "Unicode: naïve café Ünïcödé, 東京, Ελληνικά, emoji 🙂👍🏽 and ß.",
    "numbers 3.14159 and 1,000,000; code: x = f(a[1], **kw)  # comment",
    "<|endoftext|> is plain text for GPT-2, not the eod token.",
    "Classes the two regex engines disagree on: x\x1cy, 2² ½ Ⅻ, a_b __init__, \u2028line\u00a0nbsp",
    "",
]


# ------------------------------------------------------------------------- reference GPT-2 byte-level BPE

def _reference_byte_map():
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_REFERENCE_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def reference_gpt2_encode(text, encoder, ranks):
    """OpenAI's GPT-2 algorithm written out: regex pieces, byte map, repeatedly merge the best-ranked pair."""
    byte_map = _reference_byte_map()
    out = []
    for piece in _REFERENCE_SPLIT.findall(text):
        word = [byte_map[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pair = min(zip(word, word[1:]), key=lambda p: ranks.get(p, float("inf")))
            if pair not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        out.extend(encoder[token] for token in word)
    return out


def test_gpt2_bpe_matches_the_reference_algorithm_and_the_rust_pipeline():
    tokenizer = build_tokenizer(tokenizer_args("GPT2BPETokenizer"))
    with open(GPT2_VOCAB, encoding="utf-8") as f:
        encoder = json.load(f)
    with open(GPT2_MERGES, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
    ranks = {pair: i for i, pair in enumerate(merges)}
    texts = TRICKY + sample_texts(25, max_chars=1500)
    for text in texts:
        ids = tokenizer.tokenize(text)
        assert ids == reference_gpt2_encode(text, encoder, ranks), text[:60]
        assert ids == tokenizer._tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.detokenize(ids) == text
    assert tokenizer.tokenize_batch(texts[:4]) == [tokenizer.tokenize(t) for t in texts[:4]]
    assert tokenizer.eod == encoder["<|endoftext|>"] == len(encoder) - 1 == tokenizer.vocab_size - 1
    assert tokenizer.vocab["the"] == encoder["the"] and tokenizer.inv_vocab[encoder["the"]] == "the"
    assert tokenizer.eod not in tokenizer.tokenize("<|endoftext|>")


# ----------------------------------------------------------------------------- reference BERT WordPiece

def _reference_basic_tokenize(text, lower):
    cleaned = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or (ch not in "\t\n\r" and unicodedata.category(ch).startswith("C")):
            continue
        if ch in " \t\n\r" or unicodedata.category(ch) == "Zs":
            cleaned.append(" ")
        elif 0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0xF900 <= cp <= 0xFAFF:
            cleaned.append(f" {ch} ")
        else:
            cleaned.append(ch)
    words = []
    for word in "".join(cleaned).split():
        if lower:
            word = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
        current = ""
        for ch in word:
            cp = ord(ch)
            if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or \
                    unicodedata.category(ch).startswith("P"):
                if current:
                    words.append(current)
                words.append(ch)
                current = ""
            else:
                current += ch
        if current:
            words.append(current)
    return words


def reference_wordpiece(text, vocab, lower):
    ids = []
    for word in _reference_basic_tokenize(text, lower):
        if len(word) > 100:
            ids.append(vocab["[UNK]"])
            continue
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in vocab:
                    break
                end -= 1
            if end == start:
                pieces = [vocab["[UNK]"]]
                break
            pieces.append(vocab[piece])
            start = end
        ids.extend(pieces)
    return ids


@pytest.mark.parametrize("tokenizer_type,lower", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)])
def test_bert_wordpiece_matches_the_reference_algorithm(tokenizer_type, lower):
    tokenizer = build_tokenizer(tokenizer_args(tokenizer_type))
    with open(BERT_VOCAB, encoding="utf-8") as f:
        vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
    for text in TRICKY + sample_texts(20, max_chars=1500) + ["x" * 120 + " ok"]:
        assert tokenizer.tokenize(text) == reference_wordpiece(text, vocab, lower), text[:60]
    # Megatron's extra ids: [BOS]/[EOS] appended to the vocabulary, special-token properties.
    assert tokenizer.vocab_size == len(vocab) + 2
    assert (tokenizer.bos, tokenizer.eos) == (len(vocab), len(vocab) + 1)
    assert (tokenizer.cls, tokenizer.sep, tokenizer.pad, tokenizer.mask) == \
        (vocab["[CLS]"], vocab["[SEP]"], vocab["[PAD]"], vocab["[MASK]"])
    ids = tokenizer.tokenize("the quick brown fox")  # the shipped vocab is lower-case
    assert tokenizer.detokenize(ids).lower() == "the quick brown fox"
    assert tokenizer.decode_token_ids([tokenizer.cls] + ids + [tokenizer.pad]).strip().lower() == "the quick brown fox"
    extra = build_tokenizer(tokenizer_args(tokenizer_type, vocab_extra_ids=3))
    assert extra.vocab_size == len(vocab) + 5
    assert extra.additional_special_tokens_ids == [len(vocab) + 2, len(vocab) + 3, len(vocab) + 4]
    # today's Megatron-LM gives the BERT tokenizer an eod: the [EOS] id appended after the vocabulary
    assert tokenizer.eod == tokenizer.eos == len(vocab) + 1


def test_sentencepiece_tokenizers():
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=SPM_MODEL)
    gpt = build_tokenizer(tokenizer_args("GPTSentencePieceTokenizer"))
    for text in TRICKY + sample_texts(10, max_chars=1500):
        ids = gpt.tokenize(text)
        assert ids == processor.encode_as_ids(text)
        assert gpt.detokenize(ids) == text  # byte fallback + identity normalisation
    assert (gpt.vocab_size, gpt.eod, gpt.pad, gpt.cls, gpt.mask) == (8000, 2, 3, -1, -1)

    megatron_sp = build_tokenizer(tokenizer_args("SentencePieceTokenizer", vocab_extra_ids=2))
    # <CLS> <SEP> <EOD> <MASK> are new; pad/bos/eos are the model's own pieces.
    assert megatron_sp.vocab_size == 8000 + 4 + 2
    assert (megatron_sp.cls, megatron_sp.sep, megatron_sp.eod, megatron_sp.mask) == (8000, 8001, 8002, 8003)
    assert (megatron_sp.pad, megatron_sp.bos, megatron_sp.eos) == (3, 1, 2)
    assert megatron_sp.additional_special_tokens_ids == [8004, 8005]
    ids = megatron_sp.tokenize("first part<SEP>second<MASK>")
    assert ids == processor.encode_as_ids("first part") + [8001] + processor.encode_as_ids("second") + [8003]
    assert megatron_sp.detokenize(processor.encode_as_ids("plain text")) == "plain text"


def test_huggingface_tokenizer_from_json_and_directory_offline(tmp_path):
    from megatron.tokenizer.gpt2_bpe import build_byte_level_bpe, load_gpt2_merges, load_gpt2_vocab

    gpt2 = build_tokenizer(tokenizer_args("GPT2BPETokenizer"))
    json_path = str(tmp_path / "tokenizer.json")
    build_byte_level_bpe(load_gpt2_vocab(GPT2_VOCAB), load_gpt2_merges(GPT2_MERGES)).save(json_path)
    from_json = build_tokenizer(tokenizer_args("HuggingFaceTokenizer", tokenizer_model=json_path))
    text = sample_texts(1, max_chars=800)[0]
    assert from_json.tokenize(text) == gpt2.tokenize(text)
    assert from_json.detokenize(from_json.tokenize(text)) == text
    assert from_json.eod == gpt2.eod and from_json.vocab_size == gpt2.vocab_size

    import transformers

    directory = str(tmp_path / "hf_dir")
    transformers.PreTrainedTokenizerFast(tokenizer_file=json_path, eos_token="<|endoftext|>").save_pretrained(directory)
    from_dir = build_tokenizer(tokenizer_args("HuggingFaceTokenizer", tokenizer_model=directory))
    assert from_dir.tokenize(text) == gpt2.tokenize(text)
    assert from_dir.eod == gpt2.eod

    # A hub name is never downloaded: the error says what to do instead.
    with pytest.raises(FileNotFoundError, match="never downloads"):
        build_tokenizer(tokenizer_args("HuggingFaceTokenizer", tokenizer_model="gpt2"))


def test_null_tokenizer_and_vocab_padding(capsys):
    args = tokenizer_args("NullTokenizer", vocab_size=1000, rank=0, tensor_model_parallel_size=4)
    tokenizer = build_tokenizer(args)
    assert tokenizer.tokenize("5 17 999") == [5, 17, 999] and tokenizer.detokenize([5, 17]) == "5 17"
    assert tokenizer.vocab_size == 1001 and tokenizer.eod == 1000
    assert args.padded_vocab_size == 1024  # multiple of 128 * 4
    out = capsys.readouterr().out
    assert "> building NullTokenizer tokenizer ..." in out
    assert " > padded vocab (size: 1001) with 23 dummy tokens (new size: 1024)" in out

    bert = tokenizer_args("BertWordPieceLowerCase", make_vocab_size_divisible_by=64, tensor_model_parallel_size=2)
    build_tokenizer(bert)
    assert bert.padded_vocab_size == 8192 + 128  # 8194 rounded up to a multiple of 128
    preset = tokenizer_args("GPT2BPETokenizer", padded_vocab_size=50304)
    build_tokenizer(preset)
    assert preset.padded_vocab_size == 50304  # a value from a checkpoint is kept


def test_bad_tokenizer_inputs_name_the_file_or_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--vocab-file .*missing.json does not exist"):
        build_tokenizer(tokenizer_args("GPT2BPETokenizer", vocab_file=str(tmp_path / "missing.json")))
    bad_json = tmp_path / "vocab.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match="vocab.json is not a GPT-2 vocab.json"):
        build_tokenizer(tokenizer_args("GPT2BPETokenizer", vocab_file=str(bad_json)))
    no_eod = tmp_path / "noeod.json"
    no_eod.write_text(json.dumps({"a": 0}))
    with pytest.raises(ValueError, match="no <\\|endoftext\\|> entry"):
        build_tokenizer(tokenizer_args("GPT2BPETokenizer", vocab_file=str(no_eod)))
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nĠ t\nthis line is wrong\n")
    with pytest.raises(ValueError, match="merges.txt line 3 is not a merge"):
        build_tokenizer(tokenizer_args("GPT2BPETokenizer", merge_file=str(bad_merges)))
    with pytest.raises(ValueError, match="--merge-file is required for --tokenizer-type GPT2BPETokenizer"):
        build_tokenizer(tokenizer_args("GPT2BPETokenizer", merge_file=None))
    not_bert = tmp_path / "vocab.txt"
    not_bert.write_text("a\nb\n[UNK]\n")
    with pytest.raises(ValueError, match="lacks \\[PAD\\], \\[CLS\\], \\[SEP\\], \\[MASK\\]"):
        build_tokenizer(tokenizer_args("BertWordPieceCase", vocab_file=str(not_bert)))
    bad_model = tmp_path / "spm.model"
    bad_model.write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="spm.model is not a valid SentencePiece model"):
        build_tokenizer(tokenizer_args("GPTSentencePieceTokenizer", tokenizer_model=str(bad_model)))
    with pytest.raises(ValueError, match="--tokenizer-type 'Unknown' is not supported"):
        build_tokenizer(tokenizer_args("Unknown"))
    assert os.path.isfile(SPM_MODEL)
