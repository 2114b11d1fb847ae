"""T5 span corruption (megatron-core's T5MaskedWordPieceDataset) on `_text_sentence` data from
tools/preprocess_data.py --split-sentences: sentinel placement, masked fraction and span lengths on a seeded run,
decoder inputs and labels on hand-computed cases, sample order across runs and DataLoader worker counts, the
SentencePiece tokenizer's sentinels, and the missing-sentinel error."""
import numpy
import pytest
import torch

from helpers.data_support import sample_texts, tokenizer_args, tokenizer_flags, write_jsonl
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.t5_dataset import (T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig,
                                               build_t5_sample)
from megatron.tokenizer import build_tokenizer

SE, SD = 128, 48


def _config(root, tokenizer, prefix, cache="cache", seed=1234):
    return T5MaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=SE, sequence_length_decoder=SD, blend=([prefix], None), split="98,2,0",
        path_to_cache=str(root / cache), tokenizer=tokenizer, masking_probability=0.15,
        short_sequence_probability=0.1, masking_max_ngram=10, masking_do_full_word=True,
        masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=True)


@pytest.fixture(scope="module")
def t5_setup(tmp_path_factory):
    from tools import preprocess_data

    root = tmp_path_factory.mktemp("t5")
    source = write_jsonl(str(root / "docs.jsonl"), sample_texts(60, max_chars=3000))
    assert preprocess_data.main(["--input", source, "--output-prefix", str(root / "t5"), "--split-sentences",
                                 "--workers", "1", *tokenizer_flags("BertWordPieceLowerCase")]) == 0
    tokenizer = build_tokenizer(tokenizer_args("BertWordPieceLowerCase", vocab_extra_ids=100))
    prefix = str(root / "t5_text_sentence")
    train, _, _ = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, [400, 10, None], lambda: True,
                                                _config(root, tokenizer, prefix)).build()
    return root, tokenizer, prefix, train


class _SyntheticTokenizer:
    """Reference 1.5's worked example: 500 ids, those = 0 mod 4 are '##' pieces; BOS 500, EOS 501, <extra_id_i>
    502 + i."""
    inv_vocab = {i: (f"##w{i}" if i % 4 == 0 else f"w{i}") for i in range(500)}
    cls, sep, pad, mask, bos, eos = 1, 2, 0, 3, 500, 501
    additional_special_tokens_ids = list(range(502, 512))
    unique_identifiers = {"class": "synthetic"}


def test_worked_example_and_hand_computed_assembly():
    # Reference 1.5 (confirmed by running Megatron 2023 and megatron-core 0.16.1): tokens 10..39, target 30,
    # se 32, sd 16, seed 1234: the budget is 4 tokens and words 19-22 (19 + the ## piece 20 ...) are masked.
    dataset = T5MaskedWordPieceDataset.__new__(T5MaskedWordPieceDataset)
    dataset.config = type("C", (), dict(tokenizer=_SyntheticTokenizer(), masking_probability=0.15,
                                        masking_max_ngram=10, masking_do_full_word=True,
                                        masking_use_longer_ngrams=False, masking_use_geometric_distribution=True))()
    tokens = list(range(10, 40))
    _, _, _, _, spans = dataset._create_masked_lm_predictions(tokens, 30, numpy.random.RandomState(1234))
    sample = build_t5_sample(tokens, spans, _SyntheticTokenizer(), 32, 16)
    assert sample["text_enc"].tolist() == list(range(10, 19)) + [502] + list(range(23, 40)) + [0] * 5
    assert sample["text_dec"].tolist() == [500, 502, 19, 20, 21, 22] + [0] * 10
    assert sample["labels"].tolist() == [502, 19, 20, 21, 22, 501] + [-1] * 10
    assert sample["loss_mask"].tolist() == [1] * 6 + [0] * 10

    # Two spans written by hand: tokens 5..11, spans {6, 7} and {10}; sentinels 502, 503; BOS 500, EOS 501.
    sample = build_t5_sample([5, 6, 7, 8, 9, 10, 11], [([1, 2], [6, 7]), ([5], [10])], _SyntheticTokenizer(), 8, 8)
    assert sample["text_enc"].tolist() == [5, 502, 8, 9, 503, 11, 0, 0]
    assert sample["text_dec"].tolist() == [500, 502, 6, 7, 503, 10, 0, 0]
    assert sample["labels"].tolist() == [502, 6, 7, 503, 10, 501, -1, -1]
    assert sample["enc_mask"].tolist() == [1] * 6 + [0] * 2 and sample["dec_mask"].tolist() == [1] * 6 + [0] * 2
    with pytest.raises(ValueError, match="--encoder-seq-length 5"):
        build_t5_sample([5, 6, 7, 8, 9, 10, 11], [([1, 2], [6, 7])], _SyntheticTokenizer(), 5, 8)


