"""``--use-torch-fsdp2``: PyTorch's FSDP2 on Megatron's model (``TorchFullyShardedDataParallel``, megatron-core's
class and signature).

Units, as Megatron chooses them: every ``TransformerLayer``, the ``LanguageModelEmbedding``, the
``RotaryEmbedding`` (it holds no parameter, so it is left out), the ``ColumnParallelLinear`` output layer (the
column-parallel layers inside transformer layers belong to their layer's unit), any class listed in a module's
``_fsdp_modules``, then the root. Weights are resharded after forward unless ``reshard_after_forward`` is False
(``--torch-fsdp2-no-reshard-after-forward``). The sharding math is in ``fsdp/sharded_module.py``.
"""
from __future__ import annotations

from typing import Optional, Set, Type

import torch

from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.sharded_module import FullyShardedModule, units_of_types
from megatron.core.models.common.embedding import LanguageModelEmbedding
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.rotary import RotaryEmbedding
from megatron.core.transformer.transformer_layer import TransformerLayer

DEFAULT_SUB_MODULES_TO_WRAP = frozenset({TransformerLayer, LanguageModelEmbedding, RotaryEmbedding,
                                         ColumnParallelLinear})


class TorchFullyShardedDataParallel(FullyShardedModule):
    """``TorchFullyShardedDataParallel(config, ddp_config, module)``: ``module`` sharded in place over the DP x CP
    group (``process_group``) with ``fully_shard``."""

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 sub_modules_to_wrap: Set[Type[torch.nn.Module]] = DEFAULT_SUB_MODULES_TO_WRAP,
                 disable_bucketing: bool = False, process_group=None):
        units = units_of_types(module, tuple(sub_modules_to_wrap))
        super().__init__(config, ddp_config, module, units, strategy="optim_grads_params",
                         reshard_after_forward=getattr(ddp_config, "reshard_after_forward", True),
                         dp_cp_group=process_group or parallel_state.get_data_parallel_group(with_context_parallel=True))
