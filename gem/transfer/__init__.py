"""Knowledge transfer from a large model (GEM) to smaller ones (docs/transfer.md).

- parameter sharing, ``checkpoint.init_from`` / ``init_modules`` / ``init_frozen`` (load some
  tensors of another run's checkpoint, freeze some), is the trainer's: :mod:`gem.train.initialize`;
- :mod:`gem.transfer.teacher`: a checkpoint rebuilt as a frozen teacher (per-task logits, the
  representation its heads read, a history representation from a pass without the candidate),
  for online distillation;
- :mod:`gem.transfer.export`: ``python -m gem.transfer.export``, the teacher's outputs written as
  ``teacher_<task>`` columns of a copy of a data set (offline distillation), and on request one of
  its representations, ``teacher_repr`` (``heads``: per candidate; ``history``: per request);
- :mod:`gem.transfer.student`: a student that reads the teacher's representation as an input
  (``trainer.distill.representation``) or corrects the teacher's logits (``trainer.distill.adapter``),
  from those columns or from an online teacher that fills the batch before each forward.

The distillation loss itself is :func:`gem.train.losses.multitask_bce` with ``teacher=``.
"""

from gem.train.registry import register

register("trainer.distill", "gem.transfer.components:distillation")  # the trainer imports it for such a run
