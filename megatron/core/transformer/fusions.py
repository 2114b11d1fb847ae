"""Re-exports of the fused element-wise ops for older import paths; their home is :mod:`megatron.core.fusions`
(``fused_kernels``, ``fused_bias_gelu``, ``fused_bias_dropout``, ``fused_softmax``) and the activations are in
:mod:`megatron.core.activations`."""
from megatron.core.activations import erf_gelu, openai_gelu, squared_relu  # noqa: F401
from megatron.core.fusions.fused_bias_dropout import (  # noqa: F401
    bias_dropout_add,
    get_bias_dropout_add,
    get_bias_dropout_add_func,
)
from megatron.core.fusions.fused_bias_gelu import GeLUFunction, bias_gelu, bias_gelu_back, bias_gelu_impl  # noqa: F401
from megatron.core.fusions.fused_kernels import (  # noqa: F401
    COMPILE_ON_CPU_ENV,
    NO_COMPILE_ENV,
    compile_blocker,
    compiled,
)
from megatron.core.utils import log_once  # noqa: F401
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax, attention_mask_func, causal_mask  # noqa: F401
