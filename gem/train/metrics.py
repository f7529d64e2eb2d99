"""Evaluation metrics: exact AUC (ties averaged) and normalized entropy (NE).

NE is the mean log loss divided by the entropy of the base rate (the log loss of always
predicting the observed positive rate): below 1 means better than the base rate.
"""

from __future__ import annotations

import math

import torch


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels``; ties count one half.

    Returns NaN when only one class is present.
    """
    scores = scores.double().flatten()
    labels = labels.flatten() > 0.5
    num_pos = int(labels.sum())
    num_neg = labels.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # Average the ranks of tied scores.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    rank_sum = ranks[labels].sum().item()
    return (rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)


def normalized_entropy(probs: torch.Tensor, labels: torch.Tensor, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of ``probs`` divided by the entropy of the mean label."""
    p = probs.double().clamp(eps, 1 - eps).flatten()
    y = labels.double().flatten()
    if y.numel() == 0:
        return float("nan")
    log_loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean().item()
    base = y.mean().item()
    if base <= 0 or base >= 1:
        return float("nan")
    entropy = -(base * math.log(base) + (1 - base) * math.log(1 - base))
    return log_loss / entropy


class TaskEvaluator:
    """Accumulates masked predictions per task, then reports AUC, NE, log loss and counts."""

    def __init__(self, tasks: tuple[str, ...]) -> None:
        self.tasks = tasks
        self.reset()

    def reset(self) -> None:
        self._logits: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        self._mask: list[torch.Tensor] = []

    def update(self, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
        self._logits.append(logits.detach().float().cpu())
        self._labels.append(labels.detach().float().cpu())
        self._mask.append(mask.detach().cpu())

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything seen so far, from every rank when torch.distributed is initialized."""
        local = [torch.cat(x) if x else torch.zeros(0, len(self.tasks)) for x in (self._logits, self._labels, self._mask)]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            parts: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, local)
            local = [torch.cat([p[i] for p in parts]) for i in range(3)]
        return local[0], local[1], local[2].bool()

    def compute(self) -> dict[str, float]:
        logits, labels, mask = self.gathered()
        out: dict[str, float] = {}
        for k, task in enumerate(self.tasks):
            m = mask[:, k]
            p = torch.sigmoid(logits[m, k])
            y = labels[m, k]
            out[f"{task}/auc"] = auc(p, y)
            out[f"{task}/ne"] = normalized_entropy(p, y)
            out[f"{task}/count"] = int(m.sum())
        return out
