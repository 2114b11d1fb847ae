"""Legacy path of the blended dataset (``BlendableDataset`` is megatron-core's ``BlendedDataset``)."""
from megatron.core.datasets.blended_dataset import BlendedDataset  # noqa: F401

BlendableDataset = BlendedDataset
