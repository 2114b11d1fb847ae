"""MNLI (GLUE): ``train.tsv``, ``dev_matched.tsv``, ``dev_mismatched.tsv``, ``test_*.tsv``.

The first line is the header. A file whose header has 10 columns is a test file (no gold label: every sample gets
the label ``contradiction``). Data rows: column 1 (index) is the integer id, columns 9 and 10 are sentence1 and
sentence2 (cleaned with ``clean_text``), the last column is the gold label. Labels: contradiction 0,
entailment 1, neutral 2.
"""
from __future__ import annotations

from megatron.training.utils import print_rank_0
from tasks.data_utils import clean_text
from tasks.glue.data import GLUEAbstractDataset, parse_uid, row_error

LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}
TEST_LABEL = "contradiction"


class MNLIDataset(GLUEAbstractDataset):
    def __init__(self, name, datapaths, tokenizer, max_seq_length, test_label=TEST_LABEL):
        self.test_label = test_label
        super().__init__("MNLI", name, datapaths, tokenizer, max_seq_length)

    @classmethod
    def process_rows(cls, path, rows, verbose=False):
        samples = []
        if not rows:
            return samples
        header_line, header = rows[0]
        is_test = len(header) == 10
        if len(header) < 10:
            raise row_error(path, header_line, f"the MNLI header has {len(header)} tab-separated columns; MNLI files "
                                               "have at least 10 (sentence1 and sentence2 are columns 9 and 10)")
        if verbose:
            print_rank_0("   reading {}, {} and {} columns{}".format(
                header[0].strip(), header[8].strip(), header[9].strip(),
                f" and setting labels to {TEST_LABEL}" if is_test else f", label from {header[-1].strip()}"))
        for line, row in rows[1:]:
            if len(row) < 10:
                raise row_error(path, line, f"{len(row)} tab-separated columns; an MNLI row needs at least 10")
            uid = parse_uid(path, line, row[0], 1)
            text_a, text_b = clean_text(row[8].strip()), clean_text(row[9].strip())
            if not text_a or not text_b:
                which = "sentence1 (column 9)" if not text_a else "sentence2 (column 10)"
                raise row_error(path, line, f"empty {which}")
            label = TEST_LABEL if is_test else row[-1].strip()
            if label not in LABELS:
                raise row_error(path, line, f"label {label!r} (last column) is not one of {', '.join(LABELS)}")
            samples.append({"uid": uid, "text_a": text_a, "text_b": text_b, "label": LABELS[label]})
            if verbose and len(samples) % 50000 == 0:
                print_rank_0("  > processed {} so far ...".format(len(samples)))
        return samples
