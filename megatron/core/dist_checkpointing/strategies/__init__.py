"""Save and load strategies of ``megatron.core.dist_checkpointing`` (only the ``torch_dist`` backend, version 1,
and the ``torch`` common backend exist)."""
from megatron.core.dist_checkpointing.strategies.base import (  # noqa: F401
    AsyncSaveShardedStrategy, LoadCommonStrategy, LoadShardedStrategy, SaveCommonStrategy, SaveShardedStrategy,
    StrategyAction, get_default_strategy)
