"""BERT samples: layout and special tokens, masking statistics (15 %, 80/10/10, whole words), sentence order."""
import numpy
import pytest

from helpers.data_support import sample_texts, tokenizer_args, tokenizer_flags, write_jsonl
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.tokenizer import build_tokenizer

SEQ = 64


@pytest.fixture(scope="module")
def bert_setup(tmp_path_factory):
    from tools import preprocess_data

    root = tmp_path_factory.mktemp("bert")
    source = write_jsonl(str(root / "docs.jsonl"), sample_texts(150, max_chars=3000))
    assert preprocess_data.main(["--input", source, "--output-prefix", str(root / "bert"), "--split-sentences",
                                 "--workers", "1", *tokenizer_flags("BertWordPieceLowerCase")]) == 0
    tokenizer = build_tokenizer(tokenizer_args("BertWordPieceLowerCase"))
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=1234, sequence_length=SEQ, blend=([str(root / "bert_text_sentence")], None), split="98,2,0",
        path_to_cache=str(root / "cache"), tokenizer=tokenizer, masking_probability=0.15,
        short_sequence_probability=0.1, masking_max_ngram=3, masking_do_full_word=True,
        masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
        classification_head=True)
    train, valid, _ = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, [600, 20, None], lambda: True,
                                                    config).build()
    return tokenizer, train, valid


def test_samples_layout_and_special_tokens(bert_setup):
    tokenizer, train, valid = bert_setup
    # BERT splits by document: 150 documents -> round(0.98 * 150) = 147 for training.
    assert len(train.indices) == 147 and valid.indices.tolist() == [147, 148, 149]
    assert len(train) >= 600 and train.sample_index.shape[1] == 3
    specials = {tokenizer.cls, tokenizer.sep, tokenizer.pad}
    for idx in range(200):
        item = train[idx]
        text, types, labels = item["text"], item["types"], item["labels"]
        n = int(item["padding_mask"].sum())
        assert text.shape == types.shape == labels.shape == (SEQ,)
        assert item["padding_mask"].tolist() == [1] * n + [0] * (SEQ - n)
        assert (text[n:] == tokenizer.pad).all() and text[0] == tokenizer.cls and text[n - 1] == tokenizer.sep
        seps = numpy.flatnonzero(text[:n] == tokenizer.sep).tolist()
        first_sep = seps[0]
        # [CLS] A [SEP] has type 0, B [SEP] type 1.
        assert types[:first_sep + 1].tolist() == [0] * (first_sep + 1)
        assert types[first_sep + 1:n].tolist() == [1] * (n - first_sep - 1)
        assert n - 3 <= int(train.sample_index[idx][2]) and first_sep < n - 1  # two non-empty segments
        assert item["loss_mask"].tolist() == (labels != -1).astype(int).tolist()
        assert not specials & set(labels[labels != -1].tolist())  # special tokens are never predicted
        assert item["is_random"] in (0, 1) and item["truncated"] in (0, 1)
    assert all(numpy.array_equal(train[7][k], v) for k, v in train[7].items() if k not in ("is_random", "truncated"))


def test_masking_statistics_and_whole_words(bert_setup):
    tokenizer, train, _ = bert_setup
    inv = tokenizer.inv_vocab
    special = {tokenizer.cls, tokenizer.sep}
    predicted = tokens = masked = kept = random_order = 0
    for idx in range(600):
        item = train[idx]
        text, labels = item["text"], item["labels"]
        n = int(item["padding_mask"].sum())
        positions = numpy.flatnonzero(labels != -1)
        predicted += len(positions)
        tokens += n
        masked += int((text[positions] == tokenizer.mask).sum())
        kept += int((text[positions] == labels[positions]).sum())
        random_order += item["is_random"]
        original = numpy.where(labels != -1, labels, text)
        for i in positions:
            if inv[int(original[i])].startswith("##"):
                # The word's first piece (skipping special tokens) is predicted too: whole-word masking.
                j = i - 1
                while j > 0 and (int(original[j]) in special or inv[int(original[j])].startswith("##")):
                    j -= 1
                if j > 0:
                    assert labels[j] != -1, (idx, i, j)
    assert 0.12 <= predicted / tokens <= 0.155
    assert masked / predicted == pytest.approx(0.8, abs=0.04)
    assert kept / predicted == pytest.approx(0.1, abs=0.03)
    assert random_order / 600 == pytest.approx(0.5, abs=0.07)


def test_short_sequences_follow_short_seq_prob(bert_setup):
    _, train, _ = bert_setup
    targets = train.sample_index[:, 2]
    short = float((targets < SEQ - 3).mean())
    assert 0.04 <= short <= 0.2
    assert targets.min() >= 2 and targets.max() == SEQ - 3
