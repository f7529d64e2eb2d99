"""tools/trace_gaps.py on a hand-made trace: which host work a GPU gap waited for."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import trace_gaps  # noqa: E402


def _trace():
    """One step: a compiled region launches k1, then slow host work (a 200 us ``aten::nonzero``
    with a 150 us sync inside) before k2 launches; k3 follows k2 without a gap."""

    def cpu(name, ts, dur, cat="cpu_op"):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=1, pid=1)

    def launch(ts, correlation):
        return cpu("cudaLaunchKernel", ts, 5, "cuda_runtime") | {"args": {"correlation": correlation}}

    def kernel(name, ts, dur, correlation):
        return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, tid=7, pid=0, args={"correlation": correlation})

    return [
        cpu("ProfilerStep#1", 0, 1000, "user_annotation"),
        cpu("Torch-Compiled Region: 0/0", 10, 450, "user_annotation"),
        cpu("aten::mm", 20, 50),
        launch(30, 1),
        cpu("aten::nonzero", 100, 200),
        cpu("cudaStreamSynchronize", 120, 150, "cuda_runtime"),
        launch(310, 2),
        launch(320, 3),
        kernel("k1", 40, 20, 1),
        kernel("k2", 320, 20, 2),
        kernel("k3", 340, 30, 3),
    ]


def test_a_gap_is_booked_to_the_host_work_during_it(tmp_path):
    r = trace_gaps.analyse(_trace(), steps=1)
    assert r["idle"] == 0.26  # 60 -> 320 us
    assert r["waiting_for_launch"] == 0.25  # 60 -> 310 us, when k2 was launched
    assert r["top_level"] == {"Torch-Compiled Region: 0/0": 0.25}
    assert r["second_level"] == {
        "Torch-Compiled Region: 0/0 > aten::nonzero": 0.2,
        "Torch-Compiled Region: 0/0 > aten::mm": 0.01,
    }
    assert r["innermost"]["Torch-Compiled Region: 0/0 > ... > cudaStreamSynchronize"] == 0.15
    assert r["syncs"] == {"Torch-Compiled Region: 0/0 > aten::nonzero > cudaStreamSynchronize": 0.15}
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    out = subprocess.run(
        [sys.executable, trace_gaps.__file__, str(path), "--steps", "1"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "waiting for a launch 0.25 ms" in out.stdout
