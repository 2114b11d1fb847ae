"""Legacy path of the index helpers (re-exports of megatron.core.datasets.helpers)."""
from megatron.core.datasets.helpers import (  # noqa: F401
    build_blending_indices, build_blocks_mapping, build_exhaustive_blending_indices, build_mapping, build_sample_idx)
