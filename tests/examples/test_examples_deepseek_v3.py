"""examples/deepseek_v3/pretrain_deepseek_v3.sh (Megatron-LM's DeepSeek-V3 recipe) runs shrunk on CPU, and its losses
do not depend on the parallel layout.

The script runs with torchrun on 2 gloo processes at EP = 2 (TP = 1): a 2-layer model (a dense then an MoE layer) with
multi-latent attention, one MTP depth, 8 experts in 4 groups (2 kept, top-4 sigmoid routing with expert bias,
sequence-level aux loss), the recipe's selective recompute and distributed optimizer, fp32, mock data; 3 iterations,
a torch_dist checkpoint after each. The log shows ``mtp_1 loss`` and ``seq_load_balancing_loss`` next to ``lm loss``;
the final validation line (perplexity) has the lm loss only, as Megatron's.

Then the same command line (the script prints it with LAUNCHER=echo) runs in one 2-rank launch at the script's layout
(EP = 2), at EP = 1 (DP = 2), at TP = 2 with sequence parallelism and at PP = 2 (the MTP block on the last stage), each
from the script's iteration-1 checkpoint (``--ckpt-step 1``): iterations 2 and 3 give the script's lm loss, MTP loss
and seq_load_balancing_loss within 1e-5 (the log prints 7 digits), all 7 digits equal in the script's layout. The
vocabulary is padded to 256 at every TP size (--padded-vocab-size): the padded logits take part in the softmax, as in
Megatron, so a padding that grew with TP would change the loss.
"""
from __future__ import annotations

import re
import shlex

import pytest

from helpers.dist_harness import run_distributed
from helpers.examples_helpers import iteration_lines, run_script, script_env

pytestmark = pytest.mark.timeout(600)
TOL = 1e-5
SHRUNK = dict(GPUS_PER_NODE=2, TP=1, EP=2, NUM_LAYERS=2, HIDDEN_SIZE=32, FFN_HIDDEN_SIZE=64, NUM_HEADS=4,
              Q_LORA_RANK=16, KV_LORA_RANK=8, QK_HEAD_DIM=8, QK_POS_EMB_HEAD_DIM=4, V_HEAD_DIM=8, NUM_EXPERTS=8,
              MOE_FFN_HIDDEN_SIZE=16, MOE_LAYER_FREQ="[0]*1+[1]*1", TOPK=4, NUM_GROUPS=4, GROUP_TOPK=2,
              SEQ_LENGTH=32, VOCAB_SIZE=128, MICRO_BATCH_SIZE=2, GLOBAL_BATCH_SIZE=4, TRAIN_ITERS=3, LR="1e-3",
              LR_WARMUP_ITERS=1, SAVE_INTERVAL=1,
              PRECISION_ARGS="", MEGATRON_EXTRA_ARGS="--padded-vocab-size 256 --distributed-backend gloo "
                                                    "--num-workers 0 --eval-iters 1 --eval-interval 1000")
KEYS = ("lm loss", "mtp_1 loss", "seq_load_balancing_loss")
SAME = ("--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "2")  # the script's own layout
LAYOUTS = (SAME, ("--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "1"),
           ("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "1"),
           ("--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "2"))


def _logged(line: str) -> dict:
    return {k: float(re.search(rf"\| {k}: ([0-9.E+-]+) \|", line).group(1)) for k in KEYS}


def layouts_body(argv, save_root):
    from helpers.train_helpers import run_pretrain

    out = {}
    for i, layout in enumerate(LAYOUTS):
        records = run_pretrain("pretrain_gpt", list(argv) + list(layout) + ["--ckpt-step", "1", "--save",
                                                                            f"{save_root}/layout{i}"])
        # (the losses are on the last pipeline stage: rank 1 in every layout here)
        out[" ".join(layout)] = {r["iteration"]: {k: r["loss"].get(k) for k in KEYS} for r in records}
    return out


def test_deepseek_v3_script_trains_and_its_losses_do_not_depend_on_the_layout(tmp_path):
    env = script_env(tmp_path, CHECKPOINT_PATH=tmp_path / "ckpt", **SHRUNK)
    rc, out = run_script("deepseek_v3/pretrain_deepseek_v3.sh", env, timeout=400)
    assert rc == 0, out[-6000:]
    lines = iteration_lines(out)
    assert [n for _, (n, _, _, _) in lines] == [1, 2, 3], out[-6000:]
    script = {n: _logged(line) for line, (n, _, _, _) in lines}
    assert all(v > 0 for losses in script.values() for v in losses.values())
    validation = [line for line in out.splitlines() if "validation loss at iteration 3" in line]
    assert validation and all("lm loss value" in v and "mtp" not in v for v in validation), validation  # as Megatron
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    rc, command = run_script("deepseek_v3/pretrain_deepseek_v3.sh", dict(env, LAUNCHER="echo"), timeout=60)
    assert rc == 0, command
    words = shlex.split(command.strip().splitlines()[-1])
    argv = words[words.index(next(w for w in words if w.endswith("pretrain_gpt.py"))) + 1:]
    assert "--multi-latent-attention" in argv and "--mtp-num-layers" in argv and "--moe-router-num-groups" in argv
    outputs = run_distributed(layouts_body, 2, argv, str(tmp_path), timeout=500)
    report = []
    for layout, records in outputs[1].items():
        assert sorted(records) == [2, 3], records
        for it in (2, 3):
            for key in KEYS:
                err = abs(records[it][key] - script[it][key]) / abs(script[it][key])
                report.append(f"{layout} iteration {it} {key}: {records[it][key]:.7g} vs script "
                              f"{script[it][key]:.7g} (rel {err:.1e})")
                assert err < TOL, report[-1]
                if layout == " ".join(SAME):  # resumed in the same layout: the log's 7 digits exactly
                    assert f"{records[it][key]:.6E}" == f"{script[it][key]:.6E}", report[-1]
    print("\n".join(line for line, _ in lines))
    print("\n".join(report))
