"""megatron.model.module (legacy path): MegatronModule and ``Float16Module(module, args)``."""
from types import SimpleNamespace

from megatron.core.transformer import module as _core
from megatron.core.transformer.module import (  # noqa: F401
    MegatronModule,
    conversion_helper,
    float16_to_fp32,
    fp32_to_float16,
    param_is_not_shared,
)


class Float16Module(_core.Float16Module):
    """Legacy signature ``Float16Module(module, args)``; precision from ``args.fp16`` / ``args.bf16``."""

    def __init__(self, module, args):
        precision = SimpleNamespace(fp16=bool(getattr(args, "fp16", False)), bf16=bool(getattr(args, "bf16", False)))
        super().__init__(precision, module)
        # Schedules look up `.config` through wrappers: expose the wrapped model's TransformerConfig.
        self.config = getattr(module, "config", None) or precision


__all__ = ["MegatronModule", "Float16Module", "fp32_to_float16", "float16_to_fp32", "conversion_helper",
           "param_is_not_shared"]
