"""Megatron-FSDP's package metadata (megatron-core's ``megatron_fsdp.package_info``): the standalone API version
whose names and signatures this package provides (megatron-core 0.16.1 ships Megatron-FSDP 0.3.1)."""

MAJOR = 0
MINOR = 3
PATCH = 1
PRE_RELEASE = ""

VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)

__shortversion__ = ".".join(str(v) for v in VERSION[:3])
__version__ = __shortversion__ + PRE_RELEASE

__package_name__ = "megatron_fsdp"
__contact_names__ = "the maintainers of this Megatron-LM-compatible library"
__contact_emails__ = ""
__homepage__ = "https://github.com/NVIDIA/Megatron-LM/tree/main/megatron/core/distributed/fsdp"
__repository_url__ = "https://github.com/NVIDIA/Megatron-LM/tree/main/megatron/core"
__download_url__ = "https://github.com/NVIDIA/Megatron-LM/releases"
__description__ = ("Megatron-FSDP: fully sharded data parallelism (ZeRO-2/3) for any torch.nn.Module over a "
                   "DeviceMesh, on PyTorch FSDP2")
__license__ = "BSD-3"
__keywords__ = "deep learning, fully sharded data parallel, FSDP, ZeRO, pytorch, transformer"
