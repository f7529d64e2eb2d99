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


class MultiDomainHeads(nn.Module):
    """Multi-domain learning over a shared representation ``x [B, in_dim]``.

    * ``mode="gate"``: a learned per-domain gate ``2 * sigmoid(g_domain)`` (1 at init) scales the
      shared representation, then one set of task towers (with per-(domain, task) biases).
    * ``mode="towers"``: one set of task towers per domain; each example uses its domain's.

    ``forward(x, domain [B]) -> logits [B, num_tasks]``.
    """

    def __init__(
        self, in_dim: int, num_tasks: int, num_domains: int, tower_dims: tuple[int, ...] = (), mode: str = "gate"
    ) -> None:
        super().__init__()
        if mode not in ("gate", "towers"):
            raise ValueError(f"model.domain_mode={mode!r} must be 'gate' or 'towers'")
        self.mode = mode
        num_sets = num_domains if mode == "towers" else 1
        self.heads = nn.ModuleList(MultiTaskHeads(in_dim, num_tasks, num_domains, tower_dims) for _ in range(num_sets))
        self.gate = nn.Parameter(torch.zeros(num_domains, in_dim)) if mode == "gate" else None

    def init_own_parameters(self) -> None:
        for heads in self.heads:
            heads.init_weights()
        if self.gate is not None:
            nn.init.zeros_(self.gate)

    def forward(self, x: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.heads[0](x * 2 * torch.sigmoid(self.gate[domain]), domain)
        logits = torch.stack([heads(x, domain) for heads in self.heads], dim=1)  # [B, num_domains, K]
        return logits.gather(1, domain.view(-1, 1, 1).expand(-1, 1, logits.shape[2])).squeeze(1)

    def flops(self, batch_size: int) -> int:
        linears = [m for m in self.heads.modules() if isinstance(m, nn.Linear)]
        return sum(2 * batch_size * m.in_features * m.out_features for m in linears)
