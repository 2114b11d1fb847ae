"""A mock image + text dataset (megatron-core's placeholder for multimodal models): the mock GPT samples with a
zero image ``[3, image_h, image_w]`` added, then ``config.preprocess_func`` applied to the sample dict."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset


def _unchanged(sample: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return sample


@dataclass
class MultimodalDatasetConfig(GPTDatasetConfig):
    """A GPTDatasetConfig with the image size (``image_h``, ``image_w``, both required) and ``preprocess_func``
    (sample dict -> sample dict; the identity by default)."""

    image_h: Optional[int] = None
    image_w: Optional[int] = None
    preprocess_func: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]] = _unchanged

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("image_h", "image_w"):
            if getattr(self, name) is None:
                raise ValueError(f"MultimodalDatasetConfig.{name} must be set (the image size)")


class MockMultimodalDataset(MockGPTDataset):
    """MockGPTDataset whose samples also hold ``image``, a float32 zero tensor ``[3, image_h, image_w]``."""

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        sample = super().__getitem__(idx)
        sample["image"] = torch.zeros(3, self.config.image_h, self.config.image_w, dtype=torch.float32)
        return self.config.preprocess_func(sample)
