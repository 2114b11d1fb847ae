"""Each example launch script runs on CPU as a tiny job: one GPU, torchrun DP, TP + SP, PP under a fake SLURM
allocation, BERT, and the generation server's command line."""
from __future__ import annotations

import os
import shlex

import pytest
from helpers.examples_helpers import FAKE_SRUN, ITERS, REPO, TINY, install_fake, iteration_lines, run_script, script_env

from helpers.train_helpers import preprocess_corpus_slice  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gpt_data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("examples_gpt")), num_docs=150)


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("examples_bert")), num_docs=150, tokenizer="bert")


def _check_run(rc, out, ckpt_dir, iters=3, world=1):
    assert rc == 0, out[-6000:]
    lines = iteration_lines(out)
    assert [n for _, (n, total, _, _) in lines] == list(range(1, iters + 1)), out[-6000:]
    assert all(total == iters for _, (_, total, _, _) in lines)
    assert any("lm loss:" in line for line, _ in lines), "no iteration made an update:\n" + out[-4000:]
    with open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(iters)
    assert f"using world size: {world}," in out
    print("\n".join(line for line, _ in lines))  # shown with pytest -s
    return lines


@pytest.mark.parametrize("script,nproc,extra,world_line", [
    ("pretrain_gpt.sh", None, "", "data-parallel-size: 1, tensor-model-parallel size: 1"),
    pytest.param("pretrain_gpt_distributed.sh", 2, "", "data-parallel-size: 2, tensor-model-parallel size: 1",
                 marks=pytest.mark.slow),  # DP 2 over torchrun: the SLURM rendezvous test below
    # TP 2 with sequence parallelism (PP is exercised by the SLURM script below; 2 processes at most here)
    ("pretrain_gpt_distributed_with_mp.sh", 2, "--pipeline-model-parallel-size 1",
     "data-parallel-size: 1, tensor-model-parallel size: 2, pipeline-model-parallel size: 1"),
])
def test_examples_gpt_scripts(tmp_path, gpt_data, script, nproc, extra, world_line):
    env = script_env(tmp_path, DATA_PATH=gpt_data, CHECKPOINT_PATH=tmp_path / "ckpt",
                     MEGATRON_EXTRA_ARGS=f"{TINY} {ITERS} {extra}")
    if nproc is not None:
        env["GPUS_PER_NODE"] = str(nproc)
    rc, out = run_script(script, env)
    _check_run(rc, out, tmp_path / "ckpt", world=nproc or 1)
    assert world_line in out
    assert "using torch.float16 for parameters" in out  # the script's --fp16 survives the overrides
    if script == "pretrain_gpt_distributed_with_mp.sh":
        assert _arg_value(out, "sequence_parallel") == "True"


def _arg_value(out: str, name: str):
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == name and set(parts[1]) == {"."}:
            return parts[2]
    return None


def test_examples_distributed_reads_rendezvous_from_slurm(tmp_path, gpt_data):
    """Inside a SLURM allocation the torchrun script takes the master host from SLURM_JOB_NODELIST through
    our host-list parser (no scontrol here), and the node count and node rank from SLURM."""
    env = script_env(tmp_path, DATA_PATH=gpt_data, CHECKPOINT_PATH=tmp_path / "ckpt", GPUS_PER_NODE=2,
                     SLURM_JOB_NODELIST="127.0.0.[1-4]", SLURM_JOB_NUM_NODES=1, SLURM_NODEID=0,
                     MEGATRON_EXTRA_ARGS=f"{TINY} --global-batch-size 4 --train-iters 1 --save-interval 1 "
                                         f"--eval-iters 0")
    env.pop("MASTER_ADDR", None)
    rc, out = run_script("pretrain_gpt_distributed.sh", env)
    assert f"1 node(s) x 2 process(es) = world size 2, node rank 0, master 127.0.0.1:{env['MASTER_PORT']}" in out
    _check_run(rc, out, tmp_path / "ckpt", iters=1, world=2)


