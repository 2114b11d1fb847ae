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
    oracle = oracle_dir()
    if not os.path.isdir(os.path.join(oracle, "megatron", "core")):
        message = (f"megatron-core 0.16.1 not found in {oracle} (set MCORE_ORACLE_DIR, or run .ci/run which installs "
                   "it with pip install --no-deps --target .venv/mcore-oracle megatron-core==0.16.1)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return oracle
