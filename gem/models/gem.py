"""GEMModel: ``sparse_arch`` (embeddings, sharded by TorchRec) + ``dense_arch`` (everything else, FSDP2)."""

from __future__ import annotations

import torch
from torch import nn

from gem.data.pipeline.batch import Batch
from gem.models.capabilities import capabilities
from gem.sparse.arch import JaggedEmbeddings, SparseArch, SparseOutput


class GEMModel(nn.Module):
    """``forward(batch) -> logits [B, num_tasks]``.

    ``dense_arch`` is any module with ``forward(sparse_output, dense [B, num_dense], domain [B])``
    returning logits, and an ``init_weights()`` method. What else it reads it declares in its
    ``capabilities`` (:class:`gem.models.capabilities.Capabilities`): the ids of some features
    (``sequence_ids``: a generative objective's items, a ranking row's candidate), passed as
    ``ids={feature: values [T]}``; or a teacher's outputs (``teacher_inputs``: gem.transfer's
    students), passed as ``teacher=batch.teacher, teacher_repr=batch.teacher_repr``.

    ``row_bucket`` (``parallelism.row_bucket``; 0: off) pads what the dense arch sees to few
    shapes: see :func:`pad_examples`, whose ``max_lens`` (each sequence group's cap) it also needs.
    """

    def __init__(
        self,
        sparse_arch: SparseArch | nn.Module,
        dense_arch: nn.Module,
        row_bucket: int = 0,
        max_lens: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.sparse_arch = sparse_arch
        self.dense_arch = dense_arch
        self.capabilities = capabilities(dense_arch)
        self.row_bucket, self.max_lens = row_bucket, dict(max_lens or {})

    def forward(self, batch: Batch) -> torch.Tensor:
        embeddings = self.sparse_arch(batch.sparse, batch.sequences, batch.max_seq_len)
        if self.capabilities.teacher_inputs:
            return self.dense_arch(
                embeddings, batch.dense, batch.domain, teacher=batch.teacher, teacher_repr=batch.teacher_repr
            )
        names = self.capabilities.sequence_ids
        if names:
            ids = batch.sequences.to_dict()
            if any(f not in ids for f in names):  # a pooled feature's ids (a ranking row's candidate)
                ids |= batch.sparse.to_dict()
            return self.dense_arch(embeddings, batch.dense, batch.domain, ids={f: ids[f].values() for f in names})
        if self.row_bucket:
            padded = pad_examples(embeddings, batch.dense, batch.domain, self.row_bucket, self.max_lens)
            return self.dense_arch(*padded)[: batch.domain.shape[0]]
        return self.dense_arch(embeddings, batch.dense, batch.domain)


def pad_examples(
    sparse: SparseOutput, dense: torch.Tensor | None, domain: torch.Tensor, row_bucket: int, max_lens: dict[str, int]
) -> tuple[SparseOutput, torch.Tensor | None, torch.Tensor]:
    """The dense arch's inputs with empty examples appended, so that its shapes take few values: CUDA
    graphs (``+parallelism.inductor.triton.cudagraphs=true``) record a graph per shape.

    Every sequence group gets rows of zeros up to the next multiple of ``row_bucket``, held by
    ``ceil((row_bucket - 1) / max_len)`` extra examples (the most any group needs, so the batch
    grows by the same count in every group) of at most its ``max_lens`` entry each, some of them
    empty; its ``max_len`` becomes that cap. Every row still belongs to an example, as the kernels
    require. The extra examples' id features, dense features and domain are zeros. An example's
    outputs do not depend on the others of its batch, so the caller keeps the first ``B`` outputs
    and drops the rest (``GEMModel``). Computed on the device from host-side sizes: no sync."""
    num_extra = max((-(-(row_bucket - 1) // max_lens[name]) for name in sparse.sequences), default=0)
    sequences = {}
    for name, s in sparse.sequences.items():
        cap, pad = max_lens[name], -s.values.shape[0] % row_bucket
        extra = torch.arange(num_extra, device=s.offsets.device, dtype=s.offsets.dtype)
        lengths = (pad - cap * extra).clamp(0, cap)
        offsets = torch.cat([s.offsets, s.offsets[-1] + lengths.cumsum(0)])
        values = torch.cat([s.values, s.values.new_zeros(pad, s.values.shape[1])])
        sequences[name] = JaggedEmbeddings(values, offsets, cap)

    def grow(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(num_extra, *t.shape[1:])])

    pooled = {name: grow(t) for name, t in sparse.pooled.items()}
    return SparseOutput(pooled, sequences), None if dense is None else grow(dense), grow(domain)
