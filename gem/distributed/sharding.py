"""TorchRec sharding of the SparseArch: plan (planner or one sharding type for every table),
fused row-wise Adagrad applied in backward, DistributedModelParallel."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def shard_sparse_arch(sparse_arch: nn.Module, device: torch.device, sparse_lr: float, sparse_eps: float,
                      sharding_type: str | None = None, pg: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard ``sparse_arch``'s tables over the ranks of ``pg`` with TorchRec.

    The embedding optimizer (TorchRec's row-wise Adagrad) is fused into the backward pass:
    after ``loss.backward()`` the tables are already updated, and there is no separate step.
    """
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    pg = pg or dist.group.WORLD
    apply_optimizer_in_backward(RowWiseAdagrad, sparse_arch.parameters(), {"lr": sparse_lr, "eps": sparse_eps})
    sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
    constraints = None
    if sharding_type is not None:
        constraints = {t.name: ParameterConstraints(sharding_types=[sharding_type]) for t in sparse_arch.tables}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(pg), compute_device=device.type), constraints=constraints
    )
    plan = planner.collective_plan(sparse_arch, sharders, pg)
    return DistributedModelParallel(sparse_arch, env=ShardingEnv.from_process_group(pg), device=device, plan=plan,
                                    sharders=sharders)
