"""Bad torch_dist input gives one error line naming the checkpoint directory and the key (or file), and leaves the
checkpoint as it was; --dist-ckpt-strictness decides about keys the model needs that the checkpoint lacks
(unexpected) and checkpoint keys the model does not use (missing)."""
import hashlib
import os
import shutil

import pytest
import torch

from helpers.dist_harness import run_distributed


def _model(hidden=32):
    from helpers.models_helpers import tiny_config
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(3)
    return GPTModel(tiny_config(style="llama", hidden_size=hidden), get_gpt_layer_local_spec(), 64, 16,
                    position_embedding_type="rope")


def _save(directory, drop=(), extra=None):
    from megatron.core.dist_checkpointing import LocalShard, save_sharded
    from megatron.training.checkpointing import torch_dist as dc

    state = dc.model_sharded_state([_model()])
    for key in drop:
        del state[key]
    if extra:
        state[extra] = LocalShard(torch.ones(3), (3,), (0,))
    save_sharded(state, directory)


def _load(directory, strictness="assume_ok_unexpected", hidden=32):
    """(error line or None, the loaded model's final norm weight)."""
    from megatron.training.checkpointing import torch_dist as dc

    model = _model(hidden)
    request = dc.model_sharded_state([model], for_load=True)
    try:
        dc.load_sharded_checked(request, directory, strictness)
    except dc.DistCheckpointError as e:
        return str(e), None
    dc.apply_loaded_model([model], request, strict=False)
    return None, model.decoder.final_layernorm.weight.detach().clone()


def _digest(directory):
    h = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()


def body(root):
    good = os.path.join(root, "good")
    _save(good)
    results = {}

    def case(name, directory, **kw):
        before = _digest(directory)
        results[name] = _load(directory, **kw)[0]
        assert _digest(directory) == before, f"{name}: the checkpoint was modified"

    case("ok", good)
    missing_file = os.path.join(root, "missing_file")
    shutil.copytree(good, missing_file)
    os.remove(os.path.join(missing_file, "__0_0.distcp"))
    case("missing_file", missing_file)
    truncated = os.path.join(root, "truncated")
    shutil.copytree(good, truncated)
    with open(os.path.join(truncated, ".metadata"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(truncated, ".metadata")) // 2)
    case("truncated_metadata", truncated)
    case("shape", good, hidden=64)
    unknown = os.path.join(root, "unknown")
    _save(unknown, extra="decoder.layers.self_attention.not_a_megatron_key")
    case("unknown_default", unknown)
    case("unknown_raise_all", unknown, strictness="raise_all")
    lacking = os.path.join(root, "lacking")
    _save(lacking, drop=("decoder.final_layernorm.weight",))
    case("lacking_default", lacking)
    case("lacking_raise_unexpected", lacking, strictness="raise_unexpected")
    case("lacking_log_unexpected", lacking, strictness="log_unexpected")
    case("lacking_ignore_all", lacking, strictness="ignore_all")
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(body, 1, str(tmp_path_factory.mktemp("dist_bad")), timeout=180)[0]


def test_bad_input_one_line_naming_directory_and_key(results, tmp_path_factory):
    for name, message in results.items():
        if message is not None:
            print(f"{name}: {message}")
            assert "\n" not in message and "torch_dist checkpoint /" in message, (name, message)
    assert results["ok"] is None
    assert "missing_file" in results["missing_file"] and "__0_0.distcp" in results["missing_file"] \
        and "is missing" in results["missing_file"]
    assert ".metadata cannot be read" in results["truncated_metadata"]
    assert "has global shape (32,), this model expects (64,)" in results["shape"] and "'decoder." in results["shape"]
    assert "lacking" in results["lacking_default"] and "'decoder.final_layernorm.weight'" in results["lacking_default"]


def test_strictness_values(results):
    assert results["unknown_default"] is None  # assume_ok_unexpected ignores checkpoint keys nobody asks for
    assert "not_a_megatron_key" in results["unknown_raise_all"] and "raise_all" in results["unknown_raise_all"]
    assert "decoder.final_layernorm.weight" in results["lacking_raise_unexpected"]
    assert results["lacking_log_unexpected"] is None and results["lacking_ignore_all"] is None


def test_auto_detect_ckpt_format(tmp_path):
    import argparse

    from megatron.training.checkpointing import load_format

    for fmt, marker in (("torch_dist", "metadata.json"), ("torch", "mp_rank_00")):
        root = tmp_path / fmt
        (root / "iter_0000003").mkdir(parents=True)
        (root / "latest_checkpointed_iteration.txt").write_text("3")
        if fmt == "torch":
            (root / "iter_0000003" / marker).mkdir()
        else:
            (root / "iter_0000003" / marker).write_text("{}")
        other = "torch" if fmt == "torch_dist" else "torch_dist"
        args = argparse.Namespace(ckpt_format=other, auto_detect_ckpt_format=True, ckpt_step=None)
        assert load_format(args, str(root)) == fmt
        args.auto_detect_ckpt_format = False
        assert load_format(args, str(root)) == other