@pytest.mark.slow  # a BERT script runs in test_examples_today.py::test_bert_340m_script_on_cpu
def test_examples_bert_scripts(tmp_path, bert_data):
    for script, nproc in (("pretrain_bert.sh", None), ("pretrain_bert_distributed.sh", 2)):
        run_dir = tmp_path / script
        run_dir.mkdir()
        env = script_env(run_dir, DATA_PATH=bert_data, CHECKPOINT_PATH=run_dir / "ckpt",
                         MEGATRON_EXTRA_ARGS=f"{TINY} {ITERS}")
        if nproc:
            env["GPUS_PER_NODE"] = str(nproc)
        rc, out = run_script(script, env)
        lines = _check_run(rc, out, run_dir / "ckpt", world=nproc or 1)
        assert "> building BertWordPieceLowerCase tokenizer" in out
        assert any("sop loss:" in line for line, _ in lines), out[-3000:]


def test_examples_gpt3_175B_under_fake_slurm(tmp_path, gpt_data):
    """The SLURM script with a fake srun that starts 2 local tasks: PP 2, bf16, the batch-size ramp-up and a
    three-way blend of (the same) dataset, all from the script's own flags."""
    install_fake(tmp_path, "srun", FAKE_SRUN)
    env = script_env(
        tmp_path, SLURM_JOB_ID=4242, SLURM_JOB_NAME="megatron_gpt3_175b", SLURM_NTASKS=2, SLURM_JOB_NUM_NODES=1,
        SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_NODELIST="127.0.0.[1-2]", LOG_DIR=tmp_path / "logs",
        DATASET_1=gpt_data, DATASET_2=gpt_data, DATASET_3=gpt_data, CHECKPOINT_PATH=tmp_path / "ckpt",
        TENSORBOARD_DIR=tmp_path / "tb",
        MEGATRON_EXTRA_ARGS=(f"{TINY} --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
                             "--micro-batch-size 1 --global-batch-size 4 --rampup-batch-size 2 2 4 "
                             "--train-samples 12 --lr-decay-samples 12 --lr-warmup-samples 2 --save-interval 1000"))
    port = env["MASTER_PORT"]
    env.pop("MASTER_ADDR", None)
    rc, out = run_script("pretrain_gpt3_175B.sh", env)
    assert f"master 127.0.0.1:{port}" in out, out
    logs = list((tmp_path / "logs").glob("megatron_gpt3_175b_4242_*.log"))
    assert len(logs) == 1, (out, logs)
    log = logs[0].read_text()
    assert rc == 0, out + log[-6000:]
    assert "using world size: 2, data-parallel-size: 1, tensor-model-parallel size: 1, pipeline-model-parallel size: 2" in log
    assert "using torch.bfloat16 for parameters" in log
    lines = iteration_lines(log)
    print("\n".join(line for line, _ in lines))  # shown with pytest -s
    batches = [gbs for _, (_, _, _, gbs) in lines]
    consumed = [c for _, (_, _, c, _) in lines]
    assert batches[0] == 2 and batches[-1] == 4 and sorted(batches) == batches, log[-4000:]  # the ramp-up
    assert consumed[-1] >= 12 - 4 and consumed == sorted(consumed)
    assert _arg_value(log, "num_layers") == "2" and _arg_value(log, "init_method_std") == "0.006"
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


def test_examples_text_generation_server_command(tmp_path):
    """The server script hands torchrun Megatron's server flags; the model flags parse with our parser.
    (The server itself is tools/run_text_generation_server.py, tested with the generation code.)"""
    record = tmp_path / "argv.txt"
    install_fake(tmp_path, "torchrun", f'#!/bin/bash\nprintf "%s\\n" "$@" > {shlex.quote(str(record))}\n')
    env = script_env(tmp_path, CHECKPOINT=tmp_path / "ckpt", MEGATRON_EXTRA_ARGS="--port 5123")
    rc, out = run_script("run_text_generation_server_345M.sh", env)
    assert rc == 0, out
    argv = record.read_text().splitlines()
    script_at = argv.index(os.path.join(REPO, "tools", "run_text_generation_server.py"))
    launcher, flags = argv[:script_at], argv[script_at + 1:]
    assert launcher[launcher.index("--nproc_per_node") + 1] == "1"
    for flag, value in (("--load", str(tmp_path / "ckpt")), ("--top_p", "0.9"), ("--out-seq-length", "1024"),
                        ("--temperature", "1.0"), ("--seed", "42"), ("--port", "5123")):
        assert flags[flags.index(flag) + 1] == value, flags
    from megatron.training.arguments import parse_args
    args = parse_args(ignore_unknown_args=True, argv=flags)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length) == (24, 1024, 16, 1024)
    assert args.fp16 and args.tokenizer_type == "GPT2BPETokenizer" and args.load == str(tmp_path / "ckpt")
