"""A DCP file-system reader that reads a checkpoint's ``.metadata`` once and keeps it."""
from __future__ import annotations

import os
from typing import Union

from torch.distributed.checkpoint import FileSystemReader, Metadata


class CachedMetadataFileSystemReader(FileSystemReader):
    """``FileSystemReader(path)`` whose :meth:`read_metadata` unpickles ``.metadata`` on the first call only; later
    calls (DCP's planning on every load through this reader) return the same object."""

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        super().__init__(path=path)
        self._cached_metadata = None

    def read_metadata(self) -> Metadata:
        if self._cached_metadata is None:
            self._cached_metadata = super().read_metadata()
        return self._cached_metadata
