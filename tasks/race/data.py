"""RACE: each data path is a directory; every ``*.txt`` in it (sorted by name) holds one JSON object per line::

    {"article": "...", "questions": ["...", ...], "options": [["a", "b", "c", "d"], ...], "answers": ["B", ...]}

Per question: label = ``ord(answer) - ord('A')``; per option ``qa`` = the question with ``_`` replaced by the
option when it has a blank, else ``question + ' ' + option``; cleaned, tokenized and cut to 128 tokens; the sample
is ``[CLS] qa [SEP] article [SEP]`` (article cleaned and tokenized once, cut to fit ``--seq-length``). A sample
holds the 4 choices: ``text``/``types``/``padding_mask`` arrays ``[4, seq_length]``; ``uid`` is its running index.
``sample_multiplier = 4`` folds the choices into the batch dimension of the model.
"""
from __future__ import annotations

import glob
import json
import os
import time

from torch.utils.data import Dataset

from megatron.training.errors import ConfigurationError
from megatron.training.utils import print_rank_0
from tasks.data_utils import build_sample, build_tokens_types_paddings_from_ids, clean_text

NUM_CHOICES = 4
MAX_QA_LENGTH = 128


def name_from_datapath(datapath: str) -> str:
    """Megatron's dataset name: the path after the last ``RACE``, ``/`` stripped, inner ``/`` -> ``-``."""
    return datapath.split("RACE")[-1].strip("/").replace("/", "-")


def read_race_dir(datapath):
    """``[(file, line number, article, questions, options, labels), ...]`` of a RACE directory, checked; a
    malformed line raises a one-line ConfigurationError naming the file and line."""
    if not os.path.isdir(datapath):
        raise ConfigurationError(f"{datapath} is not a directory (RACE data paths are directories of *.txt files)")
    filenames = sorted(glob.glob(os.path.join(datapath, "*.txt")))
    if not filenames:
        raise ConfigurationError(f"{datapath} holds no *.txt files")
    documents = []
    for filename in filenames:
        with open(filename, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                documents.append((filename, line_number) + _parse_line(filename, line_number, line))
    return documents


def _parse_line(filename, line_number, line):
    def error(message):
        return ConfigurationError(f"{filename} line {line_number}: {message}")

    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, dict):
        raise error("expected a JSON object with article, questions, options, answers")
    missing = [k for k in ("article", "questions", "options", "answers") if k not in data]
    if missing:
        raise error(f"missing key(s) {', '.join(missing)}")
    article, questions, options, answers = data["article"], data["questions"], data["options"], data["answers"]
    if not isinstance(article, str) or not isinstance(questions, list) or not isinstance(options, list) \
            or not isinstance(answers, list):
        raise error("article must be a string; questions, options and answers lists")
    if not len(questions) == len(options) == len(answers):
        raise error(f"{len(questions)} questions, {len(options)} option lists and {len(answers)} answers: they "
                    "must be as many")
    labels = []
    for qi, (question, choices, answer) in enumerate(zip(questions, options, answers)):
        if not isinstance(question, str):
            raise error(f"question {qi} is not a string")
        if not isinstance(choices, list) or len(choices) != NUM_CHOICES or \
                not all(isinstance(c, str) for c in choices):
            raise error(f"question {qi} needs {NUM_CHOICES} options (strings)")
        label = ord(answer) - ord("A") if isinstance(answer, str) and len(answer) == 1 else -1
        if not 0 <= label < NUM_CHOICES:
            raise error(f"answer {qi} is {answer!r}; expected one of A, B, C, D")
        labels.append(label)
    return article, questions, options, labels


def process_single_datapath(datapath, tokenizer, max_qa_length, max_seq_length):
    print_rank_0("   > working on {}".format(datapath))
    start_time = time.time()
    samples, num_docs, num_questions = [], 0, 0
    for _, _, article, questions, options, labels in read_race_dir(datapath):
        num_docs += 1
        context_ids = tokenizer.tokenize(clean_text(article))
        for question, choices, label in zip(questions, options, labels):
            num_questions += 1
            ids_list, types_list, paddings_list = [], [], []
            for choice in choices:
                qa = question.replace("_", choice) if "_" in question else " ".join([question, choice])
                qa_ids = tokenizer.tokenize(clean_text(qa))[:max_qa_length]
                ids, types, paddings = build_tokens_types_paddings_from_ids(
                    qa_ids, context_ids, max_seq_length, tokenizer.cls, tokenizer.sep, tokenizer.pad)
                ids_list.append(ids)
                types_list.append(types)
                paddings_list.append(paddings)
            samples.append(build_sample(ids_list, types_list, paddings_list, label, len(samples)))
    print_rank_0("    > processed {} document, {} questions, and {} samples in {:.2f} seconds".format(
        num_docs, num_questions, len(samples), time.time() - start_time))
    return samples


class RaceDataset(Dataset):
    """``RaceDataset(dataset_name, datapaths, tokenizer, max_seq_length, max_qa_length=128)``."""

    def __init__(self, dataset_name, datapaths, tokenizer, max_seq_length, max_qa_length=MAX_QA_LENGTH):
        self.dataset_name = dataset_name
        print_rank_0(" > building RACE dataset for {}:".format(self.dataset_name))
        print_rank_0("  > paths: " + " ".join(datapaths))
        self.samples = []
        for datapath in datapaths:
            self.samples.extend(process_single_datapath(datapath, tokenizer, max_qa_length, max_seq_length))
        print_rank_0("  >> total number of samples: {}".format(len(self.samples)))
        # Each sample holds NUM_CHOICES sequences that the model folds into the batch dimension.
        self.sample_multiplier = NUM_CHOICES

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        return self.samples[idx]
