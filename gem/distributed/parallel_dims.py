"""ParallelDims: the data-parallel degrees, checked once, and the named DeviceMesh built once.

Every rank is a data-parallel rank (it reads its own slice of the global batch). The dense arch
is sharded by FSDP2 over a mesh with two named axes::

    world_size = dp_replicate x dp_shard

    dp_replicate = 2, dp_shard = 4 (two nodes of four GPUs, HSDP):
                   dp_shard ->
    dp_replicate   [0 1 2 3]    <- node 0: parameters sharded over these four ranks
        |          [4 5 6 7]    <- node 1: a replica of node 0's shards
        v

``dp_replicate == 1`` is plain FSDP (a 1-D mesh over ``dp_shard``); ``dp_shard == 1`` is plain
replication (DDP-like, FSDP2 with one shard). TorchRec shards the embedding tables over all ranks
(or over groups of ``sharding_group_size`` ranks with DMPCollection), independently of this mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelLayoutError(ValueError):
    """An impossible parallel layout; the message names the ``parallelism.*`` key to change."""


@dataclass
class ParallelDims:
    """Args:
        dp_replicate: replicas of the dense shards (HSDP's outer axis); -1: ``world_size // dp_shard``.
        dp_shard: ranks one copy of the dense parameters is sharded over; -1: ``world_size // dp_replicate``.
            Both -1: shard inside a node (``local_world_size`` ranks), replicate across nodes.
        world_size: number of ranks.
        local_world_size: ranks per node (torchrun's ``LOCAL_WORLD_SIZE``).

    The resolved degrees replace the -1s; ``__post_init__`` raises :class:`ParallelLayoutError`
    for a layout that does not tile the world.
    """

    dp_replicate: int
    dp_shard: int
    world_size: int
    local_world_size: int = 0  # 0: the same as world_size (one node)
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        w = self.world_size
        local = self.local_world_size or w
        if w < 1:
            raise ParallelLayoutError(f"world_size must be >= 1, got {w}")
        for key in ("dp_replicate", "dp_shard"):
            value = getattr(self, key)
            if value == 0 or value < -1:
                raise ParallelLayoutError(f"parallelism.{key}={value}: must be >= 1, or -1 to fill the world")
        if self.dp_replicate == -1 and self.dp_shard == -1:
            if w % local:
                raise ParallelLayoutError(
                    f"world_size {w} is not a whole number of nodes of {local} ranks; "
                    f"set parallelism.dp_shard and parallelism.dp_replicate explicitly"
                )
            self.dp_shard, self.dp_replicate = local, w // local
        for key, other in (("dp_replicate", "dp_shard"), ("dp_shard", "dp_replicate")):
            if getattr(self, key) == -1:
                given = getattr(self, other)
                if w % given:
                    raise ParallelLayoutError(
                        f"parallelism.{other}={given} does not divide the world size {w}; "
                        f"pick a divisor of {w} for parallelism.{other}"
                    )
                setattr(self, key, w // given)
        if self.dp_replicate * self.dp_shard != w:
            raise ParallelLayoutError(
                f"parallelism.dp_replicate x parallelism.dp_shard = {self.dp_replicate} x {self.dp_shard} = "
                f"{self.dp_replicate * self.dp_shard}, but the world size is {w}; make the product {w} "
                f"(or set one of them to -1)"
            )

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    def describe(self) -> str:
        if self.world_size == 1:
            return "one rank"
        if self.dp_replicate == 1:
            return f"FSDP over {self.dp_shard} ranks (1-D mesh dp_shard={self.dp_shard})"
        if self.dp_shard == 1:
            return f"replicated over {self.dp_replicate} ranks (mesh dp_replicate={self.dp_replicate}, dp_shard=1)"
        return f"HSDP: shard over {self.dp_shard}, replicate {self.dp_replicate}x (2-D mesh)"

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The dense mesh, built once: 1-D ``("dp_shard",)`` when ``dp_replicate == 1``, else
        2-D ``("dp_replicate", "dp_shard")`` (the layout ``fully_shard`` reads as HSDP)."""
        if self._mesh is None:
            if self.dp_replicate == 1:
                self._mesh = init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
            else:
                self._mesh = init_device_mesh(
                    device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
                )
        return self._mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) first")
        return self._mesh


def dtype_from_name(key: str, name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ParallelLayoutError(f"{key}={name!r} is not one of {list(dtypes)}")
    return dtypes[name]
