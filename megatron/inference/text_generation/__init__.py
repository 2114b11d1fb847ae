"""Text generation with Megatron's API (greedy / top-k / top-p sampling, beam search, KV cache, TP and PP)."""
from .api import beam_search, beam_search_and_post_process, generate, generate_and_post_process  # noqa: F401
from .forward_step import ForwardStep  # noqa: F401
from .sampling import sample  # noqa: F401
