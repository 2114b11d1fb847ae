"""Today's tokenizers: TikTokenizer (a hand-written JSON vocabulary, ids checked by hand-applied BPE), Llama2Tokenizer
(the shipped SentencePiece model, against sentencepiece itself), HuggingFaceTokenizer from a saved tiny tokenizer
directory, and the one NullTokenizer rule (vocabulary N + 1, eod N) shared by validate_args and build_tokenizer."""
import base64
import json

import pytest
from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)
from helpers.data_support import SPM_MODEL, sample_texts, tokenizer_args

from megatron.tokenizer import build_tokenizer

S = 10  # --tiktoken-num-special-tokens in these tests
MERGES = [b"ab", b"abc", b"aB"]  # ranks 256, 257, 258


def _write_vocab(path, tokens):
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
               for i, t in enumerate(tokens)]
    path.write_text(json.dumps(entries))
    return str(path)


@pytest.fixture
def tiny_vocab(tmp_path):
    return _write_vocab(tmp_path / "tiny_vocab.json", [bytes([i]) for i in range(256)] + MERGES)


def _tik(path, pattern="v1", **overrides):
    args = tokenizer_args("TikTokenizer", tokenizer_model=path, tiktoken_pattern=pattern, vocab_size=S + 259,
                          tiktoken_num_special_tokens=S, tiktoken_special_tokens=None)
    for key, value in overrides.items():
        setattr(args, key, value)
    return build_tokenizer(args), args


def test_tiktokenizer_ids_specials_and_round_trip(tiny_vocab):
    tok, args = _tik(tiny_vocab)
    # BPE by hand: "abc" -> a b c -> ab c (256) -> abc (257); " ab" -> ' ' a b -> ' ' ab; ids are rank + S.
    assert tok.tokenize("abc ab") == [257 + S, ord(" ") + S, 256 + S]
    assert tok.tokenize("ab", bos=True, eos=True) == [1, 256 + S, 2]
    # "aBab" is one v1 piece: a B a b -> a B ab (rank 256 first) -> aB ab (258).
    assert tok.tokenize("aBab") == [258 + S, 256 + S]
    # Specials: <unk> <s> </s> then <SPECIAL_3>..<SPECIAL_9>; their strings in text stay ordinary bytes.
    assert (tok.unk, tok.bos, tok.eos, tok.eod) == (0, 1, 2, 2)
    assert tok.inv_vocab[S - 1] == "<SPECIAL_9>" and tok.detokenize([2]) == "</s>"
    assert tok.tokenize("</s>") == [b + S for b in b"</s>"]
    assert tok.vocab_size == S + 259 and args.padded_vocab_size == 384
    for text in ["h\u00e9llo w\u00f6rld \u4e2d\u6587 \U0001f600\n\tx"] + sample_texts(3, max_chars=300):
        ids = tok.tokenize(text)
        assert all(S <= i < S + 259 for i in ids) and tok.detokenize(ids) == text


def test_tiktoken_pattern_v2_splits_case_changes(tiny_vocab):
    v2, _ = _tik(tiny_vocab, pattern="v2")
    # v2 pieces "a" | "Bab": a, then B a b -> B ab; the a+B merge across pieces is impossible.
    assert v2.tokenize("aBab") == [ord("a") + S, ord("B") + S, 256 + S]
    assert v2.tokenize("abc ab") == [257 + S, ord(" ") + S, 256 + S]


def test_tiktokenizer_custom_specials_and_bad_files(tmp_path, tiny_vocab):
    tok, _ = _tik(tiny_vocab, tiktoken_special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<mask>"])
    assert tok.pad == 3 and tok.inv_vocab[4] == "<mask>" and tok.inv_vocab[5] == "<SPECIAL_5>"
    with pytest.raises(ValueError, match="must include <unk> <s> </s>"):
        _tik(tiny_vocab, tiktoken_special_tokens=["<s>", "</s>"])
    with pytest.raises(ValueError, match="--tiktoken-pattern is required for --tokenizer-type TikTokenizer"):
        _tik(tiny_vocab, pattern=None)
    with pytest.raises(ValueError, match="holds 259 BPE entries, but the vocabulary needs 131062"):
        _tik(tiny_vocab, vocab_size=None)  # default vocabulary 2**17
    with pytest.raises(ValueError, match="ending in .json"):
        _tik(str(tmp_path / "vocab.tiktoken"))
    swapped = [bytes([i]) for i in range(256)]
    swapped[5], swapped[6] = swapped[6], swapped[5]
    with pytest.raises(ValueError, match="entry 5 must be the single byte 5"):
        _tik(_write_vocab(tmp_path / "swapped.json", swapped + MERGES))


def test_llama2_tokenizer_prepends_bos():
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=SPM_MODEL)
    args = tokenizer_args("Llama2Tokenizer", tokenizer_model=SPM_MODEL)
    tok = build_tokenizer(args)
    for text in sample_texts(5, max_chars=400):
        assert tok.tokenize(text) == [sp.bos_id()] + sp.encode_as_ids(text)
        assert tok.detokenize(tok.tokenize(text)[1:]) == text
    assert tok.tokenize("x", bos=False, eos=True) == sp.encode_as_ids("x") + [sp.eos_id()]
    assert (tok.vocab_size, tok.eod, tok.bos) == (sp.vocab_size(), sp.eos_id(), sp.bos_id())
    assert (tok.cls, tok.sep, tok.mask) == (-1, -1, -1)
    assert args.padded_vocab_size == 8064  # 8000 rounded up to a multiple of 128


