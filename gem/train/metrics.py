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
        local = [
            torch.cat(x) if x else torch.zeros(0, len(self.tasks)) for x in (self._logits, self._labels, self._mask)
        ]
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
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


# -- ranking over candidate groups -------------------------------------------------------------
RANKING_KS = {"hr": (1, 5, 10), "ndcg": (5, 10)}


def id_mapping_counts(sparse_arch: torch.nn.Module) -> dict[str, float]:
    """The SparseArch's raw-id mapping counts since the last call (``sparse.ids``, gem/sparse/ids.py):
    ``ids/<table>/collisions`` and, for managed collisions, ``/evictions`` and ``/occupied``; {} without
    mapped tables. Collisions are counted on this rank's batches, evictions and occupancy are global."""
    arch = sparse_arch.module if hasattr(sparse_arch, "module") else sparse_arch  # DMP / DDP wrapper
    mapper = getattr(arch, "ids", None)
    return mapper.pop_counts() if mapper is not None else {}


def positive_ranks(scores: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """0-based rank of every positive among the negatives of its group (``[P]`` int64).

    ``scores``, ``labels`` (1 = positive) and ``groups`` (request ids) are ``[N]``. A positive's
    rank counts the negatives of its group scoring higher *or equal*: ties count against the
    model, so a constant scorer ranks last rather than first.

    Example, one group of a positive and three negatives::

        # scores  [0.9, 0.9, 0.95, 0.1]   labels [1, 0, 0, 0]   -> rank 2 (0.95 and the tie)
    """
    positive = labels.flatten() > 0.5
    _, group = torch.unique(groups.flatten(), return_inverse=True)
    _, level = torch.unique(scores.double().flatten(), return_inverse=True)  # exact, order-preserving
    # One int64 key ordering by (group, score); count each group's negatives at or above a positive.
    span = int(level.max()) + 2 if level.numel() else 1
    neg_key, _ = torch.sort(group[~positive] * span + level[~positive])
    pos_group = group[positive]
    group_end = torch.searchsorted(neg_key, pos_group * span + span - 1)
    at_or_above = torch.searchsorted(neg_key, pos_group * span + level[positive])
    return group_end - at_or_above


def ranking_metrics(ranks: torch.Tensor) -> dict[str, float]:
    """HR@{1,5,10}, NDCG@{5,10} and MRR from 0-based ranks (one positive per row), each with its
    standard error over the rows (``hr@10_se``, ...: the per-row values' sample standard deviation
    over the square root of their count), the sampling error of an evaluation set of that size."""
    ranks = ranks.double()
    gain = 1.0 / torch.log2(ranks + 2.0)
    per_row = {f"hr@{k}": (ranks < k).double() for k in RANKING_KS["hr"]}
    per_row |= {f"ndcg@{k}": torch.where(ranks < k, gain, 0.0) for k in RANKING_KS["ndcg"]}
    per_row["mrr"] = 1.0 / (ranks + 1.0)
    n = ranks.numel()
    out = {}
    for name, values in per_row.items():
        out[name] = values.mean().item() if n else float("nan")
        out[f"{name}_se"] = (values.std() / n**0.5).item() if n > 1 else float("nan")
    return out


class RankingEvaluator:
    """Groups scored candidates by request id and reports ranking metrics per task.

    ``update(logits [B, K], labels [B, K], mask [B, K], request_id [B])``; ``compute()`` gathers
    every rank's rows first, so a group split across batches or ranks is still ranked whole.
    Keys: ``<task>/hr@10``, ``<task>/ndcg@10``, ``<task>/mrr``, ``<task>/groups`` ..., and each metric's
    standard error over the groups (``<task>/ndcg@10_se``, ...).
    """

    def __init__(self, tasks: tuple[str, ...]) -> None:
        self.tasks = tasks
        self._parts = TaskEvaluator(tasks)
        self._ids: list[torch.Tensor] = []

    def update(self, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, request_id: torch.Tensor) -> None:
        self._parts.update(logits, labels, mask)
        self._ids.append(request_id.detach().long().cpu())

    def has_groups(self) -> bool:
        return bool(self._ids)

    def compute(self) -> dict[str, float]:
        logits, labels, mask = self._parts.gathered()
        ids = torch.cat(self._ids) if self._ids else torch.zeros(0, dtype=torch.long)
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            parts: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, ids)
            ids = torch.cat(parts)
        out: dict[str, float] = {}
        for k, task in enumerate(self.tasks):
            m = mask[:, k]
            ranks = positive_ranks(logits[m, k], labels[m, k], ids[m])
            out |= {f"{task}/{name}": v for name, v in ranking_metrics(ranks).items()}
            out[f"{task}/groups"] = int(ranks.numel())
        return out
