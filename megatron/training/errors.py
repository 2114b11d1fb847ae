"""The one exception type for user configuration errors, and the entry-point helper that reports it.

Every mistake a user can make on the command line (a flag combination that cannot work, a size that does not
divide, a deprecated flag) raises :class:`ConfigurationError` with a one-line message that names the flag(s)
and says what to change. Entry points wrap their ``main`` in :func:`exit_on_configuration_error` so the user
sees ``error: <message>`` on stderr and exit code 2 (argparse's own code for bad usage), not a traceback.
"""
from __future__ import annotations

import contextlib
import sys


class ConfigurationError(ValueError):
    """A flag or flag combination that cannot work; the message names the flag(s) and the fix."""


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
            message = " ".join(str(exc).split())  # one line, whatever the message contained
            print(f"error: {message}", file=sys.stderr, flush=True)
            sys.exit(2)
        return False
