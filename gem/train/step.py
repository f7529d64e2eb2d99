"""One training step (forward, loss, backward, optimizer steps), run plainly or through TorchRec's
sparse-dist training pipeline.

``TrainPipelineSparseDist`` keeps up to three batches in flight: while the dense forward and
backward of batch i run, the input all-to-all (ids to the ranks owning their table shards) of
batch i+1 is already under way and batch i+2 is being copied to the device. It runs the same math
(the parity test checks it step for step); it only reorders communication.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from gem.data.batch import Batch


class OptimizerSet:
    """The dense and the unfused table optimizers, with dense gradient clipping, behind the
    ``zero_grad()`` / ``step()`` interface that TorchRec's pipelines drive."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer | None], clip_params: list[nn.Parameter],
                 grad_clip: float) -> None:
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
    """Wraps a batch iterator and adds the seconds spent waiting in ``next()`` to ``waited``."""

    def __init__(self, batches: Iterator[Batch]) -> None:
        self.batches, self.waited = batches, 0.0

    def __iter__(self) -> "TimedIterator":
        return self

    def __next__(self) -> Batch:
        tick = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.waited += time.perf_counter() - tick


class TrainStep:
    """``step(batches) -> (per_task [K], batch_size)``: trains on the next batch of ``batches``.

    Args:
        model: the GEMModel (its sparse arch TorchRec-sharded when ``pipelined``).
        loss_fn: ``(logits, batch) -> (loss, per_task)``.
        optimizers: an :class:`OptimizerSet`.
        device: where batches go.
        pipelined: use TorchRec's ``TrainPipelineSparseDist`` (needs a DistributedModelParallel
            sparse arch); otherwise copy, forward, backward, step, one batch at a time.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, optimizers: OptimizerSet, device: torch.device,
                 pipelined: bool) -> None:
        self.model, self.loss_fn, self.optimizers, self.device = model, loss_fn, optimizers, device
        self.pipelined = pipelined
        self.pipeline = None  # built at the first step, and again after each detach()
        self._pending: list[Batch] = []  # batches a detached pipeline had in flight
        self._source: Iterator[Batch] | None = None
        self._base: Iterator[Batch] | None = None

    def _forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
        loss, per_task = self.loss_fn(self.model(batch), batch)
        return loss, (per_task, batch.batch_size)

    def __call__(self, batches: Iterator[Batch]) -> tuple[torch.Tensor, int]:
        if self.pipelined:
            if self.pipeline is None:
                from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

                self.pipeline = TrainPipelineSparseDist(self.model, self.optimizers, self.device,
                                                        custom_model_fwd=self._forward)
            if batches is not self._base:
                self._source, self._base = itertools.chain(self._pending, batches), batches
                self._pending = []
            return self.pipeline.progress(self._source)
        batch = next(batches).to(self.device, non_blocking=True)
        self.optimizers.zero_grad()
        loss, out = self._forward(batch)
        loss.backward()
        self.optimizers.step()
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
