"""Sharded-vs-single-process parity with mapped raw ids (``sparse.ids``; tests/test_ids.py).

The tiny data set's ids are spread into a 2**62 space by a bijection (:func:`to_raw`), and the
tables map them back to rows with each policy (mch with LRU eviction: the tables are smaller than
the ids seen, so ids are evicted). Under torchrun every rank trains on its slice of each global
batch with TorchRec-sharded tables; called in-process with ``world_size=1`` the same function is
the reference (native tables, the whole global batch). The mapping state must agree too.

    torchrun --nproc_per_node=2 tests/ids_worker.py --data DIR --out FILE --plan row_wise
"""

from __future__ import annotations

import argparse
import itertools
import json
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
from tests.distributed_worker import copy_full_tables  # noqa: E402

NUM_STEPS = 8
EMBEDDING_DIM = 8
IDS = {
    "t_user_id": {"policy": "mch", "eviction": "lru", "raw_space": 2**62},
    "t_ad_id": {"policy": "mch", "eviction": "lfu", "eviction_interval": 2, "raw_space": 2**62},
    "t_hist_item": {"policy": "hash", "raw_space": 2**62},
}
SPREAD = 2**40 + 15  # raw id = id * SPREAD + 7: distinct, far above every table size


def smaller_tables(schema):
    """``schema`` with the mapped tables smaller than their id counts, so that ids collide and get evicted."""
    from dataclasses import replace

    rows = {"user_id": 16, "ad_id": 24, "hist_item": 32}
    return replace(
        schema,
        id_features=tuple(replace(f, cardinality=rows.get(f.name, f.cardinality)) for f in schema.id_features),
        sequence_groups=tuple(
            replace(g, features=tuple(replace(f, cardinality=rows.get(f.name, f.cardinality)) for f in g.features))
            for g in schema.sequence_groups
        ),
    )


def to_raw(kjt, features):
    """``kjt`` with the values of ``features`` spread into the raw space."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    parts = kjt.values().split(kjt.length_per_key())
    values = torch.cat([p * SPREAD + 7 if k in features else p for k, p in zip(kjt.keys(), parts)])
    return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths(), stride=kjt.stride())


def run_ids_case(data_dir: Path, batch_size: int, world_size: int, plan: str | None) -> dict:
    """``NUM_STEPS`` steps; returns the global-batch losses, the mapping state (mch tables' sorted raw
    ids and rows) and the counts of the last step."""
    from gem.distributed.parallel_dims import ParallelDims
    from gem.distributed.parallelize import parallelize_gem
    from gem.distributed.sharding import shard_sparse_arch

    device = torch.device("cpu")
    files_schema = schema_from_files(split_files(data_dir, "train"))
    schema = smaller_tables(files_schema)
    optim = OptimConfig(sparse=SparseOptimConfig(lr=0.05))
    torch.manual_seed(0)
    reference = SparseArch.from_config(schema, EMBEDDING_DIM, backend="native", ids=IDS)
    reference.init_weights()
    sparse, group, mesh = reference, None, None
    if world_size > 1:
        sparse = shard_sparse_arch(
            SparseArch.from_config(schema, EMBEDDING_DIM, backend="torchrec", device="meta", ids=IDS),
            device,
            optim.sparse.lr,
            optim.sparse.eps,
            sharding_type=plan,
        )
        copy_full_tables(
            {k: v for k, v in sparse.state_dict().items() if ".ids." not in f".{k}"}, reference.state_dict()
        )
        group, mesh = dist.group.WORLD, ParallelDims(1, world_size, world_size).build_mesh(device.type)
    arch = sparse.module if hasattr(sparse, "module") else sparse
    feature_dims = {f: reference.pooled_dim(f) for f in schema.id_feature_names}
    feature_dims |= {g.name: reference.sequence_dim(g.name) for g in schema.sequence_groups}
    torch.manual_seed(1)
    dense = DLRM(schema, feature_dims, dim=EMBEDDING_DIM, bottom_mlp=(16,), top_mlp=(16,)).to(device)
    dense.init_weights()
    model = GEMModel(sparse, dense)
    parallelize_gem(model, mesh, param_dtype=torch.float32)
    dense_opt, sparse_opt, _ = build_optimizers(model, optim, NUM_STEPS)
    rank = dist.get_rank() if world_size > 1 else 0
    # Global batch k * world_size + rank of the files in order: the batches one process reads, split.
    loader = build_loader(split_files(data_dir, "train"), files_schema, batch_size, options={"balance": False})
    reader = itertools.islice(loader, rank, None, world_size)
    task_weights = torch.tensor([1.0, 0.5])
    mapped = {"user_id", "ad_id", "hist_item"}
    losses, counts = [], {}
    for _, batch in zip(range(NUM_STEPS), reader):
        batch.sparse, batch.sequences = to_raw(batch.sparse, mapped), to_raw(batch.sequences, mapped)
        loss, per_task = multitask_bce(model(batch), batch.labels, batch.label_mask, task_weights, group=group)
        loss.backward()
        for opt in (dense_opt, sparse_opt):
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        losses.append(float((per_task * task_weights).sum()))
        counts = arch.ids.pop_counts()
    state = {k: v.tolist() for k, v in arch.ids.state_dict().items() if "_mch_" in k}
    return {"losses": losses, "state": state, "counts": counts}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan", default="row_wise")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = run_ids_case(Path(args.data), args.batch, int(os.environ["WORLD_SIZE"]), args.plan)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from gem.train.__main__ import exit_without_finalization  # as python -m gem.train ends a finished rank

    exit_without_finalization()
