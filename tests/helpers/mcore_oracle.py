"""Where the real megatron-core 0.16.1 (the test oracle) is: ``$MCORE_ORACLE_DIR``, else ``<repo>/.venv/mcore-oracle``
(``.ci/run`` installs it there with ``pip install --no-deps --target``). It is never installed into the test
environment itself; oracle code runs in subprocesses with ``PYTHONPATH`` set to this directory."""
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def oracle_dir() -> str:
    return os.environ.get("MCORE_ORACLE_DIR", os.path.join(REPO, ".venv", "mcore-oracle"))


def require_oracle() -> str:
    """The oracle directory; without it the test fails under CI (``$CI`` set) and is skipped elsewhere."""
    import glob

    oracle = oracle_dir()
    # The installed distribution's metadata, not just a megatron/core folder: our own repository has one too, and
    # an oracle that is secretly our code would compare the code against itself.
    if not (os.path.isdir(os.path.join(oracle, "megatron", "core"))
            and glob.glob(os.path.join(oracle, "megatron_core-*.dist-info"))):
        message = (f"megatron-core 0.16.1 not found in {oracle} (set MCORE_ORACLE_DIR to the --target directory that "
                   "holds megatron/ and megatron_core-*.dist-info, or run .ci/run which installs it with pip install "
                   "--no-deps --target .venv/mcore-oracle megatron-core==0.16.1)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return oracle


class OracleRun:
    """A megatron-core oracle subprocess started by :func:`start_oracle`; :meth:`result` waits for it."""

    def __init__(self, argv, cwd):
        import subprocess
        import sys

        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PYTHONPATH=require_oracle(), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, *[str(a) for a in argv]], cwd=str(cwd), env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self, timeout: float = 400) -> str:
        """Its stdout; fails with its stderr unless it exits 0 (killed after ``timeout`` seconds)."""
        import subprocess

        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        assert self.proc.returncode == 0, f"megatron-core oracle failed:\n{err[-4000:]}"
        return out


def start_oracle(argv, cwd) -> OracleRun:
    """Start ``python <argv>`` with the oracle as the only PYTHONPATH entry, in ``cwd`` (outside our repository, so
    that its ``megatron`` package is the one imported), without waiting: in-process tests can run meanwhile on the
    other core."""
    return OracleRun(argv, cwd)


def run_oracle(argv, cwd, timeout: float = 400) -> str:
    """:func:`start_oracle` and wait: its stdout; fails with its stderr unless it exits 0."""
    return start_oracle(argv, cwd).result(timeout)
