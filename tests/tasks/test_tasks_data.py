"""Task data files and flags, in one process: GLUE TSV parsing (headers, labels, bad rows with line numbers),
RACE directories, LAMBADA / WikiText samples and windows, Megatron's sample layout, detokenizer rules, and the
one-line errors of tasks/main.py (checked before any process group)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import child_pythonpath

from megatron.training.arguments import parse_args
from megatron.training.errors import ConfigurationError
from tasks.data_utils import build_tokens_types_paddings_from_ids, clean_text
from tasks.glue.data import name_from_datapath, read_tsv
from tasks.glue.mnli import MNLIDataset
from tasks.glue.qqp import QQPDataset
from tasks.main import get_tasks_args, task_ckpt_format, validate_task_args
from tasks.race.data import RaceDataset, name_from_datapath as race_name
from tasks.zeroshot_gpt.datasets import _LambadaDataset, _LMDataset
from tasks.zeroshot_gpt.detokenizer import get_detokenizer, ptb_detokenizer, wikitext_detokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MNLI_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
               "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n")


def mnli_row(i, s1, s2, label):
    return "\t".join([str(i), "0", "0e", "fiction", "(", "(", "(", "(", s1, s2, label, label]) + "\n"


class WordTokenizer:
    """Words -> ids by a growing table (ids from 10); [CLS]=1, [SEP]=2, [PAD]=0."""

    cls, sep, pad, eod = 1, 2, 0, 3

    def __init__(self):
        self.table = {}

    def tokenize(self, text):
        return [self.table.setdefault(w, 10 + len(self.table)) for w in text.split()]


def test_clean_text_and_sample_layout():
    assert clean_text("a\nb   c . d . e") == "a b c. d. e"
    # [CLS] A [SEP] B [SEP] + padding; types padded with the pad id (7 here, to see it)
    ids, types, pads = build_tokens_types_paddings_from_ids([5, 6], [8], 8, 1, 2, 7)
    assert ids == [1, 5, 6, 2, 8, 2, 7, 7] and types == [0, 0, 0, 0, 1, 1, 7, 7] and pads == [1] * 6 + [0, 0]
    # without B: no closing [SEP]
    ids, types, pads = build_tokens_types_paddings_from_ids([5, 6], None, 5, 1, 2, 0)
    assert ids == [1, 5, 6, 0, 0] and types == [0, 0, 0, 0, 0] and pads == [1, 1, 1, 0, 0]
    # too long: cut to L - 1 then [SEP] (type 1 with B, 0 without)
    ids, types, pads = build_tokens_types_paddings_from_ids([5, 6, 7], [8, 9], 5, 1, 2, 0)
    assert ids == [1, 5, 6, 7, 2] and types == [0, 0, 0, 0, 1] and pads == [1] * 5
    ids, types, _ = build_tokens_types_paddings_from_ids([5, 6, 7, 8], None, 4, 1, 2, 0)
    assert ids == [1, 5, 6, 2] and types == [0, 0, 0, 0]


def test_mnli_and_qqp_parsing(tmp_path):
    train = tmp_path / "MNLI" / "train.tsv"
    train.parent.mkdir()
    train.write_text(MNLI_HEADER + mnli_row(0, "A cat .", "An animal .", "entailment")
                     + mnli_row(1, "A  dog   .", "x", "neutral") + "\n"
                     + mnli_row(7, "It rains .", "It is dry .", "contradiction"))
    rows = MNLIDataset.process_rows(str(train), read_tsv(str(train)))
    assert [(r["uid"], r["label"], r["text_a"]) for r in rows] == [(0, 1, "A cat ."), (1, 2, "A dog ."),
                                                                   (7, 0, "It rains .")]
    test_file = tmp_path / "MNLI" / "test_matched.tsv"
    test_file.write_text("\t".join(f"c{i}" for i in range(10)) + "\n"
                         + "\t".join(["3", "0", "0e", "g", "(", "(", "(", "(", "s one", "s two"]) + "\n")
    (sample,) = MNLIDataset.process_rows(str(test_file), read_tsv(str(test_file)))
    assert sample == {"uid": 3, "text_a": "s one", "text_b": "s two", "label": 0}  # test files: contradiction
    assert name_from_datapath("/data/glue_data/MNLI/dev_matched.tsv", "MNLI") == "dev-matched"
    assert name_from_datapath("/data/glue_data/MNLI/train.tsv", "MNLI") == "train"
    # Megatron strips the *characters* of '.tsv': QQP's dev.tsv is named 'de'
    assert name_from_datapath("/data/glue_data/QQP/dev.tsv", "QQP") == "de"

    qqp = tmp_path / "dev.tsv"
    qqp.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                   "5\t1\t2\tWhat is x?\tWhat's x?\t1\n"
                   "6\t3\t4\ttoo few columns\n"
                   "7\t5\t6\t\tempty first\t0\n"
                   "8\t7\t8\tWhy?\tHow?\t0\n")
    rows = QQPDataset.process_rows(str(qqp), read_tsv(str(qqp)))
    assert [(r["uid"], r["label"], r["text_a"]) for r in rows] == [(5, 1, "What is x?"), (8, 0, "Why?")]


def test_glue_dataset_items():
    tok = WordTokenizer()
    ds = MNLIDataset.__new__(MNLIDataset)
    ds.samples, ds.tokenizer, ds.max_seq_length = [{"uid": 4, "text_a": "a b", "text_b": "c", "label": 2}], tok, 8
    item = ds[0]
    assert item["text"].tolist() == [1, 10, 11, 2, 12, 2, 0, 0] and item["label"] == 2 and item["uid"] == 4
    assert item["padding_mask"].tolist() == [1, 1, 1, 1, 1, 1, 0, 0] and item["text"].dtype == np.int64


@pytest.mark.parametrize("content,message", [
    (MNLI_HEADER + mnli_row(0, "a", "b", "entailment") + mnli_row(1, "a", "b", "maybe"),
     "line 3: label 'maybe' (last column) is not one of contradiction, entailment, neutral"),
    (MNLI_HEADER + mnli_row(0, "a", "b", "entailment").replace("0", "x", 1), "line 2: the id in column 1 is not an "
                                                                             "integer: 'x'"),
    (MNLI_HEADER + "1\t2\t3\n", "line 2: 3 tab-separated columns; an MNLI row needs at least 10"),
    (MNLI_HEADER + mnli_row(0, "  ", "b", "neutral"), "line 2: empty sentence1 (column 9)"),
    ("a\tb\n", "line 1: the MNLI header has 2 tab-separated columns"),
])
def test_mnli_bad_rows_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "train.tsv"
    path.write_text(content)
    args = parse_args(get_tasks_args, argv=["--task", "MNLI", "--epochs", "1", "--seq-length", "16",
                                            "--train-data", str(path), "--valid-data", str(path)])
    with pytest.raises(ConfigurationError) as e:
        validate_task_args(args)
    assert str(e.value).startswith(f"--train-data: {path} {message}")
    assert "\n" not in str(e.value)


def test_qqp_bad_label(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n5\t1\t2\ta\tb\t2\n")
    args = parse_args(get_tasks_args, argv=["--task", "QQP", "--epochs", "0", "--seq-length", "16",
                                            "--valid-data", str(path)])
    with pytest.raises(ConfigurationError, match=rf"^--valid-data: {path} line 2: is_duplicate \(column 6\) is not 0 "
                                                 r"or 1: 2$"):
        validate_task_args(args)


def _race_line(**overrides):
    record = {"article": "The cat sat .\nIt slept .", "questions": ["Where did it _ ?", "Who slept"],
              "options": [["sit", "run", "go", "fly"], ["cat", "dog", "cow", "hen"]], "answers": ["A", "C"]}
    record.update(overrides)
    return json.dumps(record) + "\n"


def test_race_directory(tmp_path):
    d = tmp_path / "RACE" / "dev" / "middle"
    d.mkdir(parents=True)
    (d / "b.txt").write_text(_race_line())
    (d / "a.txt").write_text(_race_line(answers=["D", "B"]))
    (d / "notes.md").write_text("ignored")
    tok = WordTokenizer()
    ds = RaceDataset(race_name(str(d)), [str(d)], tok, 16)
    assert ds.dataset_name == "dev-middle" and ds.sample_multiplier == 4 and len(ds) == 4
    assert [s["label"] for s in ds.samples] == [3, 1, 0, 2]  # files in name order: a.txt, b.txt
    assert [s["uid"] for s in ds.samples] == [0, 1, 2, 3]
    first = ds[0]
    assert first["text"].shape == (4, 16)
    # "Where did it _ ?" with option "sit" -> "Where did it sit ?"; then the article (cleaned, tokenized once)
    words = {v: k for k, v in tok.table.items()}
    decoded = [words.get(i, {1: "[CLS]", 2: "[SEP]", 0: "[PAD]"}.get(i)) for i in first["text"][0].tolist()]
    assert decoded == ["[CLS]", "Where", "did", "it", "sit", "?", "[SEP]", "The", "cat", "sat.", "It", "slept",
                       ".", "[SEP]", "[PAD]", "[PAD]"]
    assert first["types"][0].tolist()[:8] == [0] * 7 + [1]
    second_question = [words.get(i) for i in ds[1]["text"][1].tolist()[1:4]]
    assert second_question == ["Who", "slept", "run"] or second_question[:2] == ["Who", "slept"]


@pytest.mark.parametrize("line,message", [
    ("{not json\n", "line 2: not valid JSON"),
    (_race_line(answers=["E", "A"]), "line 2: answer 0 is 'E'; expected one of A, B, C, D"),
    (_race_line(options=[["a", "b", "c"], ["a", "b", "c", "d"]]), "line 2: question 0 needs 4 options"),
    (_race_line(answers=["A"]), "line 2: 2 questions, 2 option lists and 1 answers"),
    (json.dumps({"article": "x"}) + "\n", "line 2: missing key(s) questions, options, answers"),
])
def test_race_bad_lines(tmp_path, line, message):
    d = tmp_path / "train"
    d.mkdir()
    (d / "x.txt").write_text(_race_line() + line)
    args = parse_args(get_tasks_args, argv=["--task", "RACE", "--epochs", "1", "--seq-length", "16",
                                            "--train-data", str(d), "--valid-data", str(d)])
    with pytest.raises(ConfigurationError) as e:
        validate_task_args(args)
    assert str(e.value).startswith(f"--train-data: {d / 'x.txt'} {message}"), str(e.value)


def test_task_flag_errors(tmp_path):
    wiki = tmp_path / "wiki.valid.tokens"
    wiki.write_text("hello")
    cases = [
        (["--task", "SQUAD"], "--task SQUAD: Task SQUAD is not implemented; choose one of LAMBADA, WIKITEXT103, "
                              "MNLI, QQP, RACE"),
        (["--task", "RET-FINETUNE-NQ"], "--task RET-FINETUNE-NQ: Megatron's ORQA retriever tasks are not "
                                        "implemented"),
        (["--task", "MNLI", "--seq-length", "8", "--valid-data", str(wiki)], "--epochs: --task MNLI finetunes"),
        (["--task", "MNLI", "--epochs", "1", "--ckpt-format", "torch_dist"], "--ckpt-format torch_dist: the MNLI "
                                                                             "classifier is a legacy model"),
        (["--task", "RACE", "--epochs", "1", "--seq-length", "8", "--valid-data", str(tmp_path)],
         "--train-data: --task RACE with --epochs 1 needs training files"),
        (["--task", "WIKITEXT103", "--valid-data", str(tmp_path / "missing.txt")], "--valid-data "),
        (["--task", "WIKITEXT103", "--valid-data", str(tmp_path / "x.wiki"), str(wiki)], "--valid-data: --task "
                                                                                        "WIKITEXT103 evaluates one"),
        (["--task", "LAMBADA", "--valid-data", str(wiki)], f"--valid-data: {wiki} line 1: not valid JSON"),
    ]
    dist = tmp_path / "bert_dist"
    (dist / "iter_0000003").mkdir(parents=True)
    (dist / "iter_0000003" / "metadata.json").write_text("{}")
    (dist / "latest_checkpointed_iteration.txt").write_text("3")
    cases.append((["--task", "QQP", "--epochs", "1", "--seq-length", "8", "--pretrained-checkpoint", str(dist)],
                  f"--pretrained-checkpoint {dist} is a torch_dist checkpoint; the QQP classifier (a legacy model) "
                  f"loads the torch format: convert it with python tools/checkpoint/convert.py --model-type BERT "
                  f"--loader torch_dist --saver legacy --load-dir {dist} --save-dir {dist}_torch"))
    plain = tmp_path / "held_out.txt"
    plain.write_text("x")
    cases.append((["--task", "WIKITEXT103", "--valid-data", str(plain)], "--valid-data " + str(plain) + ": the "
                  "WIKITEXT103 detokenizer is chosen by the file name"))
    for argv, message in cases:
        with pytest.raises(ConfigurationError) as e:
            validate_task_args(parse_args(get_tasks_args, argv=argv))
        assert str(e.value).startswith(message), (argv, str(e.value))
    # A zero-shot task loads the torch_dist checkpoint pretrain_gpt.py writes by default: its format is detected.
    args = parse_args(get_tasks_args, argv=["--task", "WIKITEXT103", "--valid-data", str(wiki), "--load", str(dist)])
    validate_task_args(args)
    assert args.auto_detect_ckpt_format and args.ckpt_format is None
    assert task_ckpt_format(args) == "torch_dist"
    assert task_ckpt_format(parse_args(get_tasks_args, argv=["--task", "MNLI"])) == "torch"


def test_unknown_task_one_line_from_the_command_line():
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tasks", "main.py"), "--task", "GLUE-X"],
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --task GLUE-X: Task GLUE-X is not implemented; choose one of "
                                                "LAMBADA, WIKITEXT103, MNLI, QQP, RACE"]


def test_detokenizers():
    assert wikitext_detokenizer(" = = Early life = = \n He was born in 1 @,@ 000 ( the year ) , in a third @-@ "
                                "floor flat ; it cost 3 @.@ 5 \" dollars \" . \n") == \
        " == Early life ==\nHe was born in 1,000 (the year), in a third-floor flat; it cost 3.5 \"dollars\".\n"
    assert wikitext_detokenizer("the dogs ' bone is N m long") == "the dogs' bone is 1 m long"
    assert wikitext_detokenizer("a N b and John 's") == "a 1 b and John's"
    assert ptb_detokenizer("it does n't cost $ 1 N \n more") == "it doesn't cost $1 N\nmore"  # " \\n" first
    assert get_detokenizer("/data/wikitext-103/wiki.test.tokens") is wikitext_detokenizer
    assert get_detokenizer("/data/ptb/wiki.txt") is ptb_detokenizer  # ptb is looked for first
    assert get_detokenizer("/data/held_out.txt") is None


def test_wikitext_windows():
    tokens = list(range(100, 121))  # N = 21 tokens, 20 targets
    ds = _LMDataset(tokens, seq_len=8, pad_idx=0, num_original_tokens=15, num_tokenized_tokens=21,
                    overalapping_eval=3)
    assert len(ds) == 7  # ceil((20 - 3) / 3) + 1
    counted = []
    for i in range(len(ds)):
        item = ds[i]
        assert item["text"].tolist()[:len(tokens[3 * i:3 * i + 9])] == tokens[3 * i:3 * i + 9]
        targets = item["text"][1:]
        counted += targets[item["pad_mask"] == 1].tolist()
    assert counted == tokens[1:]  # every target exactly once
    assert ds[1]["pad_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert ds[4]["pad_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]  # targets 18, 19, 20: the last ones
    # windows 5 and 6 (the formula's extra windows) hold only targets already counted: nothing counts
    assert ds[5]["pad_mask"].tolist() == [0] * 8 and ds[6]["pad_mask"].tolist() == [0] * 8
    disjoint = _LMDataset(tokens, 8, 0, 15, 21, overalapping_eval=None)
    assert len(disjoint) == 3 and disjoint[2]["pad_mask"].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


def test_lambada_samples(tmp_path):
    path = tmp_path / "lambada.jsonl"
    path.write_text(json.dumps({"text": "the old man saw the sea again"}) + "\n\n"
                    + json.dumps({"text": "a b c"}) + "\n")

    class SplitTokenizer(WordTokenizer):
        def tokenize(self, text):  # a leading space makes a word two tokens, to see the strict split
            ids = super().tokenize(text)
            return ([5] + ids) if text.startswith(" ") else ids

    tok = SplitTokenizer()
    ds = _LambadaDataset(str(path), 3, tok, 8, strict=True)
    item = ds[0]
    context = tok.tokenize("the old man saw the sea")
    assert item["text"].tolist() == context + [5, tok.table["again"], 3]  # context + ' again' + eod padding
    assert item["pad_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
    loose = _LambadaDataset(str(path), 3, tok, 8, strict=False)
    assert loose[1]["text"].tolist()[:3] == tok.tokenize("a b c") and loose[1]["pad_mask"].tolist()[:3] == [0, 1, 0]
    with pytest.raises(ConfigurationError, match=r"line 1: the passage has 7 tokens; --seq-length \(4\) must be"):
        _LambadaDataset(str(path), 3, tok, 4, strict=False)
