"""The strategy interfaces and the registry of default strategies by (action, backend, version)."""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Dict, Tuple

from megatron.core.dist_checkpointing.core import CheckpointingException


class StrategyAction(enum.Enum):
    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


_DEFAULTS: Dict[Tuple[str, str, int], type] = {}


def register_default_strategy(action: StrategyAction, backend: str, version: int, cls: type) -> None:
    _DEFAULTS[(action.value, backend, version)] = cls


def get_default_strategy(action: StrategyAction, backend: str, version: int):
    """A new instance of the default strategy for ``action`` on ``backend`` (``version``)."""
    # The torch_dist and torch strategies register themselves on import.
    from megatron.core.dist_checkpointing.strategies import common, torch as _torch  # noqa: F401

    try:
        return _DEFAULTS[(action.value, backend, version)]()
    except KeyError:
        known = sorted({f"{b} v{v}" for a, b, v in _DEFAULTS if a == action.value})
        raise CheckpointingException(f"no {action.value} strategy for backend {backend!r} version {version} "
                                     f"(this library has: {', '.join(known)})") from None


class LoadStrategyBase(ABC):
    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def check_backend_compatibility(self, loaded_backend) -> None:
        """Raise when the checkpoint's backend cannot be read by this strategy."""

    def check_version_compatibility(self, loaded_version) -> None:
        """Raise when the checkpoint's backend version cannot be read by this strategy."""


class SaveStrategyBase(ABC):
    def __init__(self, backend: str, version: int):
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def __str__(self):
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    @abstractmethod
    def load_common(self, checkpoint_dir: str):
        """The common (non-sharded) state dict."""


class LoadShardedStrategy(LoadStrategyBase):
    @abstractmethod
    def load(self, sharded_state_dict, checkpoint_dir: str):
        """The state dict with every sharded leaf replaced by its loaded value."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: str):
        """``{key: ShardedTensor without data}`` of every stored tensor (global shape and dtype)."""

    def load_sharded_metadata(self, checkpoint_dir: str):
        """As :meth:`load_tensors_metadata`, plus the stored objects."""
        return self.load_tensors_metadata(checkpoint_dir)


class SaveCommonStrategy(SaveStrategyBase):
    @abstractmethod
    def save_common(self, common_state_dict, checkpoint_dir: str) -> None:
        """Write the common state dict (rank 0)."""


class SaveShardedStrategy(SaveStrategyBase):
    @abstractmethod
    def save(self, sharded_state_dict, checkpoint_dir: str) -> None:
        """Collective: write every rank's main replicas."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    @abstractmethod
    def async_save(self, sharded_state_dict, checkpoint_dir: str):
        """An AsyncRequest that writes the snapshot taken now when run."""

    def save(self, sharded_state_dict, checkpoint_dir: str) -> None:
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()
