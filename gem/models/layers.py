"""Small building blocks shared by the dense architectures."""

from __future__ import annotations

from collections.abc import Sequence

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


@torch.no_grad()
def init_module_tree(root: nn.Module) -> None:
    """Initialize every parameter under ``root`` (after ``to_empty``): a module's own
    ``init_own_parameters`` if it has one, else Xavier-uniform linears with zero biases, unit
    LayerNorms and N(0, 0.05) embeddings. Fails naming any parameter no rule covered."""
    done: set[int] = set()
    for module in root.modules():
        if hasattr(module, "init_own_parameters"):
            module.init_own_parameters()
        elif isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.05)
        else:
            continue
        done.update(id(p) for p in module.parameters())
    missing = [n for n, p in root.named_parameters() if id(p) not in done]
    if missing:
        raise RuntimeError(f"init_weights has no rule for {missing}")
