"""megatron.legacy.model (also importable as megatron.model): Megatron's legacy model API over megatron.core."""
import importlib

from megatron.legacy.model.bert_model import BertModel
from megatron.legacy.model.classification import Classification
from megatron.legacy.model.fused_layer_norm import MixedFusedLayerNorm as LayerNorm
from megatron.legacy.model.fused_layer_norm import RMSNorm
from megatron.legacy.model.gpt_model import GPTModel
from megatron.legacy.model.t5_model import T5Model
from megatron.legacy.model.language_model import get_language_model
from megatron.legacy.model.module import Float16Module
from megatron.legacy.model.multiple_choice import MultipleChoice

# DistributedDataParallel is resolved lazily (below), so it is not part of `import *`.
__all__ = ["LayerNorm", "RMSNorm", "BertModel", "GPTModel", "T5Model", "Classification", "MultipleChoice",
           "get_language_model", "Float16Module"]


def __getattr__(name):
    # The data-parallel wrapper belongs to megatron.core.distributed (another part of the library).
    if name == "DistributedDataParallel":
        return importlib.import_module("megatron.core.distributed").DistributedDataParallel
    raise AttributeError(f"module 'megatron.legacy.model' has no attribute {name!r}")
