"""tools/host_time.py on the CPU: a tiny run's host and until-done time per step (one batch repeated), in its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_host_time_writes_both_timings(tmp_path):
    out = tmp_path / "host.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "host_time.py"),
            "--warmup=1",
            "--steps=2",
            "--cprofile",
            "--repeat-batch",
            f"--out={out}",
            "--",
            "debug=tiny",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    record = json.loads(out.read_text())
    assert record["benchmark"] == "host_time" and record["steps"] == 2 and record["repeat_batch"]
    assert 0 < record["host_ms_per_step"] <= record["until_done_ms_per_step"]
    assert 0 <= record["data_wait_ms_per_step"] < record["host_ms_per_step"]
    assert record["hardware"].startswith("cpu")
