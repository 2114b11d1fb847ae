"""megatron.model.transformer (legacy path): megatron.core's transformer classes with Megatron's legacy
constructor signatures; every model setting is a field of the ``TransformerConfig`` passed in."""
from megatron.core.transformer import attention as _attn
from megatron.core.transformer import dot_product_attention as _dpa
from megatron.core.transformer import mlp as _mlp
from megatron.core.transformer import transformer_block as _block
from megatron.core.transformer import transformer_layer as _layer
from megatron.core.transformer.attention import FlashSelfAttention  # noqa: F401
from megatron.core.transformer.enums import AttnMaskType, AttnType, LayerType, ModelType
from megatron.core.fusions.fused_bias_dropout import bias_dropout_add, get_bias_dropout_add_func  # noqa: F401
from megatron.core.transformer.transformer_layer import DropPath, NoopTransformerLayer  # noqa: F401


class ParallelMLP(_mlp.ParallelMLP):
    def __init__(self, config, is_expert=False):
        super().__init__(config, is_expert)


class CoreAttention(_dpa.CoreAttention):
    def __init__(self, layer_number, config, attn_mask_type=AttnMaskType.padding):
        super().__init__(layer_number, config, attn_mask_type)


class ParallelAttention(_attn.ParallelAttention):
    def __init__(self, config, layer_number, attention_type=AttnType.self_attn, attn_mask_type=AttnMaskType.padding):
        super().__init__(config, layer_number, attention_type, attn_mask_type)


class ParallelTransformerLayer(_layer.ParallelTransformerLayer):
    def __init__(self, config, layer_number, layer_type=LayerType.encoder, self_attn_mask_type=AttnMaskType.padding,
                 drop_path_rate=0.0):
        super().__init__(config, layer_number, layer_type, self_attn_mask_type, drop_path_rate)


class ParallelTransformer(_block.ParallelTransformer):
    def __init__(self, config, model_type=ModelType.encoder_or_decoder, layer_type=LayerType.encoder,
                 self_attn_mask_type=AttnMaskType.padding, post_layer_norm=True, pre_process=True, post_process=True,
                 drop_path_rate=0.0):
        super().__init__(config, model_type, layer_type, self_attn_mask_type, post_layer_norm,
                         pre_process, post_process, drop_path_rate)


def get_bias_dropout_add(training):
    """``f(x, bias, residual, prob)`` (unfused)."""
    return get_bias_dropout_add_func(training, fused=False)


def bias_dropout_add_fused_train(x, bias, residual, prob):
    return get_bias_dropout_add_func(True, fused=True, on_cuda=x.is_cuda)(x, bias, residual, prob)


def bias_dropout_add_fused_inference(x, bias, residual, prob):
    return get_bias_dropout_add_func(False, fused=True, on_cuda=x.is_cuda)(x, bias, residual, prob)
