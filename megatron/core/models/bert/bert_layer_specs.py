"""Layer spec of megatron-core's BertModel: pre-LN layer with bidirectional (padding-masked) self-attention."""
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, default_layer_submodules

bert_layer_local_spec = ModuleSpec(module=TransformerLayer, submodules=default_layer_submodules(AttnMaskType.padding))
