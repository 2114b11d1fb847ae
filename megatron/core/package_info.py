"""Version of this library's megatron-core API (megatron-core's ``megatron.core.package_info`` fields): the
megatron-core release whose API and checkpoint format it follows."""

MAJOR = 0
MINOR = 16
PATCH = 1
PRE_RELEASE = ""

VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
__shortversion__ = ".".join(map(str, VERSION[:3]))
__version__ = __shortversion__ + "".join(VERSION[3:])
__package_name__ = "megatron_core"
__description__ = "megatron-core's API, implemented by this library (CPU and GPU, pure PyTorch paths)"
__license__ = "Apache2"
