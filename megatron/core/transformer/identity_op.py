"""megatron-core's path of the identity modules of specs (defined in :mod:`megatron.core.transformer.spec_utils`)."""
from megatron.core.transformer.spec_utils import IdentityFuncOp, IdentityOp  # noqa: F401
