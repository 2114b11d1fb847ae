"""The ``torch`` common backend: rank 0 writes the common (non-sharded) state dict to ``common.pt``.

Reading tolerates classes it does not know: a ``common.pt`` written by another program (Megatron-LM's ``args``
hold its own enums) loads with such objects replaced by placeholders that keep their pickled state.
"""
from __future__ import annotations

import io
import os
import pickle

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.base import (LoadCommonStrategy, SaveCommonStrategy, StrategyAction,
                                                              register_default_strategy)

COMMON_STATE_FNAME = "common.pt"


class _Placeholder:
    """Stands for a class pickled by another program that this package does not define."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Placeholder,), {"__module__": "megatron_checkpoint." + module})


class _TolerantPickle:
    Unpickler = _TolerantUnpickler
    load = staticmethod(pickle.load)
    __name__ = "pickle"


def write_durably(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file that is fsync'ed and then renamed over it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def common_bytes(common_state_dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(common_state_dict, buffer)
    return buffer.getvalue()


def read_common_state_dict(checkpoint_dir: str):
    """``common.pt`` of ``checkpoint_dir`` (unknown classes become placeholders); one error naming the file."""
    path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_TolerantPickle)
    except FileNotFoundError:
        raise CheckpointingException(f"{path} does not exist: not a complete torch_dist checkpoint") from None
    except Exception as e:  # noqa: BLE001 - corrupt or truncated file: say which
        raise CheckpointingException(f"could not read {path} (corrupt or truncated?): {type(e).__name__}: "
                                     f"{e}") from e


class TorchCommonSaveStrategy(SaveCommonStrategy):
    def __init__(self, backend: str = "torch", version: int = 1):
        super().__init__(backend, version)

    def save_common(self, common_state_dict, checkpoint_dir: str) -> None:
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            os.makedirs(checkpoint_dir, exist_ok=True)
            write_durably(os.path.join(checkpoint_dir, COMMON_STATE_FNAME), common_bytes(common_state_dict))


class TorchCommonLoadStrategy(LoadCommonStrategy):
    def load_common(self, checkpoint_dir: str):
        return read_common_state_dict(checkpoint_dir)


def register_default_common_strategies() -> None:
    """Register this module's strategies as the defaults of their backend (done on import)."""
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, TorchCommonSaveStrategy)
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy)


register_default_common_strategies()