def test_huggingface_tokenizer_from_a_saved_tiny_directory(tmp_path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<unk>", "<s>", "</s>", "hello", "world", "tiny"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory = str(tmp_path / "tiny_hf")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.add_tokens(["<extra>"])
    fast.save_pretrained(directory)
    args = tokenizer_args("HuggingFaceTokenizer", tokenizer_model=directory)
    tok = build_tokenizer(args)
    assert tok.tokenize("hello tiny world zzz") == [1, 3, 5, 4, 0]  # BOS from the post-processor, unk for zzz
    assert tok.vocab_size == 7 and tok.eod == 2  # len(tokenizer) counts the added token; eod = eos
    assert args.padded_vocab_size == 128


def test_null_tokenizer_one_rule(clean_env):
    """validate_args and build_tokenizer agree: --vocab-size N means N + 1 ids (eod N), padded from N + 1."""
    args = validated("--tokenizer-type NullTokenizer --vocab-size 128256")
    assert args.padded_vocab_size == 128384
    fresh = tokenizer_args("NullTokenizer", vocab_size=128256)
    tok = build_tokenizer(fresh)
    assert (tok.vocab_size, tok.eod, fresh.padded_vocab_size) == (128257, 128256, 128384)
    # a multiple of 128 itself: N = 1024 still needs 1025 ids, so one more padding block
    assert validated("--tokenizer-type NullTokenizer --vocab-size 1024").padded_vocab_size == 1152
    assert validated("--vocab-size 1024").padded_vocab_size == 1024  # no tokenizer named: N as given


def test_vocab_size_flag_is_ignored_by_file_tokenizers(clean_env, tmp_path):
    """--vocab-size pre-sizes only NullTokenizer (N + 1) and TikTokenizer (N); a Hugging Face or SentencePiece
    tokenizer defines its own vocabulary, padded by build_tokenizer (the llama example passes both)."""
    args = validated(f"--tokenizer-type Llama2Tokenizer --tokenizer-model {SPM_MODEL} --vocab-size 128256")
    assert getattr(args, "padded_vocab_size", None) is None
    build_tokenizer(args)
    assert args.padded_vocab_size == 8064
    assert validated("--tokenizer-type TikTokenizer --vocab-size 1000").padded_vocab_size == 1024


def test_megatron_core_tokenizer_paths_and_metadata_forms(tmp_path):
    """megatron.core.tokenizers is the one home: MegatronTokenizer.from_pretrained with a metadata dict (null-text,
    0.16's null) or the tokenizer_metadata.json that write_metadata puts next to a tokenizer; the 0.16 path
    megatron.training.tokenizer and the 2023 path megatron.tokenizer give the same objects."""
    import megatron.core.tokenizers.build_tokenizer as core_build
    import megatron.tokenizer.tokenizer as old_path
    import megatron.training.tokenizer.tokenizer as path_016
    from megatron.core.tokenizers import MegatronTokenizer

    assert path_016._NullTokenizer is core_build._NullTokenizer and old_path.build_tokenizer is core_build.build_tokenizer
    text = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=100)
    assert (text.vocab_size, text.eod, text.tokenize("3 7 42")) == (100, 99, [3, 7, 42])
    null = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=100)
    assert (null.vocab_size, null.eod) == (101, 100)  # 0.16's rule: N + 1 ids
    spm = str(tmp_path / "tok.model")
    with open(SPM_MODEL, "rb") as src, open(spm, "wb") as dst:
        dst.write(src.read())
    written = MegatronTokenizer.write_metadata(spm, "sentencepiece")
    with pytest.raises(FileExistsError):
        MegatronTokenizer.write_metadata(spm, "sentencepiece")
    tok = MegatronTokenizer.from_pretrained(spm)  # reads tmp_path/tokenizer_metadata.json
    assert written.endswith("tokenizer_metadata.json") and tok.tokenize("hello world")
    with pytest.raises(NotImplementedError, match="byte-level"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"})
