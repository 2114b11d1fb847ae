"""Legacy import path ``megatron.utils`` (re-exports of megatron.training.utils)."""
from megatron.training.utils import is_last_rank, is_rank_0, print_rank_0, print_rank_last  # noqa: F401
