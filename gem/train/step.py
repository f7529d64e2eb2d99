"""One training step (forward, loss, backward, optimizer steps), run plainly or through TorchRec's
sparse-dist training pipeline.

``TrainPipelineSparseDist`` keeps up to three batches in flight: while the dense forward and
backward of batch i run, the input all-to-all (ids to the ranks owning their table shards) of
batch i+1 is already under way and batch i+2 is being copied to the device. It runs the same math
(the parity test checks it step for step); it only reorders communication.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from gem.data.pipeline.batch import Batch


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on ``device`` in ``dtype``, or nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class OptimizerSet:
    """The dense and the unfused table optimizers, with dense gradient clipping, behind the
    ``zero_grad()`` / ``step()`` interface that TorchRec's pipelines drive."""

    def __init__(
        self, optimizers: Iterable[torch.optim.Optimizer | None], clip_params: list[nn.Parameter], grad_clip: float
    ) -> None:
        self.optimizers = [o for o in optimizers if o is not None]
        self.clip_params = clip_params
        self.grad_clip = grad_clip

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.clip_params, self.grad_clip)
        for opt in self.optimizers:
            opt.step()


class TimedIterator:
    """Wraps a batch iterator; adds the seconds spent waiting in ``next()`` to ``waited`` and, given
    ``count_flops(batch) -> int | None``, each batch's FLOPs to ``flops`` (None once any is None).

    With the sparse-dist pipeline the iterator runs up to two batches ahead of training; over a
    log window of many steps that shifts the FLOP sum by at most two batches.
    """

    def __init__(self, batches: Iterator[Batch], count_flops: Callable[[Batch], int | None] | None = None) -> None:
        self.batches, self.waited = batches, 0.0
        self.count_flops = count_flops
        self.flops: int | None = 0 if count_flops is not None else None

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> Batch:
        tick = time.perf_counter()
        try:
            batch = next(self.batches)
        finally:
            self.waited += time.perf_counter() - tick
        if self.flops is not None:
            flops = self.count_flops(batch)
            self.flops = None if flops is None else self.flops + flops
        return batch


class TrainStep:
    """``step(batches) -> (per_task [K], batch_size)``: trains on the next batch of ``batches``.

    Args:
        model: the GEMModel (its sparse arch TorchRec-sharded when ``pipelined``).
        loss_fn: ``(logits, batch) -> (loss, per_task)``.
        optimizers: an :class:`OptimizerSet`.
        device: where batches go.
        pipelined: use TorchRec's ``TrainPipelineSparseDist`` (needs a DistributedModelParallel
            sparse arch); otherwise copy, forward, backward, step, one batch at a time.
        autocast: run the model's forward under ``torch.autocast`` in this dtype (None: off); the
            loss is computed in float32 on float32 logits.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable,
        optimizers: OptimizerSet,
        device: torch.device,
        pipelined: bool,
        autocast: torch.dtype | None = None,
    ) -> None:
        self.model, self.loss_fn, self.optimizers, self.device = model, loss_fn, optimizers, device
        self.autocast = autocast
        self.pipelined = pipelined
        self.pipeline = None  # built at the first step, and again after each detach()
        self.last_batch: Batch | None = None  # the batch the last step trained on
        self._pending: list[Batch] = []  # batches a detached pipeline had in flight
        self._source: Iterator[Batch] | None = None
        self._base: Iterator[Batch] | None = None
        # TorchRec's DMPCollection (sparse.sharding_group_size) holds a copy of the tables per group
        # of ranks; its sync() averages the copies' weights and optimizer state, after every step
        self._sync_replicas = getattr(getattr(model, "sparse_arch", None), "sync", None)

    def _forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
        self.last_batch = batch
        with autocast(self.device, self.autocast):
            logits = self.model(batch)
        loss, per_task = self.loss_fn(logits.float(), batch)
        return loss, (per_task, batch.batch_size)

    def __call__(self, batches: Iterator[Batch]) -> tuple[torch.Tensor, int]:
        if self.pipelined:
            if self.pipeline is None:
                from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

                self.pipeline = TrainPipelineSparseDist(
                    self.model, self.optimizers, self.device, custom_model_fwd=self._forward
                )
            if batches is not self._base:
                self._source, self._base = itertools.chain(self._pending, batches), batches
                self._pending = []
            out = self.pipeline.progress(self._source)
        else:
            batch = next(batches).to(self.device, non_blocking=True)
            self.optimizers.zero_grad()
            loss, out = self._forward(batch)
            loss.backward()
            self.optimizers.step()
        if self._sync_replicas is not None:
            self._sync_replicas()
        return out

    def detach(self) -> None:
        """Give the model its own forward back (for evaluation). TorchRec's re-attach after an
        evaluation fails (the sharded modules' input-dist state no longer matches the batch in
        flight: a gloo all-to-all size mismatch, measured), so the pipeline is dropped instead
        and rebuilt at the next step, with its in-flight batches (already on the device, their
        input all-to-alls completed) fed first: the data order stays that of the plain loop."""
        if self.pipeline is not None:
            self.pipeline.detach()
            self._pending = list(self.pipeline.batches)
            self._base = None
            self.pipeline = None
