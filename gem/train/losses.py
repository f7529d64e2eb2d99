"""Multi-task loss with label masks and per-task weights."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def multitask_bce(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    task_weights: torch.Tensor,
    example_weights: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    teacher: torch.Tensor | None = None,
    distill_weight: torch.Tensor | float = 0.0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked binary cross-entropy, optionally mixed with a teacher's soft labels (distillation).

    Args:
        logits / labels: ``[B, K]``; mask ``[B, K]`` bool (False: unobserved, contributes nothing).
        task_weights: ``[K]``; example_weights: optional ``[B]``.
        teacher: optional ``[B, K]`` teacher logits. Each task's per-example loss is then
            ``(1 - w_k) * BCE(z, y) + w_k * T^2 * BCE(z / T, sigmoid(t / T))`` with
            ``w_k = distill_weight[k]`` (a float: every task) and ``T = temperature``; the ``T^2``
            keeps the soft term's gradient on the scale of the hard one (Hinton et al. 2015).
            Masked like the true labels. A task with ``w_k = 0`` ignores its teacher column.
        group: the data-parallel group when each rank holds a slice of the global batch. Each
            task is then normalized by its observed (weighted) count over the *global* batch (one
            all-reduce of ``[2, K]``), and the returned loss is scaled by the group size, so that
            the gradients averaged over ranks by DDP / FSDP / TorchRec equal the single-process
            gradients of the global batch exactly. None: this rank's batch is the whole batch.

    Returns:
        ``(loss, per_task [K])``: each task's loss is the (weighted) mean over its observed
        examples; ``loss = sum_k task_weights[k] * per_task[k]``. A task with no observed example
        in the batch contributes 0. With ``group``, ``per_task`` is the global batch's (identical
        on every rank) and ``loss`` is this rank's term of the global loss times the group size.
    """
    bce = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    if teacher is not None:
        w = torch.as_tensor(distill_weight, dtype=torch.float32, device=bce.device).expand(bce.shape[1])
        used = w > 0
        t = torch.where(used, teacher.float(), torch.zeros((), device=bce.device))  # unused columns may be NaN
        soft = F.binary_cross_entropy_with_logits(
            logits.float() / temperature, torch.sigmoid(t / temperature), reduction="none"
        )
        bce = (1 - w) * bce + w * temperature**2 * soft
    weight = mask.float()
    if example_weights is not None:
        weight = weight * example_weights.float().unsqueeze(1)
    summed, count = (bce * weight).sum(0), weight.sum(0)
    if group is None or dist.get_world_size(group) == 1:
        per_task = summed / count.clamp_min(1e-12)
        return (per_task * task_weights).sum(), per_task.detach()
    totals = torch.stack([summed.detach(), count])  # [2, K]: global loss sums and observed counts
    dist.all_reduce(totals, group=group)
    global_count = totals[1].clamp_min(1e-12)
    loss = dist.get_world_size(group) * ((summed / global_count) * task_weights).sum()
    return loss, totals[0] / global_count
