import os
import sys

# Make tests/dist_harness.py importable from every test folder and in spawned ranks.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Tests run on CPU with gloo even on a machine that has a GPU.
os.environ.setdefault("MEGATRON_FORCE_CPU", "1")
