"""GLUE datasets: TSV rows read once (``read_tsv``), tokenized per item into BERT pair samples.

A task subclass implements ``process_rows(path, rows)`` -> raw samples ``{uid, text_a, text_b, label}``; rows are
``(line number, columns)`` with Megatron's splitting (``line.strip().split('\\t')``; blank lines are skipped). A row
that cannot be a sample raises a one-line ConfigurationError naming the file and line.
"""
from __future__ import annotations

from torch.utils.data import Dataset

from megatron.training.errors import ConfigurationError
from megatron.training.utils import print_rank_0
from tasks.data_utils import build_sample, build_tokens_types_paddings_from_text


def read_tsv(path):
    """``[(line number, columns), ...]`` of a TSV file (1-based line numbers, blank lines left out)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise ConfigurationError(f"{path}: cannot be read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise ConfigurationError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    return [(n, line.strip().split("\t")) for n, line in enumerate(lines, start=1) if line.strip()]


def row_error(path, line, message):
    return ConfigurationError(f"{path} line {line}: {message}")


def parse_uid(path, line, value, column):
    try:
        uid = int(value.strip())
    except ValueError:
        raise row_error(path, line, f"the id in column {column} is not an integer: {value.strip()!r}") from None
    if uid < 0:
        raise row_error(path, line, f"the id in column {column} is negative: {uid}")
    return uid


def name_from_datapath(datapath: str, task: str) -> str:
    """Megatron's dataset name: the path after the last ``task`` (``MNLI``/``QQP``), ``.tsv``-characters stripped
    from both ends (a character-set strip, as Megatron), then ``/``; ``_`` becomes ``-`` (``dev_matched.tsv`` ->
    ``dev-matched``)."""
    return datapath.split(task)[-1].strip(".tsv").strip("/").replace("_", "-")


class GLUEAbstractDataset(Dataset):
    """``GLUEAbstractDataset(task_name, dataset_name, datapaths, tokenizer, max_seq_length)``."""

    def __init__(self, task_name, dataset_name, datapaths, tokenizer, max_seq_length):
        self.task_name = task_name
        self.dataset_name = dataset_name
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        print_rank_0(" > building {} dataset for {}:".format(self.task_name, self.dataset_name))
        print_rank_0("  > paths: " + " ".join(datapaths))
        self.samples = []
        for datapath in datapaths:
            self.samples.extend(self.process_samples_from_single_path(datapath))
        print_rank_0("  >> total number of samples: {}".format(len(self.samples)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        raw = self.samples[idx]
        ids, types, paddings = build_tokens_types_paddings_from_text(raw["text_a"], raw["text_b"], self.tokenizer,
                                                                     self.max_seq_length)
        return build_sample(ids, types, paddings, raw["label"], raw["uid"])

    def process_samples_from_single_path(self, datapath):
        print_rank_0(" > Processing {} ...".format(datapath))
        samples = self.process_rows(datapath, read_tsv(datapath), verbose=True)
        print_rank_0(" >> processed {} samples.".format(len(samples)))
        return samples

    @classmethod
    def process_rows(cls, path, rows, verbose=False):
        raise NotImplementedError
