"""Determinism: the same seed and layout give bit-identical losses run to run on CPU (dropout on, TP=2 and DP=2),
and ``--deterministic-mode`` sets what makes GPU runs repeatable (and is honoured on CPU too)."""
import os

import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.train_helpers import preprocess_corpus_slice, run_pretrain

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "4", "--log-interval", "1"]
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"], "dp2": []}
DETERMINISTIC_ENV = ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO")


def _bits(records):
    """Every logged loss and grad norm as the hex of its exact value."""
    return [(r["iteration"], {k: float(v).hex() for k, v in r["loss"].items()},
             None if r["grad_norm"] is None else float(r["grad_norm"]).hex()) for r in records]


def determinism_body(data):
    out = {}
    for name, layout in LAYOUTS.items():
        out[name] = _bits(run_pretrain("pretrain_gpt", ["--data-path", data] + DROPOUT + layout))
    # The same TP=2 run with --deterministic-mode: initialize_megatron must switch the settings on.
    out["tp2_deterministic"] = _bits(run_pretrain("pretrain_gpt", ["--data-path", data, "--deterministic-mode"]
                                                  + DROPOUT + LAYOUTS["tp2"]))
    out["tp2_no_dropout"] = _bits(run_pretrain("pretrain_gpt", ["--data-path", data] + DROPOUT[4:] + LAYOUTS["tp2"]))
    out["settings"] = {"algorithms": torch.are_deterministic_algorithms_enabled(),
                       "cudnn_deterministic": torch.backends.cudnn.deterministic,
                       "cudnn_benchmark": torch.backends.cudnn.benchmark,
                       **{name: os.environ.get(name) for name in DETERMINISTIC_ENV}}
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("det_data")), num_docs=200)


@pytest.mark.slow  # bit-identical reruns are also asserted by every exact-resume test
@pytest.mark.timeout(300)
def test_rel_same_seed_and_layout_give_bit_identical_losses(data):
    first = run_distributed(determinism_body, 2, data, timeout=240)
    second = run_distributed(determinism_body, 2, data, timeout=240)
    for rank in range(2):
        for name in list(LAYOUTS) + ["tp2_deterministic"]:
            a, b = first[rank][name], second[rank][name]
            assert len(a) == 4 and all(r[1] for r in a), (name, a)
            assert a == b, f"rank {rank}, layout {name}: losses differ between two runs\n{a}\n{b}"
        # Dropout is on (the losses are not those of the same run without dropout), so the random streams are
        # part of what repeats exactly.
        with_dropout, without = first[rank]["tp2"][0][1]["lm loss"], first[rank]["tp2_no_dropout"][0][1]["lm loss"]
        assert abs(float.fromhex(with_dropout) - float.fromhex(without)) > 1e-4
        # On CPU the deterministic settings do not change a single bit of the computation.
        assert first[rank]["tp2_deterministic"] == first[rank]["tp2"]
        settings = first[rank]["settings"]
        assert settings["algorithms"] and settings["cudnn_deterministic"] and not settings["cudnn_benchmark"]
        assert settings["NCCL_ALGO"] == "Ring" and settings["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert settings["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"


@pytest.fixture
def restore_global_settings():
    env = {name: os.environ.get(name) for name in DETERMINISTIC_ENV}
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    yield
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]


def _parse(extra):
    from megatron.training.arguments import parse_args, validate_args
    from helpers.train_helpers import GPT_ARGS
    args = parse_args(argv=GPT_ARGS + ["--mock-data"] + extra)
    args.rank, args.world_size = 0, 1
    validate_args(args)
    return args


def test_rel_deterministic_mode_flag(restore_global_settings, monkeypatch):
    from megatron.training.deterministic import apply_deterministic_mode
    from megatron.training.errors import ConfigurationError

    for name in DETERMINISTIC_ENV:
        monkeypatch.delenv(name, raising=False)
    assert _parse([]).deterministic_mode is False
    assert apply_deterministic_mode(_parse([])) == {}
    assert "NCCL_ALGO" not in os.environ and not torch.are_deterministic_algorithms_enabled()

    set_here = apply_deterministic_mode(_parse(["--deterministic-mode"]))
    assert set_here == {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    # A user's valid choice is kept.
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert "NCCL_ALGO" not in apply_deterministic_mode(_parse(["--deterministic-mode"]))
    assert os.environ["NCCL_ALGO"] == "Tree" and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    # What cannot be deterministic is refused by validate_args, naming the flag or variable.
    with pytest.raises(ConfigurationError, match="--use-flash-attn"):
        _parse(["--deterministic-mode", "--use-flash-attn"])
    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    with pytest.raises(ConfigurationError, match="NCCL_ALGO"):
        _parse(["--deterministic-mode"])
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ConfigurationError, match="CUBLAS_WORKSPACE_CONFIG"):
        _parse(["--deterministic-mode"])
