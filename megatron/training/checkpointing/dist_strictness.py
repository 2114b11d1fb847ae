"""Checks before reading a torch_dist checkpoint: readable ``.metadata``, shard files present and long enough, and
``--dist-ckpt-strictness`` (Megatron-LM's vocabulary).

*Unexpected* keys are requested by this run but absent from the checkpoint; *missing* keys are in the checkpoint
but requested by no rank (known only after gathering every rank's request).

===================== ======================================================= ======================
value                 unexpected                                              missing
===================== ======================================================= ======================
assume_ok_unexpected  not pre-checked: the read fails naming the first one    ignored
log_unexpected        warned, dropped from the request (initial values kept)  ignored
log_all               warned, dropped                                         warned
raise_unexpected      one error before reading                                ignored
raise_all             one error before reading                                one error
return_unexpected     as log_unexpected (there is no caller to return to)     ignored
return_all            as log_all                                              warned
ignore_all            dropped silently                                        ignored
===================== ======================================================= ======================

Every rank takes the same decision (the findings are gathered), so no rank is left waiting in the collective read.
"""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from megatron.core.dist_checkpointing.sharded_io import shard_file_problem

STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all")


class StoredKeys(dict):
    """``{DCP key: storage metadata}`` of a checkpoint; ``dcp_metadata``: the whole DCP metadata (where each chunk
    is stored)."""

    dcp_metadata: object


def read_metadata_checked(directory: str, error_cls) -> StoredKeys:
    """The checkpoint's DCP metadata; a missing, truncated or corrupt ``.metadata`` is one error line."""
    path = os.path.join(directory, ".metadata")
    if not os.path.isfile(path):
        raise error_cls(f"torch_dist checkpoint {directory} has no .metadata file (not a complete torch_dist "
                        "checkpoint)")
    try:
        md = dcp.FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 - truncated or corrupt pickle: name the file
        raise error_cls(f"torch_dist checkpoint {directory}: its .metadata cannot be read (truncated or corrupt): "
                        f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from e
    stored = StoredKeys(md.state_dict_metadata)
    stored.dcp_metadata = md
    return stored


def _is_rank0():
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _gather(obj):
    if not torch.distributed.is_initialized():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def check_request(request: dict, stored: StoredKeys, directory: str, strictness: str, error_cls) -> None:
    """Apply ``strictness`` to ``request`` (drops keys in place) and check the shard files it needs."""
    if strictness not in STRICTNESS:
        raise error_cls(f"--dist-ckpt-strictness {strictness!r} is not one of {', '.join(STRICTNESS)}")
    unexpected = sorted(k for k in request if k not in stored)
    problem = shard_file_problem(directory, [k for k in request if k in stored], stored.dcp_metadata)
    problems = [problem] if problem else []
    want_missing = strictness in ("log_all", "raise_all", "return_all")
    reports = _gather((unexpected if strictness != "assume_ok_unexpected" else [], problems[:1],
                       sorted(request) if want_missing else []))
    problems = sorted({p for r in reports for p in r[1]})
    if problems:
        raise error_cls(f"torch_dist checkpoint {directory}: {problems[0]}")
    all_unexpected = sorted({k for r in reports for k in r[0]})
    if all_unexpected:
        if strictness.startswith("raise"):
            raise error_cls(f"torch_dist checkpoint {directory} lacks {len(all_unexpected)} key(s) this model needs, "
                            f"first {all_unexpected[0]!r} (--dist-ckpt-strictness {strictness}; log_unexpected "
                            "keeps their initial values)")
        if strictness != "ignore_all" and _is_rank0():
            print(f"WARNING: unexpected keys (not found in the checkpoint {directory}), left at their initial "
                  f"values: {all_unexpected}", flush=True)
        for key in unexpected:
            del request[key]
    if want_missing:
        requested = {k for r in reports for k in r[2]}
        missing = sorted(k for k in stored if k not in requested)
        if missing and strictness == "raise_all":
            raise error_cls(f"torch_dist checkpoint {directory} holds {len(missing)} key(s) this model does not use, "
                            f"first {missing[0]!r} (--dist-ckpt-strictness raise_all)")
        if missing and _is_rank0():
            print(f"WARNING: missing keys (in the checkpoint {directory} but not used): {missing}", flush=True)
