"""Multi-task loss with label masks and per-task weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def multitask_bce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, task_weights: torch.Tensor,
                  example_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked binary cross-entropy.

    Args:
        logits / labels: ``[B, K]``; mask ``[B, K]`` bool (False: unobserved, contributes nothing).
        task_weights: ``[K]``; example_weights: optional ``[B]``.

    Returns:
        ``(loss, per_task [K])``: each task's loss is the (weighted) mean over its observed
        examples; ``loss = sum_k task_weights[k] * per_task[k]``. A task with no observed example
        in the batch contributes 0.
    """
    bce = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    weight = mask.float()
    if example_weights is not None:
        weight = weight * example_weights.float().unsqueeze(1)
    per_task = (bce * weight).sum(0) / weight.sum(0).clamp_min(1e-12)
    return (per_task * task_weights).sum(), per_task.detach()
