"""QQP (GLUE): ``train.tsv``, ``dev.tsv`` (``id qid1 qid2 question1 question2 is_duplicate``), ``test.tsv``
(``id question1 question2``).

The first line is the header: 3 columns make a test file (label 0 for every sample), otherwise it must have 6.
In a train/dev file a row of another width, or with an empty question, is skipped with Megatron's
``***WARNING***`` line (here with its line number), as the public QQP files have a few such rows. Labels 0, 1.
"""
from __future__ import annotations

from megatron.training.utils import print_rank_0
from tasks.data_utils import clean_text
from tasks.glue.data import GLUEAbstractDataset, parse_uid, row_error

LABELS = [0, 1]
TEST_LABEL = 0


class QQPDataset(GLUEAbstractDataset):
    def __init__(self, name, datapaths, tokenizer, max_seq_length, test_label=TEST_LABEL):
        self.test_label = test_label
        super().__init__("QQP", name, datapaths, tokenizer, max_seq_length)

    @classmethod
    def process_rows(cls, path, rows, verbose=False):
        samples = []
        if not rows:
            return samples
        header_line, header = rows[0]
        is_test = len(header) == 3
        if not is_test and len(header) != 6:
            raise row_error(path, header_line, f"the QQP header has {len(header)} tab-separated columns; expected 6 "
                                               "(id qid1 qid2 question1 question2 is_duplicate) or 3 (test: id "
                                               "question1 question2)")
        if verbose:
            print_rank_0("   reading {}, {}, {}{}".format(
                header[0].strip(), header[-2 if is_test else 3].strip(), header[-1 if is_test else 4].strip(),
                f" and setting labels to {TEST_LABEL}" if is_test else f", and {header[5].strip()} columns"))

        def warn(line, what, row):
            if verbose:
                print_rank_0(f"***WARNING*** {what}, skipping line {line} of {path}: {row}")

        for line, row in rows[1:]:
            if is_test:
                if len(row) != 3:
                    raise row_error(path, line, f"{len(row)} tab-separated columns; a QQP test row has 3")
                uid, text_a, text_b, label = parse_uid(path, line, row[0], 1), row[1], row[2], TEST_LABEL
                text_a, text_b = clean_text(text_a.strip()), clean_text(text_b.strip())
                if not text_a or not text_b:
                    raise row_error(path, line, "empty question")
            else:
                if len(row) != 6:
                    warn(line, "index error", row)
                    continue
                uid = parse_uid(path, line, row[0], 1)
                text_a, text_b = clean_text(row[3].strip()), clean_text(row[4].strip())
                if not text_a:
                    warn(line, "zero length a", row)
                    continue
                if not text_b:
                    warn(line, "zero length b", row)
                    continue
                try:
                    label = int(row[5].strip())
                except ValueError:
                    raise row_error(path, line, f"is_duplicate (column 6) is not 0 or 1: {row[5].strip()!r}") from None
            if label not in LABELS:
                raise row_error(path, line, f"is_duplicate (column 6) is not 0 or 1: {label}")
            samples.append({"uid": uid, "text_a": text_a, "text_b": text_b, "label": label})
            if verbose and len(samples) % 50000 == 0:
                print_rank_0("  > processed {} so far ...".format(len(samples)))
        return samples
