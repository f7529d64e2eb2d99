"""The teacher export under torchrun: two ranks, each scores its own files (file i to rank i % 2),
together the same files as one process writes."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from tests.test_distributed import torchrun
from tests.test_transfer import _data, teacher_ckpt  # noqa: F401 (the module's teacher fixture)


def test_export_under_torchrun_splits_the_files_between_ranks(tiny_dataset, teacher_ckpt, tmp_path):  # noqa: F811
    from gem.transfer.export import parse, run

    args = _data(tiny_dataset, f"transfer.checkpoint={teacher_ckpt}", "transfer.representation=heads")
    proc = torchrun(["-m", "gem.transfer.export", *args, f"transfer.out={tmp_path / 'two'}"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # 3 train files, 1 val, 1 test: rank 0 takes train 0 and 2, val 0, test 0; rank 1 train 1
    assert "rank 0/2 wrote 4 files" in proc.stderr and "rank 1/2 wrote 1 files" in proc.stderr, proc.stderr[-3000:]
    one = run(*parse([*args, f"transfer.out={tmp_path / 'one'}"]))
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*.parquet"))
    assert len(files) == len(one["written"]) == 5
    assert sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*.parquet")) == files
    for f in files:  # the inputs copied exactly; the teacher's outputs up to float rounding (1 thread vs several)
        a, b = pq.read_table(tmp_path / "one" / f), pq.read_table(tmp_path / "two" / f)
        assert a.column_names == b.column_names and a.schema.metadata == b.schema.metadata, f
        for name in a.column_names:
            if not name.startswith("teacher_"):
                assert a.column(name).equals(b.column(name)), (f, name)
            else:
                x, y = (np.stack(t.column(name).to_numpy(zero_copy_only=False)) for t in (a, b))
                np.testing.assert_allclose(x, y, atol=1e-5, err_msg=f"{f} {name}")
