"""Tiny task data files for the tests of tasks/ (written by the tests; nothing shipped): a separable MNLI toy set
(the label's keyword -- yes / no / maybe -- repeated in both sentences) and RACE directories."""
from __future__ import annotations

import json
import os

KEYWORDS = {"entailment": "yes", "contradiction": "no", "neutral": "maybe"}


def write_mnli(path, n, rng):
    subjects = ["the cat", "a man", "the river", "my friend", "the city", "a student", "the dog", "our team"]
    header = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
              "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
    with open(path, "w") as f:
        f.write("\t".join(header) + "\n")
        for i in range(n):
            label = list(KEYWORDS)[i % 3]
            kw = KEYWORDS[label]
            s1 = f"{kw} {kw} {rng.choice(subjects)} went to {rng.choice(subjects)} ."
            s2 = f"{kw} {kw} {kw} {rng.choice(subjects)}"
            f.write("\t".join([str(i), str(i), f"{i}e", "fiction", "(x)", "(y)", "(X)", "(Y)", s1, s2, label, label])
                    + "\n")


def write_race(directory, n, rng):
    os.makedirs(directory, exist_ok=True)
    for part in range(2):
        with open(os.path.join(directory, f"{part}.txt"), "w") as f:
            for d in range(n):
                answers = [rng.choice("ABCD") for _ in range(2)]
                f.write(json.dumps({"article": "the cat sat on the mat . it was a sunny day .",
                                    "questions": ["where did the cat sit ?", "the day was _ ."],
                                    "options": [["mat", "roof", "tree", "car"], ["sunny", "dark", "cold", "wet"]],
                                    "answers": answers}) + "\n")


def write_qqp(path, n, rng):
    """A separable QQP toy set: duplicates share a keyword repeated in both questions ('same'), others do not."""
    subjects = ["the cat", "a man", "the river", "my friend", "the city", "a student", "the dog", "our team"]
    with open(path, "w") as f:
        f.write("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n")
        for i in range(n):
            duplicate = i % 2
            kw = "same" if duplicate else "other"
            q1 = f"{kw} {kw} where is {rng.choice(subjects)} ?"
            q2 = f"{kw} {kw} {kw} {rng.choice(subjects)} ?"
            f.write("\t".join([str(i), str(2 * i), str(2 * i + 1), q1, q2, str(duplicate)]) + "\n")
