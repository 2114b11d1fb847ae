"""megatron.model.utils (legacy path): init methods, mask function, linear layer, gelu variants, norm factory."""
from megatron.core.models.common import language_model as _lm
from megatron.core.activations import erf_gelu, openai_gelu  # noqa: F401
from megatron.core.fusions.fused_softmax import attention_mask_func  # noqa: F401
from megatron.core.transformer.norms import get_norm  # noqa: F401
from megatron.core.utils import init_method_normal, scaled_init_method_normal  # noqa: F401
from megatron.legacy.model.global_args import args_as_parallel_config

gelu_impl = openai_gelu


def get_linear_layer(rows, columns, init_method):
    """``torch.nn.Linear`` with ``init_method`` weights (unless --no-initialization) and zero bias."""
    return _lm.get_linear_layer(rows, columns, init_method,
                                perform_initialization=args_as_parallel_config().perform_initialization)


__all__ = ["init_method_normal", "scaled_init_method_normal", "attention_mask_func", "get_linear_layer", "gelu_impl",
           "openai_gelu", "erf_gelu", "get_norm"]
