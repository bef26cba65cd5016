"""Models the trainer can build by name. The demo: a small CNN for 8×8 digit images."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nightshift.plugins import Registry

MODELS: Registry[nn.Module] = Registry("model")
register_model = MODELS.register


@register_model("digits_cnn")
class DigitsCNN(nn.Module):
    """Two 3×3 convolutions and two dense layers over a 1×H×W image given as a flat row."""

    def __init__(self, input_shape: tuple[int, int, int] = (1, 8, 8), num_classes: int = 10,
                 channels: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        c, h, w = self.input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * (h // 2) * (w // 2), hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(-1, *self.input_shape)))


@register_model("mlp")
class MLP(nn.Module):
    """A dense baseline: flat features → hidden → outputs (its width and outputs come from the data: the
    trainer passes the split's `input_shape` and `num_classes`, which is 1 for a regression task)."""

    def __init__(self, input_shape: tuple[int, ...] = (64,), num_classes: int = 10, hidden: int = 128) -> None:
        super().__init__()
        features = 1
        for d in input_shape:
            features *= d
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the model registered as `name` (or importable as `module:factory`)."""
    return MODELS.get(name)(**kwargs)
