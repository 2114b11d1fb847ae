"""The checkpoint directory's format record (``metadata.json``) and the package's exception.

A directory is a distributed checkpoint when its ``metadata.json`` parses into :class:`CheckpointingConfig`:
``{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
"common_backend_version": 1}`` (megatron-core 0.16.1 writes all four; unknown fields are ignored on read).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

CONFIG_FNAME = "metadata.json"


class CheckpointingException(Exception):
    """A sharded state dict or a checkpoint directory that cannot be saved or loaded as asked."""


@dataclasses.dataclass
class CheckpointingConfig:
    """Which backends stored the sharded tensors and the common (non-sharded) objects, and their versions."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


def maybe_load_config(checkpoint_dir: Optional[str]) -> Optional[CheckpointingConfig]:
    """The checkpoint's :class:`CheckpointingConfig`, or None when ``checkpoint_dir`` holds no ``metadata.json``."""
    if not checkpoint_dir:
        return None
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    known = {f.name for f in dataclasses.fields(CheckpointingConfig)}
    return CheckpointingConfig(**{k: v for k, v in raw.items() if k in known})


def check_is_distributed_checkpoint(checkpoint_dir) -> bool:
    """True iff ``checkpoint_dir`` has a ``metadata.json`` that parses as a checkpoint config."""
    try:
        return maybe_load_config(checkpoint_dir) is not None
    except (ValueError, TypeError):
        return False


def save_config(config: CheckpointingConfig, checkpoint_dir: str) -> None:
    """Write ``metadata.json`` (the last file of a save: its presence marks the checkpoint complete)."""
    with open(os.path.join(checkpoint_dir, CONFIG_FNAME), "w") as f:
        json.dump(dataclasses.asdict(config), f)
