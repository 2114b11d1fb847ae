"""The four T5 example scripts (examples/pretrain_t5.sh, pretrain_t5_distributed.sh,
pretrain_t5_distributed_with_mp.sh, examples/t5/train_t5_220m_distributed.sh) run on CPU as tiny jobs: each
script's own flags, shrunk with MEGATRON_EXTRA_ARGS to a 2+2-layer model and 3 iterations on sentence-split data.

pretrain_t5_distributed.sh runs with 2 processes as a pipeline (--pipeline-model-parallel-split-rank 1: encoder on
stage 0, decoder on stage 1) and saves torch_dist checkpoints; pretrain_t5.sh (one process, PP=1) resumes from its
iteration 2 and must reproduce its losses of iterations 3 and 4 (weights, then Adam moments, across layouts).
pretrain_t5_distributed_with_mp.sh (TP=2) runs the legacy T5Model (--use-legacy-models) and saves torch checkpoints.
pretrain_t5.py under torchrun in fp32 trains the megatron-core T5 4 iterations with TP=1, TP=2 and TP=2 + SP: the
same losses per iteration (1e-5) and grad norms (1e-4)."""
from __future__ import annotations

import pytest
from helpers.examples_helpers import ITERS, iteration_lines, run_script, script_env
from helpers.train_helpers import preprocess_corpus_slice

pytestmark = pytest.mark.timeout(300)

T5_TINY = ("--hidden-size 32 --num-attention-heads 4 --kv-channels 8 --ffn-hidden-size 64 --encoder-seq-length 64 "
           "--decoder-seq-length 32 --max-position-embeddings 64 --micro-batch-size 2 --log-interval 1 "
           "--eval-iters 1 --eval-interval 1000 --distributed-backend gloo --num-workers 0 --split 80,10,10 "
           "--initial-loss-scale 4096")


@pytest.fixture(scope="module")
def t5_data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("t5_data")), num_docs=60, tokenizer="bert")


def _arg_value(out: str, name: str):
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == name and set(parts[1]) == {"."}:
            return parts[2]
    return None