def test_sentinels_masked_fraction_and_span_lengths(t5_setup):
    root, tokenizer, prefix, train = t5_setup
    sentinels = tokenizer.additional_special_tokens_ids
    assert sentinels == list(range(tokenizer.eos + 1, tokenizer.eos + 101))  # after [BOS], [EOS]
    sentinel_pos = {s: i for i, s in enumerate(sentinels)}
    inv = tokenizer.inv_vocab
    fractions, span_words, spans_per_sample = [], [], []
    for idx in range(300):
        item = train[idx]
        beg, end, target = (int(x) for x in train.sample_index[idx])
        original = [int(t) for i in range(beg, end) for t in train.dataset[i]][:target]
        ne, nd = int(item["enc_mask"].sum()), int(item["loss_mask"].sum())
        enc, dec, labels = item["text_enc"][:ne].tolist(), item["text_dec"][:nd].tolist(), item["labels"][:nd].tolist()
        assert (item["text_enc"][ne:] == 0).all() and (item["text_dec"][nd:] == 0).all()
        assert (item["labels"][nd:] == -1).all() and item["dec_mask"].tolist() == item["loss_mask"].tolist()
        # Decoder input = [BOS] + labels without [EOS]; sentinels in order 0, 1, ... in encoder and decoder.
        assert dec[0] == tokenizer.bos and labels[-1] == tokenizer.eos and dec[1:] == labels[:-1]
        enc_sent = [sentinel_pos[t] for t in enc if t in sentinel_pos]
        dec_sent = [sentinel_pos[t] for t in dec if t in sentinel_pos]
        assert enc_sent == dec_sent == list(range(len(enc_sent)))  # none when no whole word fits the budget
        assert tokenizer.mask not in enc
        # Filling each sentinel with its span gives back the original tokens.
        spans, current = [], None
        for t in labels[:-1]:
            if t in sentinel_pos:
                current = []
                spans.append(current)
            else:
                current.append(t)
        rebuilt = []
        for t in enc:
            rebuilt += spans[sentinel_pos[t]] if t in sentinel_pos else [t]
        assert rebuilt == original
        # Whole words: a span never starts with a '##' piece nor is followed by one.
        masked = sum(len(s) for s in spans)
        budget = min(0.15 * target, max(1, round(0.15 * len(original))))
        assert masked <= budget
        fractions.append(masked / len(original))
        spans_per_sample.append(len(spans))
        for span in spans:
            assert not inv[span[0]].startswith("##")
            span_words.append(sum(1 for t in span if not inv[t].startswith("##")))
        pos = 0
        for t in enc:
            if t in sentinel_pos:
                pos += len(spans[sentinel_pos[t]])
                assert pos >= len(original) or not inv[original[pos]].startswith("##")
            else:
                pos += 1
    span_words = numpy.array(span_words)
    stats = dict(mean_fraction=float(numpy.mean(fractions)), mean_words=float(span_words.mean()),
                 max_words=int(span_words.max()), one_word=float((span_words == 1).mean()),
                 spans_per_sample=float(numpy.mean(spans_per_sample)))
    print(f"T5 span corruption over 300 samples: {stats}")
    # 15 % of the tokens (rounding down the budget by whole words): between 12 % and 15 %.
    assert 0.12 <= stats["mean_fraction"] <= 0.15
    # n = min(Geometric(0.2), 10) words, shortened to fit the budget: at most 10 words, long spans occur,
    # and P(1 word) is at least the geometric 0.2.
    assert stats["max_words"] <= 10 and (span_words >= 5).mean() > 0.1
    assert 0.2 <= stats["one_word"] <= 0.6 and 2.0 <= stats["mean_words"] <= 4.5


def test_sample_order_across_runs_and_workers(t5_setup):
    root, tokenizer, prefix, train = t5_setup
    # A second build (fresh cache directory) gives the same sample index and samples.
    again, _, _ = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, [400, 10, None], lambda: True,
                                                _config(root, tokenizer, prefix, cache="cache2")).build()
    assert numpy.array_equal(again.sample_index, train.sample_index)
    # Different seeds give different samples.
    other, _, _ = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, [400, 10, None], lambda: True,
                                                _config(root, tokenizer, prefix, cache="cache3", seed=7)).build()
    assert not numpy.array_equal(other[0]["text_enc"], train[0]["text_enc"])

    def batches(dataset, workers):
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, range(48)), batch_size=8,
                                             num_workers=workers)
        return [{k: v.clone() for k, v in b.items()} for b in loader]

    zero, two = batches(train, 0), batches(again, 2)
    assert len(zero) == len(two) == 6
    for a, b in zip(zero, two):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_sentencepiece_sentinels_and_missing_sentinels(t5_setup, tmp_path):
    root, _, prefix, _ = t5_setup
    spm = build_tokenizer(tokenizer_args("SentencePieceTokenizer", vocab_extra_ids=5))
    ids = spm.additional_special_tokens_ids
    assert len(ids) == 5 and [spm.inv_vocab[i] for i in ids] == [f"<extra_id_{i}>" for i in range(5)]
    assert spm.bos is not None and spm.eos is not None and spm.vocab_size > max(ids)
    # Token-level candidates (no '##' pieces): the SentencePiece tokens of a sentence are corrupted as a sample.
    dataset = T5MaskedWordPieceDataset.__new__(T5MaskedWordPieceDataset)
    dataset.config = type("C", (), dict(tokenizer=spm, masking_probability=0.15, masking_max_ngram=10,
                                        masking_do_full_word=True, masking_use_longer_ngrams=False,
                                        masking_use_geometric_distribution=True))()
    tokens = spm.tokenize(" ".join(sample_texts(1, max_chars=400)))[:60]
    _, _, _, _, spans = dataset._create_masked_lm_predictions(tokens, 60, numpy.random.RandomState(3))
    sample = build_t5_sample(tokens, spans, spm, 64, 32)
    assert sample["text_dec"][0] == spm.bos and ids[0] in sample["text_enc"].tolist()

    bert_plain = build_tokenizer(tokenizer_args("BertWordPieceLowerCase"))
    with pytest.raises(ValueError, match="--vocab-extra-ids 100") as error:
        _config(root, bert_plain, prefix)
    assert "\n" not in str(error.value)
