"""Small building blocks shared by the dense architectures."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    """Linear -> activation stacks; the last layer has an activation too unless ``last_activation=False``."""

    def __init__(self, in_dim: int, dims: Sequence[int], last_activation: bool = True, activation=nn.SiLU) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, d in enumerate(dims):
            layers.append(nn.Linear(in_dim, d))
            if i < len(dims) - 1 or last_activation:
                layers.append(activation())
            in_dim = d
        self.net = nn.Sequential(*layers)
        self.out_dim = in_dim

    def init_weights(self) -> None:
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def dot_interaction(features: torch.Tensor) -> torch.Tensor:
    """Pairwise dot products of ``features [B, F, D]`` -> upper triangle ``[B, F*(F-1)/2]``."""
    num_features = features.shape[1]
    gram = torch.bmm(features, features.transpose(1, 2))
    rows, cols = torch.triu_indices(num_features, num_features, offset=1, device=features.device)
    return gram[:, rows, cols]
