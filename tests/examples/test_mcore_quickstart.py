"""megatron-core's QuickStart (examples/run_simple_mcore_train_loop.py: the same calls as Megatron-LM's, on CPU) at
TP=2 on 2 processes: it runs its 5 iterations (forward-backward schedule, finalize_model_grads), saves a torch_dist
checkpoint and loads it back; the real megatron-core 0.16.1 (oracle subprocess) then loads that checkpoint into its
own QuickStart model and its weights equal ours, tensor for tensor (our model loads the same directory at TP=1 with
our ``dist_checkpointing.load``)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers.examples_helpers import REPO
from helpers.mcore_oracle import require_oracle, run_oracle
from helpers.models_helpers import single_rank  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(400)
CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpointing",
                     "mcore_quickstart_oracle_child.py")


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("quickstart")
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_FORCE_CPU"}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           os.path.join(REPO, "examples", "run_simple_mcore_train_loop.py")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=cwd)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cwd, proc.stdout


def test_quickstart_trains_saves_and_loads(quickstart):
    cwd, stdout = quickstart
    losses = [float(x) for x in re.findall(r"Losses reduced :  \[\{'lm loss': tensor\(([0-9.]+)", stdout)]
    assert len(losses) == 10, stdout  # 5 iterations printed by each of the 2 ranks
    assert all(abs(x - 4.6) < 0.5 for x in losses), losses  # ~log(100): an untrained model on 100 tokens
    assert stdout.count("Successfully loaded the model") == 2
    assert sorted(os.listdir(cwd / "ckpt")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]


def _ours_at_tp1(ckpt):
    """Our QuickStart model (other seed), TP=1 in this process, loaded from ``ckpt`` with our dist_checkpointing."""
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(55)
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=100,
                     max_sequence_length=64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(prefix=""), str(ckpt)))
    return before, model.state_dict()


def test_megatron_core_reads_the_quickstart_checkpoint(quickstart, single_rank, tmp_path):
    cwd, _ = quickstart
    oracle = require_oracle()
    run_oracle([CHILD, cwd / "ckpt", tmp_path / "mcore_weights.pt"], cwd=tmp_path)
    theirs = torch.load(tmp_path / "mcore_weights.pt")
    before, ours = _ours_at_tp1(cwd / "ckpt")
    assert oracle
    assert set(theirs) == set(ours), set(theirs) ^ set(ours)
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name
    # Every randomly initialised tensor (the matrices) came from the file, not from this model's other seed; biases
    # and norms start at 0 / 1 in both (the QuickStart's Adam does not update weights under megatron-core's DDP).
    changed = sorted(n for n in ours if not torch.equal(before[n], ours[n]))
    assert changed == sorted(n for n in ours if ours[n].dim() > 1), changed
    print(f"megatron-core 0.16.1 loaded the QuickStart checkpoint: {len(ours)} tensors equal to ours "
          f"({sum(v.numel() for v in ours.values())} values)")
