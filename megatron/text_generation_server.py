"""Megatron's older import path for the REST server: ``megatron.text_generation_server.MegatronServer``."""
from megatron.inference.text_generation_server import MegatronServer, follower_loop  # noqa: F401
