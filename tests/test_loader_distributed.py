"""Two processes with gloo: each rank reads its own share, with a DataLoader worker, and the ranks
together read every row exactly once, in the same number of steps; a rank resumes from its state."""

import json
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gem.data.format.dataset import split_files
from gem.data.pipeline.loader import build_loader
from gem.data.pipeline.schema import FeatureSchema
from tests.conftest import TINY_SCHEMA


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, data_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    try:
        schema = FeatureSchema.from_config(TINY_SCHEMA)
        files = split_files(data_dir, "train")

        def make():
            return build_loader(
                files,
                schema,
                32,
                shuffle=True,
                seed=7,
                drop_last=True,
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                num_workers=1,
            )

        loader = make()
        keys, steps = [], 0
        for batch in loader:
            keys += [tuple(r) for r in batch.dense.tolist()]
            steps += 1
            if steps == 4:
                state = json.loads(json.dumps(loader.state_dict()))
                break
        resumed = make()
        resumed.load_state_dict(state)
        for batch in resumed:
            keys += [tuple(r) for r in batch.dense.tolist()]
            steps += 1
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (keys, steps, loader.steps_per_epoch))
        if rank == 0:
            torch.save(gathered, os.path.join(out_dir, "gathered.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_partition_and_resume(tiny_dataset, tiny_schema, tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, str(tiny_dataset), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    (keys0, steps0, spe), (keys1, steps1, _) = torch.load(tmp_path / "gathered.pt")
    assert steps0 == steps1 == spe == 700 // (32 * 2)
    assert len(set(keys0)) == len(keys0) == len(keys1) == 10 * 32 and not set(keys0) & set(keys1)
    whole = build_loader(split_files(tiny_dataset, "train"), tiny_schema, 700)
    assert set(keys0) | set(keys1) <= {tuple(r) for b in whole for r in b.dense.tolist()}
