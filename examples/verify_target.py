"""A target for ``torchport verify`` and ``torchport bench``: a small convolutional classifier and a batch of images.

    torchport verify examples/verify_target.py:factory --device npu --plot verify.png
    torchport bench examples/verify_target.py:factory --device npu --batch-sizes 1,8,32 --plot bench.png

A target is any ``package.module:function`` or ``file.py:function`` that returns ``(model, inputs)``. This one takes
a ``batch_size`` keyword, which ``torchport bench`` uses to build each batch size it measures.
"""

from __future__ import annotations

import torch
from torch import nn


class SmallNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def factory(batch_size: int = 2) -> tuple[nn.Module, torch.Tensor]:
    """The model (seeded weights) and ``batch_size`` random 3x32x32 images."""
    torch.manual_seed(0)
    model = SmallNet()
    images = torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return model, images
