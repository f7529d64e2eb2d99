"""Optimizers: AdamW for dense parameters, row-wise Adagrad for embedding tables, LR schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from gem.train.config import OptimConfig


def build_optimizers(model: nn.Module, cfg: OptimConfig, total_steps: int):
    """Returns ``(dense_optimizer, sparse_optimizer or None, schedule)``.

    Parameters under ``sparse_arch`` are embedding tables. Tables that TorchRec shards with a
    fused kernel carry their optimizer into backward (they are updated by ``loss.backward()``);
    every other table (unsharded, native, or TorchRec's data-parallel tables, which the fused
    optimizer does not cover) is stepped by :class:`TouchedRowsAdagrad`: TorchRec's plain-torch
    ``RowWiseAdagrad``, the same update rule, with ``optim.sparse.weight_decay`` on the touched rows.
    ``optim.sparse.name=adagrad`` swaps both for element-wise Adagrad (FBGEMM's exact Adagrad when
    fused), whose update does not depend on how a row's columns are split.

    The schedule (:class:`LRSchedule`) scales every one of them, the tables' too: Adagrad's first
    update moves each touched row by about its learning rate whatever the gradient's size, which
    for gem_base's tables (initialized within +-0.05, learning rate 0.05) is the whole row.
    """
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    # Frozen parameters (requires_grad False, checkpoint.init_frozen) are left out: no update, no weight decay.
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch.") and p.requires_grad]
    # On GPUs one fused kernel for every parameter, the same update rule (gem_base InterFormer on
    # an H200: 0.34 ms of device time per step instead of the foreach implementation's 0.74 ms).
    fused = bool(dense_params) and all(p.is_cuda for p in dense_params)
    dense = torch.optim.AdamW(
        dense_params,
        lr=cfg.dense.lr,
        betas=tuple(cfg.dense.betas),
        eps=cfg.dense.eps,
        weight_decay=cfg.dense.weight_decay,
        fused=fused or None,
    )
    tables = [p for _, p in in_backward_optimizer_filter(model.sparse_arch.named_parameters()) if p.requires_grad]
    sparse = None
    if tables and cfg.sparse.name == "rowwise_adagrad":
        sparse = TouchedRowsAdagrad(tables, lr=cfg.sparse.lr, eps=cfg.sparse.eps, weight_decay=cfg.sparse.weight_decay)
    elif tables:
        sparse = torch.optim.Adagrad(tables, lr=cfg.sparse.lr, eps=cfg.sparse.eps)

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    fused_tables = getattr(model.sparse_arch, "fused_optimizer", None)  # present when TorchRec sharded the tables
    optimizers = [o for o in (dense, sparse, fused_tables) if o is not None]
    return dense, sparse, LRSchedule(optimizers, factor)


class TouchedRowsAdagrad(RowWiseAdagrad):
    """TorchRec's ``RowWiseAdagrad`` with an L2 weight decay on the rows a step touches, as FBGEMM's
    fused row-wise Adagrad applies ``weight_decay`` in its L2 mode to the rows it looks up.

    A row is touched when its gradient is nonzero anywhere (the tables' gradients are dense: a row
    that no lookup reached has an all-zero gradient; a looked-up row whose gradient sums to exactly
    zero counts as untouched here, while FBGEMM would decay it). For each touched row ``i`` of a
    table ``W [N, D]`` with gradient ``G [N, D]``::

        g = G[i] + weight_decay * W[i]
        sum[i] += mean(g ** 2)
        W[i] -= lr * g / (sqrt(sum[i]) + eps)

    Untouched rows and their state are left as they are. TorchRec's own ``weight_decay`` (the same
    argument of the base class) would decay every row at every step instead. With ``weight_decay=0``
    the step is the base class's, bit for bit; the state (``sum [N, 1]``, ``step``) is the base
    class's, so checkpoints move between the two.
    """

    @torch.no_grad()
    def step(self, closure=None):
        if not any(group["weight_decay"] for group in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("TouchedRowsAdagrad takes dense gradients (embedding tables with sparse=False)")
                state = self.state[param]
                state["step"] += 1
                step_lr = lr / (1 + (state["step"].item() - 1) * group["lr_decay"])
                grad = -param.grad if group["maximize"] else param.grad
                rows = grad.ne(0).any(dim=1).nonzero().squeeze(1)  # the touched rows [n]
                weight = param.index_select(0, rows)  # [n, D]
                g = grad.index_select(0, rows).add(weight, alpha=decay)
                total = state["sum"].index_select(0, rows) + g.pow(2).mean(dim=1, keepdim=True)  # [n, 1]
                state["sum"].index_copy_(0, rows, total)
                param.index_copy_(0, rows, weight.addcdiv_(g, total.sqrt().add_(eps), value=-step_lr))
        return loss


class LRSchedule:
    """One learning-rate factor per step, ``factor(step)`` (linear warm-up over ``optim.warmup_steps``,
    then constant or cosine), for several optimizers, each from its own base learning rate.

    TorchRec's fused table optimizer takes part like the others: it hands ``param_groups[0]["lr"]``
    to FBGEMM at its ``zero_grad()`` / ``step()`` (the trainer's OptimizerSet calls both). The state
    is the step count alone, so a checkpoint restores every optimizer's learning rate from it.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], factor) -> None:
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers]
        self.factor = factor

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        """The dense optimizer's learning rates."""
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict:
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state: dict) -> None:
        step = state["last_epoch"]
        for scheduler in self.schedulers:
            scheduler.last_epoch = step
            lrs = [base * self.factor(step) for base in scheduler.base_lrs]
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr
            scheduler._last_lr = lrs
