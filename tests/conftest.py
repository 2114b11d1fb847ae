import os

# Tests run on CPU with gloo even on a machine that has a GPU.
os.environ.setdefault("MEGATRON_FORCE_CPU", "1")
