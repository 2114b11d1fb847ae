"""Today's example layout (examples/gpt3, examples/llama, examples/bert) runs on CPU as a tiny job: each script's
own flags, shrunk with MEGATRON_EXTRA_ARGS (argparse keeps the last value of a repeated flag) to a 2-layer model
and 3 iterations on one process."""
from __future__ import annotations

import pytest
from helpers.examples_helpers import ITERS, TINY, iteration_lines, run_script, script_env

from helpers.train_helpers import preprocess_corpus_slice  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gpt_data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("today_gpt")), num_docs=150)


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("today_bert")), num_docs=150, tokenizer="bert")


def _arg_value(out: str, name: str):
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == name and set(parts[1]) == {"."}:
            return parts[2]
    return None


def _check(rc, out, ckpt_dir, iters=3):
    assert rc == 0, out[-6000:]
    lines = iteration_lines(out)
    assert [n for _, (n, total, _, _) in lines] == list(range(1, iters + 1)), out[-6000:]
    assert any("lm loss:" in line for line, _ in lines), out[-4000:]
    assert (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(iters)
    print("\n".join(line for line, _ in lines))  # shown with pytest -s


@pytest.mark.slow  # the 175B script runs under fake SLURM in test_examples_launch.py and as ranks of 1024
def test_gpt3_175b_script_on_cpu(tmp_path, gpt_data):
    env = script_env(tmp_path, DATA_PATH=gpt_data, CHECKPOINT_PATH=tmp_path / "ckpt", GPUS_PER_NODE=1,
                     TENSORBOARD_LOGS_PATH=tmp_path / "tb", RAMPUP_BATCH_SIZE="",
                     MEGATRON_EXTRA_ARGS=f"{TINY} {ITERS}")
    rc, out = run_script("gpt3/train_gpt3_175b_distributed.sh", env)
    _check(rc, out, tmp_path / "ckpt")
    assert "using torch.float16 for parameters" in out
    assert _arg_value(out, "init_method_std") == "0.006" and _arg_value(out, "lr_decay_style") == "cosine"
    assert _arg_value(out, "attention_backend") is not None


def test_llama3_8b_script_on_cpu_with_mock_data(tmp_path):
    """Mock data, NullTokenizer, no attention mask from the loader, file reads, one loader worker, torch_dist."""
    cache = tmp_path / "cache"
    extra = (f"{TINY} --num-workers 1 --seq-length 256 --max-position-embeddings 256 --vocab-size 500 "
             "--ffn-hidden-size 64 --kv-channels 8 --num-query-groups 2 --transformer-impl local --no-rope-fusion "
             "--global-batch-size 4 --train-samples 12 --lr-decay-samples 12 --lr-warmup-samples 4 "
             "--save-interval 3")
    env = script_env(tmp_path, CHECKPOINT_PATH=tmp_path / "ckpt", TENSORBOARD_LOGS_PATH=tmp_path / "tb",
                     DATA_CACHE_PATH=cache, GPUS_PER_NODE=1, MEGATRON_EXTRA_ARGS=extra)
    rc, out = run_script("llama/train_llama3_8b.sh", env)
    _check(rc, out, tmp_path / "ckpt")
    assert "using torch.bfloat16 for parameters" in out
    for name, value in (("mock_data", "True"), ("create_attention_mask_in_dataloader", "False"),
                        ("mmap_bin_files", "False"), ("num_workers", "1"), ("tokenizer_type", "NullTokenizer"),
                        ("ckpt_format", "torch_dist"), ("padded_vocab_size", "512"), ("rotary_base", "1000000"),
                        ("swiglu", "True"), ("use_distributed_optimizer", "True")):
        assert _arg_value(out, name) == value, (name, _arg_value(out, name))


def test_bert_340m_script_on_cpu(tmp_path, bert_data):
    env = script_env(tmp_path, DATA_PATH=bert_data, CHECKPOINT_PATH=tmp_path / "ckpt", GPUS_PER_NODE=1,
                     TENSORBOARD_LOGS_PATH=tmp_path / "tb", MEGATRON_EXTRA_ARGS=f"{TINY} {ITERS}")
    rc, out = run_script("bert/train_bert_340m_distributed.sh", env)
    _check(rc, out, tmp_path / "ckpt")
    assert "> building BertWordPieceLowerCase tokenizer" in out
    assert any("sop loss:" in line for line, _ in iteration_lines(out))


@pytest.mark.slow  # MoE training layouts: tests/training/test_train_moe_parity.py
def test_mixtral_8x7b_script_on_cpu_with_mock_data(tmp_path):
    """The Mixtral MoE script (grouped GEMM, all-to-all dispatcher, distributed optimizer, bf16) on 2 gloo ranks:
    EP shrunk to 2 and PP to 1, 4 experts; the MoE load-balancing loss shows in every iteration line."""
    extra = (f"{TINY} --pipeline-model-parallel-size 1 --expert-model-parallel-size 2 --num-experts 4 "
             "--ffn-hidden-size 64 --num-query-groups 2 --vocab-size 500 --no-rope-fusion --micro-batch-size 1 --lr-warmup-iters 1 "
             f"{ITERS}")
    env = script_env(tmp_path, CHECKPOINT_PATH=tmp_path / "ckpt", GPUS_PER_NODE=2, MEGATRON_EXTRA_ARGS=extra)
    rc, out = run_script("mixtral/train_mixtral_8x7b_distributed.sh", env)
    _check(rc, out, tmp_path / "ckpt")
    assert all("load_balancing_loss:" in line for line, _ in iteration_lines(out)), out[-4000:]
    for name, value in (("num_experts", "4"), ("moe_grouped_gemm", "True"), ("moe_token_dispatcher_type", "alltoall"),
                        ("expert_model_parallel_size", "2"), ("moe_router_topk", "2"), ("swiglu", "True"),
                        ("use_distributed_optimizer", "True"), ("rotary_base", "1000000")):
        assert _arg_value(out, name) == value, (name, _arg_value(out, name))
