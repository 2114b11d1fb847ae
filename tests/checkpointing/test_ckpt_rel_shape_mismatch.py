"""--load of a checkpoint saved from another model shape or layout: one CheckpointError line that lists every
mismatching flag and names the checkpoint, raised identically on every rank before any tensor is copied (not a
torch size-mismatch traceback)."""
import os

from helpers.ckpt_helpers import run_leg
from helpers.dist_harness import run_distributed

SMALL = ["--mock-data", "--num-layers", "2", "--train-iters", "2", "--eval-iters", "1", "--lr-warmup-iters", "0"]


def _error_of(extra):
    from megatron.training.errors import FatalRunError

    try:
        run_leg(SMALL + extra)
    except FatalRunError as e:
        return type(e).__name__, str(e), e.same_on_every_rank
    return None


def mismatch_body(root):
    out = {}
    for fmt in ("torch", "torch_dist"):
        d = os.path.join(root, fmt)
        fmt_flags = ["--ckpt-format", fmt]
        run_leg(SMALL + fmt_flags + ["--save", d, "--save-interval", "2"])
        load = fmt_flags + ["--load", d]
        out[fmt] = {
            "hidden": _error_of(load + ["--hidden-size", "64"]),
            "layers_and_heads": _error_of(load + ["--num-layers", "4", "--num-attention-heads", "8"]),
            "vocab": _error_of(load + ["--make-vocab-size-divisible-by", "256"]),
            "tp": _error_of(load + ["--tensor-model-parallel-size", "2"]),
        }
    return out


def test_shape_mismatch_lists_every_flag_and_the_checkpoint(tmp_path):
    results = run_distributed(mismatch_body, 2, str(tmp_path), timeout=300)
    assert results[0] == results[1]  # every rank raises the same one-line error
    for fmt in ("torch", "torch_dist"):
        out = results[0][fmt]
        iter_dir = os.path.join(str(tmp_path), fmt, "iter_0000002")
        for case, expected in (
                ("hidden", ["--hidden-size is 64 here but 32 in the checkpoint"]),
                ("layers_and_heads", ["--num-layers is 4 here but 2 in the checkpoint",
                                      "--num-attention-heads is 8 here but 4 in the checkpoint"]),
                ("vocab", ["--make-vocab-size-divisible-by is 256 here but 128 in the checkpoint"])):
            name, message, same = out[case]
            assert "\n" not in message and same, (fmt, case, message)
            assert message.startswith(f"checkpoint {iter_dir} was saved from a model of another shape: "), message
            for piece in expected:
                assert piece in message, (fmt, case, message)
            assert "size mismatch" not in message
        if fmt == "torch":
            name, message, _ = out["tp"]  # a torch-format checkpoint only loads with its own layout; the error says how to convert
            assert "(TP=1, PP=1) but this run uses (TP=2, PP=1)" in message and iter_dir in message, message
            assert out["tp"][2] and "\n" not in message
        else:  # torch_dist reshards TP on load, so only the real shape checks apply: it loads
            assert out["tp"] is None, out["tp"]
