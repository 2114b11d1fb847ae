"""Zero-shot GPT tasks (tasks/main.py --task WIKITEXT103 / LAMBADA) against a hand computation with the same
model: a plain loop over the targets, each scored from the context Megatron's window arithmetic gives it.

One 2-rank run (TP=2): a tiny GPT is built and saved; ``tasks.zeroshot_gpt.evaluate.main`` loads it and prints
Megatron's lines, which are parsed and compared with the perplexity / adjusted perplexity / accuracy computed here
from per-target log-probabilities.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re

import pytest
from helpers.dist_harness import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(REPO, "data/tokenizers/gpt2/vocab.json"),
        "--merge-file", os.path.join(REPO, "data/tokenizers/gpt2/merges.txt")]
SEQ = 32
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--max-position-embeddings", str(SEQ), "--micro-batch-size", "3", "--tensor-model-parallel-size", "2",
         "--distributed-backend", "gloo", "--num-workers", "0", "--seed", "1234", "--init-method-std", "0.2",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--no-load-rng",
         "--no-load-optim", "--save-interval", "1000"]

WIKI = (" = Valkyria Chronicles = \n \n The game 's first release , in 2011 , sold 1 @,@ 000 copies ( in Japan ) . "
        "Its sequel was a third @-@ person shooter ; critics said \" it is fine \" and 3 @.@ 5 stars . \n"
        " = = Plot = = \n The player , a squad leader , fights the Empire 's army across the N maps . \n")


def _init(argv):
    from tasks.main import initialize_task

    initialize_task(argv)


def _reset():
    from megatron.core import parallel_state
    from megatron.training import global_vars

    global_vars.destroy_global_vars()
    parallel_state.destroy_model_parallel()


def _run_main():
    from tasks.zeroshot_gpt.evaluate import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main()
    return out.getvalue()


def _full_logits(model, ids):
    """Logits [len(ids), V] of one sequence (positions 0..), all vocabulary shards gathered."""
    import torch
    from megatron.core import tensor_parallel

    tokens = torch.tensor([ids])
    positions = torch.arange(len(ids)).unsqueeze(0)
    mask = torch.triu(torch.ones(len(ids), len(ids), dtype=torch.bool), diagonal=1).view(1, 1, len(ids), len(ids))
    with torch.no_grad():
        logits = model(tokens, positions, mask)
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)[0].double()


def _hand_wikitext(model, tokens, stride):
    """Sum of -log p(token t | its context) over t = 1..N-1, where t's context starts at 0 for t <= SEQ and
    otherwise at the start of the first window (multiple of the stride) whose counted part holds t."""
    import torch

    total = 0.0
    for t in range(1, len(tokens)):
        start = 0 if t <= SEQ else stride * math.ceil((t - SEQ) / stride)
        logits = _full_logits(model, tokens[start:t])
        total += -torch.log_softmax(logits[-1], dim=-1)[tokens[t]].item()
    return total


def _hand_lambada(model, passages):
    """Number of passages whose every target token is the argmax given everything before it."""
    correct = 0
    for context, target in passages:
        ids = context + target
        logits = _full_logits(model, ids[:-1])
        preds = logits.argmax(-1).tolist()
        correct += all(preds[len(context) - 1 + j] == target[j] for j in range(len(target)))
    return correct


def _parse(out, task):
    line = next((l for l in out.splitlines() if l.startswith(f" validation results on {task} |")), None)
    if line is None:  # printed on the last rank only
        return None, None
    return {k.strip(): v.strip() for k, v in re.findall(r"([a-z ]+): ([^|]+)", line.split("|", 1)[1])}, line


def _body(tmp):
    import torch
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.global_vars import get_args, get_tokenizer
    from megatron.training.training import get_model
    from megatron.training.utils import unwrap_model
    from pretrain_gpt import model_provider
    from tasks.zeroshot_gpt.detokenizer import wikitext_detokenizer

    wiki = os.path.join(tmp, "wiki.test.tokens")
    ckpt = os.path.join(tmp, "ckpt")
    results = {}
    # ---- phase A: GPT-2 BPE; WikiText perplexity with and without overlap; strict LAMBADA. No --ckpt-format: the
    # checkpoint is torch_dist, as pretrain_gpt.py writes by default, and the task detects that format when loading.
    _init(MODEL + GPT2 + ["--task", "WIKITEXT103", "--valid-data", wiki, "--overlapping-eval", "8",
                          "--save", ckpt, "--load", ckpt])
    args, tokenizer = get_args(), get_tokenizer()
    results["format"] = (args.ckpt_format, args.auto_detect_ckpt_format)
    model = get_model(model_provider, wrap_with_ddp=False)
    save_checkpoint(1, model, None, None)
    plain = unwrap_model(model[0]).eval()
    tokens = tokenizer.tokenize(wikitext_detokenizer(open(wiki).read()))
    for stride in (8, SEQ):
        args.overlapping_eval = stride
        fields, line = _parse(_run_main(), "WIKITEXT103")
        hand = _hand_wikitext(plain, tokens, stride)
        n, m = len(tokens), len(WIKI.strip().split(" "))
        results[f"wiki{stride}"] = dict(fields=fields, line=line, hand_avg=hand / (n - 1),
                                        hand_ratio=(n - 1) / (m - 1))
    lambada = os.path.join(tmp, "lambada_test.jsonl")
    args.task, args.valid_data, args.strict_lambada = "LAMBADA", [lambada], True
    texts = [json.loads(l)["text"] for l in open(lambada)]
    passages = []
    for text in texts:
        word = text.split()[-1]
        passages.append((tokenizer.tokenize(text[:text.rfind(word)].strip()), tokenizer.tokenize(" " + word)))
    fields, line = _parse(_run_main(), "LAMBADA")
    results["strict"] = dict(fields=fields, line=line, hand=_hand_lambada(plain, passages), n=len(texts),
                             multi=sum(len(t) > 1 for _, t in passages))
    _reset()
    # ---- phase B: space-separated ids (NullTokenizer); passages whose last token is (or is not) the model's argmax
    null_lambada = os.path.join(tmp, "null_lambada.jsonl")
    _init(MODEL + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--task", "LAMBADA",
                   "--valid-data", lambada, "--load", ckpt + "_null", "--save", ckpt + "_null",
                   "--ckpt-format", "torch"])
    args = get_args()
    model = get_model(model_provider, wrap_with_ddp=False)
    save_checkpoint(1, model, None, None)
    plain = unwrap_model(model[0]).eval()
    gen = torch.Generator().manual_seed(0)
    passages = []
    for i in range(7):
        context = torch.randint(0, 127, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen).tolist()
        best = int(_full_logits(plain, context)[-1].argmax())  # may be a padding id: still a valid input id
        passages.append((context, [best if i % 3 else (best + 1) % 127]))
    if torch.distributed.get_rank() == 0:
        with open(null_lambada, "w") as f:
            for c, t in passages:
                f.write(json.dumps({"text": " ".join(map(str, c + t))}) + "\n")
    torch.distributed.barrier()
    args.valid_data = [null_lambada]
    # This checkpoint is in the torch format; evaluate as a run with the default --ckpt-format (torch_dist) would:
    # the format is detected from the directory.
    args.ckpt_format = "torch_dist"
    output = _run_main()
    results["detected"] = "--auto-detect-ckpt-format:" in output and "holds a torch checkpoint" in output
    fields, line = _parse(output, "LAMBADA")
    results["null"] = dict(fields=fields, line=line, hand=_hand_lambada(plain, passages), n=len(passages))
    _reset()
    return results


@pytest.mark.timeout(240)
def test_zeroshot_wikitext_and_lambada_match_hand_computation(tmp_path):
    (tmp_path / "wiki.test.tokens").write_text(WIKI)
    words = ["river", "mountains", "hesitation", "unbelievably", "lamp", "catastrophically"]
    with open(tmp_path / "lambada_test.jsonl", "w") as f:
        for i, w in enumerate(words):
            f.write(json.dumps({"text": f"She walked along the path for {i + 2} hours and then saw the {w}"}) + "\n")
    results = run_distributed(_body, 2, str(tmp_path), timeout=200)
    res = results[1]  # the last rank prints
    # The zero-shot tasks save torch_dist by default (pretrain_gpt.py's default) and detect the format of --load.
    assert res["format"] == ("torch_dist", True)
    for stride in (8, SEQ):
        r = res[f"wiki{stride}"]
        f = r["fields"]
        avg, ratio = r["hand_avg"], r["hand_ratio"]
        print(r["line"])
        assert float(f["avg loss"]) == pytest.approx(avg, rel=1e-3)
        assert float(f["ppl"]) == pytest.approx(math.exp(avg), rel=1e-3)
        assert float(f["token ratio"]) == pytest.approx(ratio, rel=1e-9)
        assert float(f["adjusted ppl"]) == pytest.approx(math.exp(avg * ratio), rel=2e-3)
        assert ratio != 1.0  # the detokenized BPE count differs from the word count
    # overlapping windows see more context than disjoint ones: different losses
    assert res["wiki8"]["hand_avg"] != res[f"wiki{SEQ}"]["hand_avg"]
    s = res["strict"]
    print(s["line"])
    assert s["multi"] >= 2  # some last words are several BPE tokens: all of them must be right
    assert float(s["fields"]["number correct"]) == s["hand"]
    assert float(s["fields"]["total examples"]) == s["n"]
    assert results[0]["detected"]  # rank 0 says which format it found
    n = res["null"]
    print(n["line"])
    assert n["hand"] == 4  # passages 1, 2, 4, 5 end with the argmax token (0, 3, 6 do not)
    assert float(n["fields"]["number correct"]) == 4
    assert float(n["fields"]["avg accuracy"]) == pytest.approx(4 / 7, rel=1e-4)
