"""One body for the sharded-vs-single-process parity tests (tests/test_distributed.py).

Under torchrun every rank trains on its slice of each global batch: TorchRec shards the tables
with an explicit plan, FSDP2 / HSDP shards the dense arch, and the loss is normalized over the
global batch. Called in-process with ``world_size=1`` the same function is the reference: plain
tables (native backend, the same optimizer rule unfused) and the whole global batch in one step.

    torchrun --nproc_per_node=2 tests/distributed_worker.py --data DIR --out FILE --backend gloo \\
        --cases '[{"name": "row_wise", "plan": "row_wise", "mesh": [1, 2]}]'
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gem.data.format.dataset import schema_from_files, split_files  # noqa: E402
from gem.data.pipeline.loader import build_loader  # noqa: E402
from gem.models.dlrm import DLRM  # noqa: E402
from gem.models.gem import GEMModel  # noqa: E402
from gem.sparse.arch import SparseArch  # noqa: E402
from gem.train.config import OptimConfig, SparseOptimConfig  # noqa: E402
from gem.train.losses import multitask_bce  # noqa: E402
from gem.train.optim import build_optimizers  # noqa: E402

NUM_STEPS = 10
EMBEDDING_DIM = 16


def run_case(case: dict, data_dir: Path, batch_size: int, world_size: int, device: torch.device) -> dict:
    """Train ``NUM_STEPS`` steps of ``case`` on batches of ``batch_size`` per rank; returns the
    global-batch loss of every step (rank r's step-i batch is slice r of the reference's global batch i)
    as ``losses``, and the norm of the first step's dense gradient as ``dense_grad_norm``.

    case: ``plan`` (a sharding type for every table, or ``{"pooled": ..., "sequence": ...}``, or None:
    native tables replicated with DDP), ``mesh``
    ``[dp_replicate, dp_shard]`` for the dense arch, ``optimizer`` (the table optimizer),
    ``activation_checkpointing``, ``reshard_after_forward``.
    """
    from gem.distributed.parallel_dims import ParallelDims
    from gem.distributed.parallelize import parallelize_gem
    from gem.distributed.sharding import shard_sparse_arch

    schema = schema_from_files(split_files(data_dir, "train"))
    optim = OptimConfig(sparse=SparseOptimConfig(name=case.get("optimizer", "rowwise_adagrad"), lr=0.05))
    torch.manual_seed(0)
    reference = SparseArch.from_config(schema, EMBEDDING_DIM, backend="native", device=device)
    reference.init_weights()
    if world_size == 1:
        sparse = reference
    elif case.get("plan") is None:  # native tables replicated with DDP (GPUs without CUDA fbgemm)
        sparse = torch.nn.parallel.DistributedDataParallel(reference)
    else:
        plan = case["plan"]
        if isinstance(plan, dict):  # {"pooled": ..., "sequence": ...}: one sharding per kind of table
            plan = {t.name: plan["pooled" if t.pooled else "sequence"] for t in reference.tables}
        sparse = shard_sparse_arch(
            SparseArch.from_config(schema, EMBEDDING_DIM, backend="torchrec", device="meta"),
            device,
            optim.sparse.lr,
            optim.sparse.eps,
            optimizer=optim.sparse.name,
            sharding_type=plan if isinstance(plan, str) else None,
            plan=plan if isinstance(plan, dict) else None,
        )
        copy_full_tables(sparse.state_dict(), reference.state_dict())  # the same starting tables
    feature_dims = {f: reference.pooled_dim(f) for f in schema.id_feature_names}
    feature_dims |= {g.name: reference.sequence_dim(g.name) for g in schema.sequence_groups}
    torch.manual_seed(1)
    dense = DLRM(schema, feature_dims, dim=EMBEDDING_DIM, bottom_mlp=(16,), top_mlp=(32, 16)).to(device)
    dense.init_weights()
    model = GEMModel(sparse, dense)
    group, mesh = None, None
    if world_size > 1:
        replicate, shard = case["mesh"]
        mesh = ParallelDims(replicate, shard, world_size).build_mesh(device.type)
        if case.get("force_2d") and mesh.ndim == 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
        group = dist.group.WORLD
    # fp32 compute: parity is exact up to the order of sums.
    parallelize_gem(
        model,
        mesh,
        param_dtype=torch.float32,
        activation_checkpointing=case.get("activation_checkpointing", False),
        reshard_after_forward=case.get("reshard_after_forward", True),
    )
    dense_opt, sparse_opt, _ = build_optimizers(model, optim, NUM_STEPS)
    rank = dist.get_rank() if world_size > 1 else 0
    # Global batch k * world_size + rank of the files in order: the batches one process reads, split.
    loader = build_loader(split_files(data_dir, "train"), schema, batch_size, options={"balance": False})
    reader = itertools.islice(loader, rank, None, world_size)
    task_weights = torch.tensor([1.0, 0.5], device=device)
    losses = []
    for _, batch in zip(range(NUM_STEPS), reader):
        batch = batch.to(device)
        loss, per_task = multitask_bce(model(batch), batch.labels, batch.label_mask, task_weights, group=group)
        loss.backward()
        if not losses:  # Adam and Adagrad hide a constant gradient scale from the losses; check it directly
            grad_norm = sum(float(_full(p.grad).pow(2).sum()) for p in dense.parameters() if p.grad is not None) ** 0.5
        for opt in (dense_opt, sparse_opt):
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        losses.append(float((per_task * task_weights).sum()))
    if len(losses) != NUM_STEPS:
        raise RuntimeError(f"the data set ran out after {len(losses)} steps; make it larger")
    return {"losses": losses, "dense_grad_norm": grad_norm}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def copy_full_tables(sharded: dict, full: dict) -> None:
    """Copy each full table of ``full`` into this rank's shards of it in ``sharded`` (in place)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    for name, local in sharded.items():
        source = full[name]
        if isinstance(local, ShardedTensor):
            for shard in local.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.tensor.shape
                shard.tensor.copy_(source[r : r + h, c : c + w])
        elif isinstance(local, DTensor):
            raise NotImplementedError(f"{name}: DTensor tables are not expected with TorchRec's default state dict")
        else:  # data-parallel: a full copy
            local.copy_(source)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    world_size = int(os.environ["WORLD_SIZE"])
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    else:
        device = torch.device("cpu")
    # torchrun stops every rank when one fails; this bounds a true hang (and tolerates a loaded 2-core CI box).
    dist.init_process_group(args.backend, timeout=timedelta(seconds=120))
    logging.basicConfig(level=logging.INFO if dist.get_rank() == 0 else logging.WARNING, format="%(message)s")
    results = {}
    for case in json.loads(args.cases):
        logging.getLogger("gem").info("case %s", case)
        results[case["name"]] = run_case(case, Path(args.data), args.batch, world_size, device)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier()  # no rank tears its groups down while another still uses them (seen: a rank aborting at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from gem.train.__main__ import exit_without_finalization  # as python -m gem.train ends a finished rank

    exit_without_finalization()
