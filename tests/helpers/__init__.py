"""Shared test helpers, imported as ``from helpers.<module> import ...`` (``tests/`` is on sys.path: pytest puts
the directory of the top-level ``tests/conftest.py`` there, spawned ranks inherit it, and child scripts get it through
``helpers.child_env()``)."""
import os

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_DIR = os.path.dirname(TESTS_DIR)


def child_pythonpath() -> str:
    """PYTHONPATH for a child script that imports ``helpers`` and ``megatron`` from this checkout."""
    return os.pathsep.join([REPO_DIR, TESTS_DIR])
