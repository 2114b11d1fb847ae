"""Megatron's older import path: ``megatron.text_generation`` is ``megatron.inference.text_generation``."""
from megatron.inference.text_generation import *  # noqa: F401,F403
from megatron.inference.text_generation import (beam_search, beam_search_and_post_process, generate,  # noqa: F401
                                                generate_and_post_process)
