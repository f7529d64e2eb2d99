"""What a dense arch declares about itself, so that GEMModel and the trainer never probe it."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Capabilities:
    """A dense arch's ``capabilities`` (a class or instance attribute; an arch without one has these
    defaults: task logits from the embeddings, dense features and domain).

    Attributes:
        returns_loss: in training mode ``forward`` returns the training loss of its own objective
            (``[1, 1]``), not task logits (gem.models.generative's next-event and masked-item
            objectives); the trainer then minimizes it as it is.
        sequence_ids: features whose ids the arch reads besides their embeddings (GEMModel passes
            ``ids={feature: values [T]}``; a pooled feature's ids too, one per row).
        teacher_inputs: the arch reads a teacher's outputs (GEMModel passes ``teacher=`` and
            ``teacher_repr=``; gem.transfer's students).
        item_cooccurrence: the arch's ranking prior needs the items' co-occurrence over the
            training split, handed over by ``set_cooccurrence(keys, values)`` when it is built.
        counts_flops: the arch counts a training step's FLOPs analytically,
            ``flops(batch_size, lengths, max_lens=None, padded=False) -> {"forward": .., "backward": ..}``
            (the trainer's TFLOP/s and MFU, gem.plan's step time).
        head_representation: the output of the arch's ``top`` MLP (width ``top.out_dim``) is the
            example's representation, the input of its ``heads`` module (gem.transfer's teachers).
        sequence_summaries: the arch's ``final`` ModuleDict holds, per event stream, the module whose
            output is that stream's sequence summary tokens (gem.transfer's history representation).
    """

    returns_loss: bool = False
    sequence_ids: tuple[str, ...] = ()
    teacher_inputs: bool = False
    item_cooccurrence: bool = False
    counts_flops: bool = False
    head_representation: bool = False
    sequence_summaries: bool = False

    @property
    def reads_more_than_embeddings(self) -> bool:
        """Inputs beyond the embeddings, dense features and domain, which row buckets do not pad."""
        return self.teacher_inputs or bool(self.sequence_ids)


def capabilities(dense_arch: nn.Module) -> Capabilities:
    """``dense_arch.capabilities``, or the defaults for an arch that declares none."""
    return getattr(dense_arch, "capabilities", None) or Capabilities()
