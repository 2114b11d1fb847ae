"""megatron.core.dist_checkpointing.sharded_io on 2 gloo ranks: chunks with global offsets, read back at other
offsets, offline in one process, vocabulary-padding mismatch and shape errors."""
import os

import pytest
import torch

from helpers.dist_harness import run_distributed

FULL = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
GATED = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3) + 1000  # [2, ffn, h]


def save_body(directory):
    from megatron.core.dist_checkpointing import LocalShard, save_sharded

    r = torch.distributed.get_rank()
    state = {
        "row_split": LocalShard(FULL[3 * r:3 * r + 3].clone(), (6, 4), (3 * r, 0)),
        "col_split": LocalShard(FULL[:, 2 * r:2 * r + 2].clone(), (6, 4), (0, 2 * r)),
        "gated": LocalShard(GATED[:, 2 * r:2 * r + 2].clone(), (2, 4, 3), (0, 2 * r, 0)),
        "replicated": LocalShard(FULL.clone() * 2, (6, 4), (0, 0)),  # both ranks offer it: written once
        f"object.{r}": {"rank": r},
    }
    save_sharded(state, directory)
    return sorted(n for n in os.listdir(directory))


def test_shards_reassemble_in_any_slicing(tmp_path):
    from megatron.core.dist_checkpointing import LocalShard, ShardingError, load_full_state_dict, load_sharded

    directory = str(tmp_path / "ckpt")
    files = run_distributed(save_body, 2, directory, timeout=60)[0]
    assert ".metadata" in files and any(f.endswith(".distcp") for f in files)

    full = load_full_state_dict(directory)
    assert torch.equal(full["row_split"], FULL) and torch.equal(full["col_split"], FULL)
    assert torch.equal(full["gated"], GATED) and torch.equal(full["replicated"], FULL * 2)
    assert full["object.0"] == {"rank": 0} and full["object.1"] == {"rank": 1}

    # A slice crossing both saved chunks, in another split dimension (a TP=3-like layout of a row-split tensor).
    request = {"row_split": LocalShard(torch.zeros(2, 4), (6, 4), (2, 0)),
               "col_split": LocalShard(torch.zeros(6, 1), (6, 4), (0, 1)),
               "gated": LocalShard(torch.zeros(2, 1, 3), (2, 4, 3), (0, 3, 0)), "object.1": None}
    load_sharded(request, directory, no_dist=True)
    assert torch.equal(request["row_split"].data, FULL[2:4])
    assert torch.equal(request["col_split"].data, FULL[:, 1:2])
    assert torch.equal(request["gated"].data, GATED[:, 3:4])
    assert request["object.1"] == {"rank": 1}

    # A larger (vocabulary-padded) target: rows the checkpoint lacks stay zero when the mismatch is allowed.
    padded = {"row_split": LocalShard(torch.full((8, 4), -1.0), (8, 4), (0, 0))}
    padded["row_split"].data.zero_()
    load_sharded(padded, directory, allow_shape_mismatch=["row_split"], no_dist=True)
    assert torch.equal(padded["row_split"].data[:6], FULL) and not padded["row_split"].data[6:].any()
    with pytest.raises(ShardingError, match="has global shape \\(6, 4\\), this model expects \\(8, 4\\)"):
        load_sharded({"row_split": LocalShard(torch.zeros(8, 4), (8, 4), (0, 0))}, directory, no_dist=True)
    with pytest.raises(ShardingError, match="the checkpoint has no entry 'missing'"):
        load_sharded({"missing": LocalShard(torch.zeros(1), (1,), (0,))}, directory, no_dist=True)