def _check(rc, out, ckpt_dir):
    assert rc == 0, out[-6000:]
    lines = iteration_lines(out)
    assert [n for _, (n, _, _, _) in lines] == [1, 2, 3], out[-6000:]
    assert all("lm loss:" in line for line, _ in lines), out[-4000:]
    assert "> building train, validation, and test datasets for T5 ..." in out and "building T5 model ..." in out
    assert (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert "validation loss at iteration 3" in out
    print("\n".join(line for line, _ in lines))  # shown with pytest -s


@pytest.mark.parametrize("script,procs,extra", [
    ("pretrain_t5_distributed_with_mp.sh", 2, "--num-layers 2 --use-legacy-models --ckpt-format torch"),
    pytest.param("t5/train_t5_220m_distributed.sh", 1, "--encoder-num-layers 2 --decoder-num-layers 2",
                 marks=pytest.mark.slow),
])
def test_t5_scripts_on_cpu(tmp_path, t5_data, script, procs, extra):
    env = script_env(tmp_path, DATA_PATH=t5_data, CHECKPOINT_PATH=tmp_path / "ckpt", GPUS_PER_NODE=procs,
                     TENSORBOARD_DIR=tmp_path / "tb", MEGATRON_EXTRA_ARGS=f"{T5_TINY} {ITERS} {extra}")
    rc, out = run_script(script, env)
    _check(rc, out, tmp_path / "ckpt")
    assert _arg_value(out, "vocab_extra_ids") == "100" and _arg_value(out, "decoder_seq_length") == "32"
    if script.startswith("t5/"):
        assert _arg_value(out, "tokenizer_type") == "BertWordPieceCase" and _arg_value(out, "bf16") == "True"
        assert _arg_value(out, "init_method_std") == "0.015" and _arg_value(out, "decoder_num_layers") == "2"
    else:
        assert _arg_value(out, "tokenizer_type") == "BertWordPieceLowerCase" and _arg_value(out, "fp16") == "True"
        assert _arg_value(out, "tensor_model_parallel_size") == "2" and _arg_value(out, "use_legacy_models") == "True"
        assert (tmp_path / "ckpt" / "iter_0000003" / "mp_rank_01" / "model_optim_rng.pt").is_file()


def _losses(out):
    return {n: float(line.split("lm loss:")[1].split("|")[0]) for line, (n, _, _, _) in iteration_lines(out)}


def test_t5_pipeline_split_script_and_resume_at_pp1(tmp_path, t5_data):
    common = (f"{T5_TINY} --num-layers 2 --global-batch-size 4 --train-iters 4 --lr-decay-iters 4 --save-interval 2 "
              "--hidden-dropout 0 --attention-dropout 0 --lr 0.001")
    env = script_env(tmp_path, DATA_PATH=t5_data, CHECKPOINT_PATH=tmp_path / "pp2", GPUS_PER_NODE=2,
                     MEGATRON_EXTRA_ARGS=f"{common} --pipeline-model-parallel-size 2 "
                                         "--pipeline-model-parallel-split-rank 1")
    rc, out = run_script("pretrain_t5_distributed.sh", env)
    assert rc == 0, out[-6000:]
    assert _arg_value(out, "pipeline_model_parallel_split_rank") == "1" and _arg_value(out, "ckpt_format") == "torch_dist"
    pp2 = _losses(out)
    assert sorted(pp2) == [1, 2, 3, 4], out[-4000:]
    (tmp_path / "pp2" / "latest_checkpointed_iteration.txt").write_text("2")
    env = script_env(tmp_path, DATA_PATH=t5_data, CHECKPOINT_PATH=tmp_path / "pp1", GPUS_PER_NODE=1,
                     MEGATRON_EXTRA_ARGS=f"{common} --load {tmp_path / 'pp2'}")
    rc, out = run_script("pretrain_t5.sh", env)
    assert rc == 0, out[-6000:]
    assert "validation loss at iteration 4" in out
    pp1 = _losses(out)
    assert sorted(pp1) == [3, 4], out[-4000:]
    errors = {n: abs(pp1[n] - pp2[n]) / pp2[n] for n in (3, 4)}
    print(f"T5 losses PP=2 split 1: {pp2}; resumed at PP=1: {pp1}; relative differences {errors}")
    assert max(errors.values()) <= 1e-5


def _torchrun_t5(tmp_path, data, procs, extra):
    """pretrain_t5.py under torchrun in fp32 (the scripts pass --fp16; TP changes the order of 16-bit sums)."""
    import os
    import subprocess
    import sys

    from helpers.examples_helpers import REPO

    env = script_env(tmp_path)
    argv = (f"{T5_TINY} --num-layers 2 --global-batch-size 4 --train-iters 4 --lr-decay-iters 4 --lr 0.001 "
            "--lr-decay-style linear --min-lr 0.0001 --clip-grad 1.0 --weight-decay 0.01 --hidden-dropout 0 "
            "--attention-dropout 0 --vocab-extra-ids 100 --use-cpu-initialization --tokenizer-type "
            f"BertWordPieceLowerCase --vocab-file {os.path.join(REPO, 'data/tokenizers/bert/vocab.txt')} "
            f"--data-path {data} {extra}").split()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
                           "--master_port", env["MASTER_PORT"], os.path.join(REPO, "pretrain_t5.py"), *argv],
                          env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def test_t5_training_losses_tp2_and_sequence_parallel_equal_tp1(tmp_path, t5_data):
    """megatron-core T5 trained 4 iterations with TP=2 and TP=2 + SP logs TP=1's losses (1e-5 relative) and grad
    norms (1e-4): same weights (--use-cpu-initialization gives every TP size the same full weights when the padded
    vocabulary is the same), same batches."""
    # The vocabulary is padded to a multiple of --make-vocab-size-divisible-by x TP (8194 + 100 sentinels = 8294 -> 8448 in
    # all three runs); a different padded size would draw different random embedding rows and shift every weight.
    outs = {name: _torchrun_t5(tmp_path, t5_data, procs, extra) for name, procs, extra in (
        ("tp1", 1, "--make-vocab-size-divisible-by 256"),
        ("tp2", 2, "--tensor-model-parallel-size 2 --make-vocab-size-divisible-by 128"),
        ("tp2_sp", 2, "--tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 128"))}
    assert all("(new size: 8448)" in out for out in outs.values())  # Megatron's "> padded vocab" line
    assert _arg_value(outs["tp2_sp"], "sequence_parallel") == "True"
    assert _arg_value(outs["tp2"], "tensor_model_parallel_size") == "2"
    losses = {name: _losses(out) for name, out in outs.items()}
    norms = {name: {n: float(line.split("grad norm:")[1].split("|")[0]) for line, (n, _, _, _) in iteration_lines(out)}
             for name, out in outs.items()}
    ref = losses["tp1"]
    assert sorted(ref) == [1, 2, 3, 4] and ref[4] < ref[1], ref
    worst = {}
    for name in ("tp2", "tp2_sp"):
        assert sorted(losses[name]) == [1, 2, 3, 4], outs[name][-4000:]
        worst[name] = max(abs(losses[name][n] - ref[n]) / ref[n] for n in ref)
        worst[name + " grad norm"] = max(abs(norms[name][n] - norms["tp1"][n]) / norms["tp1"][n] for n in ref)
    print(f"T5 losses TP=1 {ref}; TP=2 {losses['tp2']}; TP=2 + SP {losses['tp2_sp']}; max relative differences {worst}")
    assert worst["tp2"] <= 1e-5 and worst["tp2_sp"] <= 1e-5, worst
    assert worst["tp2 grad norm"] <= 1e-4 and worst["tp2_sp grad norm"] <= 1e-4, worst
