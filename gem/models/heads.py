"""Multi-task, multi-domain heads."""

from __future__ import annotations

import torch
from torch import nn

from gem.models.layers import MLP


class MultiTaskHeads(nn.Module):
    """One tower per task over a shared representation, plus a learned per-(domain, task) bias.

    Args:
        in_dim: width of the shared representation.
        num_tasks / num_domains: from the schema.
        tower_dims: hidden widths of each task tower (empty: a single linear layer per task).

    ``forward(x [B, in_dim], domain [B]) -> logits [B, num_tasks]``.
    """

    def __init__(self, in_dim: int, num_tasks: int, num_domains: int, tower_dims: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(MLP(in_dim, tower_dims), nn.Linear(tower_dims[-1] if tower_dims else in_dim, 1))
            for _ in range(num_tasks)
        )
        self.domain_bias = nn.Parameter(torch.zeros(num_domains, num_tasks))

    def init_weights(self) -> None:
        for tower in self.towers:
            tower[0].init_weights()
            nn.init.xavier_uniform_(tower[1].weight)
            nn.init.zeros_(tower[1].bias)
        nn.init.zeros_(self.domain_bias)

    def forward(self, x: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        logits = torch.cat([tower(x) for tower in self.towers], dim=1)
        return logits + self.domain_bias[domain]
