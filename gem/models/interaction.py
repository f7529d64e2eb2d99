"""Feature interaction over token sets ``Z [B, M, d]`` -> ``[B, F, d]`` (F output tokens).

* :class:`DotInteraction` - pairwise dot products (DLRM), then a linear map to ``F`` tokens.
* :class:`DCNv2` - low-rank cross layers ``x_{l+1} = x_0 * (U V^T x_l + b) + x_l`` on the
  flattened tokens (DCN-V2), then a linear map.
* :class:`InteractionEnsemble` - DHEN-style: several of the above side by side, summed,
  normed, residual; stacking ensembles layer after layer builds DHEN's hierarchy.
* :class:`WukongLayer` - Wukong's Factorization Machine Block (optionally a mixture of FMB
  experts) next to its Linear Compression Block, normed, residual.

Every module states its forward FLOPs (``flops(batch_size)``).
"""

from __future__ import annotations

import torch
from torch import nn

from gem.models.layers import dot_interaction
from gem.models.sequence import linear_flops


class DotInteraction(nn.Module):
    def __init__(self, num_in: int, num_out: int, dim: int) -> None:
        super().__init__()
        self.num_in, self.dim = num_in, dim
        self.proj = nn.Linear(num_in * (num_in - 1) // 2, num_out * dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.proj(dot_interaction(z))  # [B, F*d]

    def flops(self, batch_size: int) -> int:
        gram = 2 * batch_size * self.num_in * self.num_in * self.dim
        return gram + linear_flops(batch_size, self.proj.in_features, self.proj.out_features)


class DCNv2(nn.Module):
    """Low-rank DCN-V2 cross network over the flattened tokens, then a linear map to ``F`` tokens."""

    def __init__(self, num_in: int, num_out: int, dim: int, num_layers: int = 2, rank: int = 32) -> None:
        super().__init__()
        width = num_in * dim
        self.down = nn.ModuleList(nn.Linear(width, rank, bias=False) for _ in range(num_layers))
        self.up = nn.ModuleList(nn.Linear(rank, width) for _ in range(num_layers))
        self.proj = nn.Linear(width, num_out * dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x0 = x = z.flatten(1)
        for down, up in zip(self.down, self.up):
            x = x0 * up(down(x)) + x
        return self.proj(x)

    def flops(self, batch_size: int) -> int:
        cross = sum(
            linear_flops(batch_size, d.in_features, d.out_features)
            + linear_flops(batch_size, u.in_features, u.out_features)
            for d, u in zip(self.down, self.up)
        )
        return cross + linear_flops(batch_size, self.proj.in_features, self.proj.out_features)


INTERACTIONS = {"dot": DotInteraction, "dcnv2": DCNv2}


class InteractionEnsemble(nn.Module):
    """DHEN-style layer: ``x + LayerNorm(sum_i module_i(Z))`` with ``x`` = the first ``F`` tokens of ``Z``.

    Args:
        kinds: interaction names, any of ``INTERACTIONS`` (e.g. ``["dot", "dcnv2"]``).
        num_in / num_out: tokens in ``Z`` and out (``num_out <= num_in``); dim: token width.
    """

    def __init__(self, kinds: list[str], num_in: int, num_out: int, dim: int) -> None:
        super().__init__()
        unknown = [k for k in kinds if k not in INTERACTIONS]
        if unknown or not kinds:
            raise ValueError(f"model.interaction: {kinds} must be a non-empty list of {sorted(INTERACTIONS)}")
        self.num_out, self.dim = num_out, dim
        self.experts = nn.ModuleList(INTERACTIONS[k](num_in, num_out, dim) for k in kinds)
        self.norm = nn.LayerNorm(dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        mixed = sum(e(z) for e in self.experts).view(z.shape[0], self.num_out, self.dim)
        return z[:, : self.num_out] + self.norm(mixed)

    def flops(self, batch_size: int) -> int:
        return sum(e.flops(batch_size) for e in self.experts)


class FactorizationMachineBlock(nn.Module):
    """Wukong's FMB: ``flatten(Z (Y^T Z)^T)`` (all token pairs through a rank-``k`` projection ``Y [M, k]``),
    LayerNorm, MLP -> ``[B, F*d]``."""

    def __init__(self, num_in: int, num_out: int, dim: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.num_in, self.rank, self.dim = num_in, rank, dim
        self.compress = nn.Linear(num_in, rank, bias=False)  # Y^T, applied over the token axis
        self.norm = nn.LayerNorm(num_in * rank)
        self.mlp = nn.Sequential(nn.Linear(num_in * rank, hidden), nn.SiLU(), nn.Linear(hidden, num_out * dim))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        zc = self.compress(z.transpose(1, 2))  # [B, d, k]
        pairs = torch.bmm(z, zc)  # [B, M, k]
        return self.mlp(self.norm(pairs.flatten(1)))

    def flops(self, batch_size: int) -> int:
        b, m, k, d = batch_size, self.num_in, self.rank, self.dim
        return (
            linear_flops(b * d, m, k)
            + 2 * b * m * k * d
            + sum(linear_flops(b, l.in_features, l.out_features) for l in self.mlp if isinstance(l, nn.Linear))
        )


class WukongLayer(nn.Module):
    """One Wukong layer over ``Z [B, M, d]``: FMB tokens (``num_out - num_lcb``) next to LCB tokens
    (``num_lcb``, a linear map over the token axis), LayerNorm, plus the first ``num_out`` tokens of Z.

    With ``num_experts > 1`` the FMB is a softmax-gated mixture of experts (gate on the mean token).
    """

    def __init__(
        self,
        num_in: int,
        num_out: int,
        dim: int,
        rank: int = 8,
        hidden: int = 256,
        num_lcb: int | None = None,
        num_experts: int = 1,
    ) -> None:
        super().__init__()
        num_lcb = num_out // 2 if num_lcb is None else num_lcb
        if not 0 <= num_lcb < num_out:
            raise ValueError(f"model.wukong.num_lcb={num_lcb} must be in [0, {num_out}) (the non-sequence token count)")
        self.num_fmb, self.num_out, self.dim = num_out - num_lcb, num_out, dim
        self.fmb = nn.ModuleList(
            FactorizationMachineBlock(num_in, self.num_fmb, dim, rank, hidden) for _ in range(num_experts)
        )
        self.gate = nn.Linear(dim, num_experts) if num_experts > 1 else None
        self.lcb = nn.Linear(num_in, num_lcb, bias=False) if num_lcb else None
        self.norm = nn.LayerNorm(dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        b = z.shape[0]
        if self.gate is None:
            fmb = self.fmb[0](z)
        else:
            weights = torch.softmax(self.gate(z.mean(1)), dim=-1)  # [B, E]
            fmb = (torch.stack([e(z) for e in self.fmb], dim=1) * weights[:, :, None]).sum(1)
        parts = [fmb.view(b, self.num_fmb, self.dim)]
        if self.lcb is not None:
            parts.append(self.lcb(z.transpose(1, 2)).transpose(1, 2))  # [B, num_lcb, d]
        return z[:, : self.num_out] + self.norm(torch.cat(parts, dim=1))

    def flops(self, batch_size: int) -> int:
        total = sum(e.flops(batch_size) for e in self.fmb)
        if self.gate is not None:
            total += linear_flops(batch_size, self.gate.in_features, self.gate.out_features)
        if self.lcb is not None:
            total += linear_flops(batch_size * self.dim, self.lcb.in_features, self.lcb.out_features)
        return total
