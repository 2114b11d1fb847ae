"""examples/megatron_fsdp/ run shrunk on CPU, 2 gloo processes each, 3 iterations with a checkpoint:

* train_llama3_8b_fsdp.sh with FSDP=torch: the Llama-3 8B flags (RMSNorm, SwiGLU, GQA, RoPE, untied, bf16,
  per-token loss) under --use-torch-fsdp2, saving torch_dcp;
* sbatch_mfsdp_deepseek_v3.sh under a fake srun: the DeepSeek-V3 recipe's flags (MLA, MTP, sigmoid group routing
  with expert bias, forced load balancing, shared expert, dense first layer, grouped experts at EP=2) under
  Megatron-FSDP ZeRO-3 built on the meta device, saving fsdp_dtensor.
"""
from __future__ import annotations

import pytest
from helpers.examples_helpers import FAKE_SRUN, install_fake, iteration_lines, run_script, script_env

pytestmark = pytest.mark.timeout(300)
SMALL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --kv-channels 8 --seq-length 32 "
         "--max-position-embeddings 32 --vocab-size 500 --micro-batch-size 2 --global-batch-size 4 "
         "--train-samples 12 --lr-decay-samples 12 --lr-warmup-samples 4 --save-interval 3 --eval-iters 0 "
         "--num-workers 0 --distributed-backend gloo --log-interval 1")


def _check(rc, out, ckpt, fmt):
    assert rc == 0, out[-6000:]
    lines = iteration_lines(out)
    assert [n for _, (n, _, _, _) in lines] == [1, 2, 3], out[-6000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    iteration = ckpt / "iter_0000003"
    assert (iteration / ".metadata").is_file() and not (iteration / "metadata.json").exists()  # DCP, not torch_dist
    from megatron.training.checkpointing import detect_format

    assert detect_format(str(iteration)) == fmt
    print("\n".join(line for line, _ in lines))


def test_llama3_8b_fsdp2_script_on_cpu(tmp_path):
    extra = f"{SMALL} --ffn-hidden-size 64 --num-query-groups 2 --transformer-impl local --no-rope-fusion"
    env = script_env(tmp_path, CHECKPOINT_PATH=tmp_path / "ckpt", TENSORBOARD_LOGS_PATH=tmp_path / "tb",
                     DATA_CACHE_PATH=tmp_path / "cache", GPUS_PER_NODE=2, FSDP="torch", MEGATRON_EXTRA_ARGS=extra)
    rc, out = run_script("megatron_fsdp/train_llama3_8b_fsdp.sh", env, timeout=240)
    _check(rc, out, tmp_path / "ckpt", "torch_dcp")
    assert "data parallelism: torch.distributed.fsdp.fully_shard (optim_grads_params) over 2 DP x CP ranks" in out
    assert "using torch.bfloat16 for parameters" in out


def test_deepseek_v3_mfsdp_script_under_fake_slurm(tmp_path):
    install_fake(tmp_path, "srun", FAKE_SRUN)
    extra = (f"{SMALL} --ffn-hidden-size 64 --num-experts 4 --moe-layer-freq ([0]*1+[1]*1) "
             "--moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 16 --moe-router-topk 2 "
             "--moe-router-num-groups 2 --moe-router-group-topk 1 --expert-model-parallel-size 2 --q-lora-rank 16 "
             "--kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 8 --v-head-dim 8 "
             "--make-vocab-size-divisible-by 128")
    env = script_env(tmp_path, SLURM_JOB_ID=77, SLURM_JOB_NAME="mfsdp_dsv3", SLURM_NTASKS=2, SLURM_JOB_NUM_NODES=1,
                     SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_NODELIST="127.0.0.[1-2]", LOG_DIR=tmp_path / "logs",
                     CHECKPOINT_PATH=tmp_path / "ckpt", EP=2, MEGATRON_EXTRA_ARGS=extra)
    env.pop("MASTER_ADDR", None)
    rc, out = run_script("megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh", env, timeout=240)
    logs = list((tmp_path / "logs").glob("mfsdp_dsv3_77_*.log"))
    assert len(logs) == 1, out
    log = logs[0].read_text()
    _check(rc, out + log, tmp_path / "ckpt", "fsdp_dtensor")
    assert "data parallelism: torch.distributed.fsdp.fully_shard (optim_grads_params) over 2 DP x CP ranks" in log
    assert "experts over the expert data-parallel group" in log
    assert "--init-model-with-meta-device: weights drawn layer by layer" in log and "MoE grouped GEMM" in log
    assert all("mtp_1 loss:" in line for line, _ in iteration_lines(log)), log[-3000:]
