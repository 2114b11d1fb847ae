"""Train the project's tokenizer files on a JSON-lines corpus, offline.

Writes, into --output-dir:
  gpt2/vocab.json, gpt2/merges.txt   GPT-2 format byte-level BPE (GPT2BPETokenizer); <|endoftext|> is the
                                     last id, as in GPT-2
  bert/vocab.txt                     BERT WordPiece, lower-cased (BertWordPieceLowerCase)
  sentencepiece/spm.model            SentencePiece BPE with byte fallback and identity normalisation, so
                                     decoding gives back the exact text (SentencePieceTokenizer /
                                     GPTSentencePieceTokenizer)

    python tools/train_tokenizer.py --input data/stdlib_prose.jsonl.gz --output-dir data/tokenizers

The GPT-2 and SentencePiece files are byte-identical from run to run. The BERT vocab.txt can differ in
a few entries: the WordPiece trainer of the tokenizers library breaks ties between equally frequent
merges in hash order.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

EOD = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def iter_texts(path: str, keys):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise SystemExit(f"error: {path}:{line_number}: malformed JSON line ({error.msg})")
            for key in keys:
                text = record.get(key)
                if isinstance(text, str) and text:
                    yield text


def train_gpt2_bpe(texts, vocab_size: int, out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # One id is kept for <|endoftext|>, appended last like GPT-2's id 50256.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tokenizer.train_from_iterator(texts, trainer=trainer)
    state = json.loads(tokenizer.to_str())["model"]
    vocab = dict(sorted(state["vocab"].items(), key=lambda item: item[1]))
    vocab[EOD] = len(vocab)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for merge in merges:
            f.write(merge + "\n")
    print(f"gpt2: {len(vocab)} tokens, {len(merges)} merges -> {out_dir}", file=sys.stderr)


def train_bert_wordpiece(texts, vocab_size: int, out_dir: str) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                        special_tokens=BERT_SPECIALS, continuing_subword_prefix="##")
    tokenizer.train_from_iterator(texts, trainer=trainer)
    by_id = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    # The trainer lists the initial alphabet in hash order; sort it so the file is reproducible.
    def is_alphabet(token):
        return len(token) == 1 or (token.startswith("##") and len(token) == 3)
    alphabet = sorted(t for t in by_id if t not in BERT_SPECIALS and is_alphabet(t))
    learned = [t for t in by_id if t not in BERT_SPECIALS and not is_alphabet(t)]
    vocab = BERT_SPECIALS + alphabet + learned
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vocab.txt"), "w", encoding="utf-8") as f:
        for token in vocab:
            f.write(token + "\n")
    print(f"bert: {len(vocab)} wordpieces -> {out_dir}", file=sys.stderr)


def train_sentencepiece(texts, vocab_size: int, out_dir: str) -> None:
    import sentencepiece

    lines = (line for text in texts for line in text.split("\n") if line.strip())
    os.makedirs(out_dir, exist_ok=True)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, split_digits=True, num_threads=1, shuffle_input_sentence=False,
        pad_id=3, unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    with open(os.path.join(out_dir, "spm.model"), "wb") as f:
        f.write(model.getvalue())
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    print(f"sentencepiece: {len(processor)} pieces -> {out_dir}", file=sys.stderr)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train GPT-2 BPE, BERT WordPiece and SentencePiece files.")
    parser.add_argument("--input", required=True, help="JSON-lines corpus (.jsonl or .jsonl.gz)")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--types", nargs="+", default=["gpt2", "bert", "sentencepiece"],
                        choices=["gpt2", "bert", "sentencepiece"])
    parser.add_argument("--gpt2-vocab-size", type=int, default=8192)
    parser.add_argument("--bert-vocab-size", type=int, default=8192)
    parser.add_argument("--sentencepiece-vocab-size", type=int, default=8000)
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        raise SystemExit(f"error: --input {args.input} does not exist")
    texts = list(iter_texts(args.input, args.json_keys))
    if "gpt2" in args.types:
        train_gpt2_bpe(texts, args.gpt2_vocab_size, os.path.join(args.output_dir, "gpt2"))
    if "bert" in args.types:
        train_bert_wordpiece(texts, args.bert_vocab_size, os.path.join(args.output_dir, "bert"))
    if "sentencepiece" in args.types:
        train_sentencepiece(texts, args.sentencepiece_vocab_size, os.path.join(args.output_dir, "sentencepiece"))


if __name__ == "__main__":
    main()
