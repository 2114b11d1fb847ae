"""A torch_dist checkpoint whose distributed-optimizer state is in Megatron's default ``dp_reshardable`` form (flat
per-bucket tensors ``optimizer.distributed.dp_group_idx_{I}.gbuf_idx_{G}.dtype_(...).bucket_idx_{B}.{param|exp_avg|
exp_avg_sq}`` plus the ``per_bucket_numel`` metadata, ``param_state_sharding_type`` 'dp_reshardable' in common.pt)
is refused with one line naming the directory and ``--no-load-optim``, and the checkpoint is left as it was; with
``--no-load-optim`` the weights and the iteration load and training continues (the optimizer and its learning-rate
scheduler start afresh, as in Megatron, which loads the scheduler together with the optimizer).

The checkpoint is written by hand from that layout: our own iteration-2 checkpoint with its ``optimizer.state.*``
entries replaced by the dp_reshardable entries (the values are zeros: only their names and the refusal matter).
"""
import os
import shutil

import torch

from helpers.dist_harness import run_distributed
from helpers.train_helpers import preprocess_corpus_slice, run_pretrain

LEG = ["--train-iters", "4", "--save-interval", "2", "--ckpt-format", "torch_dist", "--use-distributed-optimizer",
       "--log-interval", "1"]
DTYPE = "dtype_(torch.float32, torch.float32)"


def _rewrite_as_dp_reshardable(source, target):
    from megatron.core.dist_checkpointing import LocalShard, save_sharded
    from megatron.core.dist_checkpointing.sharded_io import load_full_state_dict

    flat = load_full_state_dict(source)
    numel = sum(v.numel() for k, v in flat.items() if k.startswith("optimizer.state.exp_avg.") and torch.is_tensor(v))
    state = {}
    for key, value in flat.items():
        if key.startswith("optimizer.state."):
            continue
        state[key] = LocalShard(value, tuple(value.shape), (0,) * value.dim()) if torch.is_tensor(value) else value
    prefix = "optimizer.distributed.dp_group_idx_0"
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        state[f"{prefix}.gbuf_idx_0.{DTYPE}.bucket_idx_0.{kind}"] = LocalShard(torch.zeros(numel), (numel,), (0,))
    state[f"{prefix}.per_bucket_numel"] = {(0, DTYPE): [numel]}
    state[f"{prefix}.per_bucket_numel_unpadded"] = {(0, DTYPE): [numel]}
    os.makedirs(target)
    save_sharded(state, target)
    for name in os.listdir(source):  # common.pt, metadata.json: Megatron's non-tensor files, as they were
        if not name.endswith(".distcp") and name != ".metadata":
            shutil.copy(os.path.join(source, name), os.path.join(target, name))
    common = torch.load(os.path.join(target, "common.pt"), weights_only=False)
    common["optimizer"]["param_state_sharding_type"] = "dp_reshardable"
    torch.save(common, os.path.join(target, "common.pt"))


def body(data_path, root):
    data = ["--data-path", data_path]
    original = run_pretrain("pretrain_gpt", data + LEG + ["--save", os.path.join(root, "a")])
    mega = os.path.join(root, "megatron")
    _rewrite_as_dp_reshardable(os.path.join(root, "a", "iter_0000002"), os.path.join(mega, "iter_0000002"))
    with open(os.path.join(mega, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    files_before = sorted(os.listdir(os.path.join(mega, "iter_0000002")))
    try:
        run_pretrain("pretrain_gpt", data + LEG + ["--load", mega])
        refusal = None
    except Exception as e:  # noqa: BLE001  (the message is what is checked)
        refusal = str(e)
    unchanged = sorted(os.listdir(os.path.join(mega, "iter_0000002"))) == files_before
    resumed = run_pretrain("pretrain_gpt", data + LEG + ["--load", mega, "--no-load-optim"])
    return {"original": {r["iteration"]: r["loss"]["lm loss"] for r in original},
            "resumed": {r["iteration"]: r["loss"]["lm loss"] for r in resumed},
            "lr": {r["iteration"]: r["lr"] for r in original}, "lr_resumed": {r["iteration"]: r["lr"] for r in resumed},
            "refusal": refusal, "unchanged": unchanged}


def test_dp_reshardable_optimizer_refused_then_no_load_optim_resumes(tmp_path):
    (tmp_path / "data").mkdir()
    data = preprocess_corpus_slice(str(tmp_path / "data"))
    out = run_distributed(body, 1, data, str(tmp_path / "ckpt"), timeout=300)[0]
    message = out["refusal"]
    print("refusal:", message)
    assert message is not None, "a dp_reshardable optimizer state was loaded without complaint"
    assert "\n" not in message and "dp_reshardable" in message and "--no-load-optim" in message, message
    assert os.path.join("megatron", "iter_0000002") in message, message
    assert out["unchanged"]
    # --no-load-optim: weights and iteration load (iteration 3's loss is computed before any step: it must equal the
    # original run's); the scheduler restarts (iteration 3 gets iteration 1's learning rate), so iteration 4 differs.
    assert sorted(out["resumed"]) == [3, 4], out["resumed"]
    assert abs(out["resumed"][3] - out["original"][3]) <= 1e-5 * abs(out["original"][3]), out
    assert out["lr_resumed"][3] == out["lr"][1] and out["lr"][3] != out["lr"][1], out
    assert out["resumed"][4] != out["original"][4]
