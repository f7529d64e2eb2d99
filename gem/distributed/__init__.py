"""Parallelism: ParallelDims (the checked layout and its DeviceMesh), TorchRec sharding of the sparse
arch, FSDP2 / HSDP of the dense arch. See docs/distributed.md."""

from gem.distributed.parallel_dims import ParallelDims, ParallelLayoutError
from gem.distributed.parallelize import parallelize_gem
from gem.distributed.sharding import shard_sparse_arch

__all__ = ["ParallelDims", "ParallelLayoutError", "parallelize_gem", "shard_sparse_arch"]
