"""The one exception type for user configuration errors, and the entry-point helper that reports it.

Every mistake a user can make on the command line (a flag combination that cannot work, a size that does not
divide, a deprecated flag) raises :class:`ConfigurationError` with a one-line message that names the flag(s)
and says what to change. Entry points wrap their ``main`` in :func:`exit_on_configuration_error` so the user
sees ``error: <message>`` on stderr and exit code 2 (argparse's own code for bad usage), not a traceback; the
line is printed by local rank 0 only (every rank of a node raises the same error), every rank exits.

Faults found while running (a damaged or mismatching checkpoint, a NaN found by
``--check-for-nan-in-loss-and-grad``) raise a :class:`FatalRunError` subclass: the same helper prints it as one
line and exits with code 1. When every rank raises the same error (``same_on_every_rank``), only global rank 0
prints it, so the user reads it once.
"""
from __future__ import annotations

import contextlib
import sys

from megatron.core.errors import ConfigurationError  # noqa: F401  (one class for core and training)


class FatalRunError(RuntimeError):
    """A fault that stops the run; the message is one line naming the file, flag, rank or iteration.

    ``same_on_every_rank=True`` says every rank raises this very message (after a collective or from identical
    inputs), so the entry point prints it on global rank 0 only.
    """

    def __init__(self, message: str, same_on_every_rank: bool = False):
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


class AgreedExit(SystemExit):
    """Every rank leaves with this exit code after the same collective decided so (the rerun state machine's 16
    and 17): an orderly stop, not a failure of one rank."""


def _first_to_report(fallback: bool) -> bool:
    """Under torchrun, True for the first local rank that fails (the agent stops the other ranks as soon as one
    exits, so waiting for a particular rank to print could lose the message); elsewhere ``fallback``."""
    import os
    import tempfile

    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return fallback
    # The local ranks of one launch share their parent (the torchrun agent) and the master port.
    marker = os.path.join(tempfile.gettempdir(),
                          f"megatron-error-reported-{os.getppid()}-{os.environ.get('MASTER_PORT', '')}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return fallback


def _local_rank() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) or 0)


def _global_rank() -> int:
    import os

    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - reporting an error must not raise another
        pass
    return int(os.environ.get("RANK", "0"))


class exit_on_configuration_error(contextlib.ContextDecorator):
    """Context manager / decorator: turn a ConfigurationError into ``error: <message>`` and exit code 2.

        with exit_on_configuration_error():
            initialize_megatron(...)

        @exit_on_configuration_error()
        def main(): ...
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and issubclass(exc_type, ConfigurationError):
            # Every rank validates the same flags (and its own node's files): one line per node, not per rank.
            if _first_to_report(fallback=_local_rank() == 0):
                message = " ".join(str(exc).split())  # one line, whatever the message contained
                print(f"error: {message}", file=sys.stderr, flush=True)
            sys.exit(2)
        if exc_type is not None and issubclass(exc_type, FatalRunError):
            if not getattr(exc, "same_on_every_rank", False) or _first_to_report(fallback=_global_rank() == 0):
                message = " ".join(str(exc).split())
                print(f"error: {message}", file=sys.stderr, flush=True)
            sys.exit(1)
        return False
