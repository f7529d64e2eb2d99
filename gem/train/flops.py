"""FLOPs per training step on the true jagged lengths, and MFU.

A dense arch that declares ``capabilities.counts_flops`` (gem.models.capabilities) counts its own
FLOPs analytically (``dense_arch.flops(batch_size, lengths)``, e.g.
:meth:`gem.models.gem_arch.GEMDenseArch.flops`); embedding lookups are not FLOPs.
``MFU = step FLOPs / step seconds / peak FLOP/s``, summed over ranks (each rank counts its own
batch). On CPU there is no meaningful peak: MFU is None unless ``trainer.peak_tflops`` is set.
"""

from __future__ import annotations

import torch

from gem.data.pipeline.batch import Batch
from gem.data.pipeline.schema import FeatureSchema
from gem.models.capabilities import capabilities

# Dense bf16 peak (TFLOP/s, without sparsity) by GPU name, from the vendors' data sheets.
# The first key found in the device name wins (so "H100 PCIe" before "H100").
PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0}


def default_peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` if it is a GPU this table knows, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def batch_lengths(batch: Batch, schema: FeatureSchema) -> dict[str, torch.Tensor]:
    """The true history length ``[B]`` of every sequence group (from its first feature's KJT lengths)."""
    out = {}
    if not schema.sequence_groups:
        return out
    lengths = batch.sequences.lengths().view(-1, batch.batch_size)  # key-major [num_keys, B]
    keys = batch.sequences.keys()
    for g in schema.sequence_groups:
        out[g.name] = lengths[keys.index(g.feature_names[0])]
    return out


def step_flops(dense_arch: torch.nn.Module, batch: Batch, schema: FeatureSchema) -> int | None:
    """Forward + backward FLOPs of one training step of ``dense_arch`` on ``batch`` (None if it declares no count)."""
    if not capabilities(dense_arch).counts_flops:
        return None
    flops = dense_arch.flops(batch.batch_size, batch_lengths(batch, schema))
    return flops["forward"] + flops["backward"]


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilization; None without a peak or a FLOP count."""
    if not peak_tflops or flops is None or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)
