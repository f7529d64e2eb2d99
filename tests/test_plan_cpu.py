"""The step-time model on a CPU host (gem/plan/machine.py, gem/plan/cpu_calibration.py,
benchmarks/plan_cpu.py): the link fit, the machine's plan.* overrides, and the committed calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gem.plan.machine import CPUMachine, fit_link

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_the_link_fit_recovers_latency_and_bandwidth():
    points = [(b, 0.2 + b / 1.5e6) for b in (4096, 65536, 2**20, 2**23)]  # 0.2 ms + bytes at 1.5 GB/s
    gbps, latency = fit_link(points)
    assert gbps == pytest.approx(1.5, rel=1e-6) and latency == pytest.approx(0.2, rel=1e-6)
    with pytest.raises(ValueError, match="time does not grow with message size"):
        fit_link([(4096, 1.0), (2**20, 0.5)])


def test_a_cpu_machine_gives_the_rates_of_its_rank_count():
    m = CPUMachine(1, {1: 170.0, 2: 85.0}, {1: 13.0, 2: 6.5}, 1.4, 0.1)
    assert m.overrides(2) == [
        "plan.device=cpu",
        "plan.peak_tflops=0.085",
        "plan.hbm_gbps=6.5",
        "plan.intra_node_gbps=1.4",
        "plan.collective_latency_ms=0.1",
    ]
    assert CPUMachine(**json.loads(json.dumps(m.to_json()))) == m  # JSON's string keys come back as ints
    with pytest.raises(ValueError, match=r"no rates measured for 4 ranks at once \(measured: \[1, 2\]\)"):
        m.overrides(4)


@pytest.mark.parametrize("name", ["plan_model-cpu.json", "plan_model-cpu-loaded.json"])
def test_the_committed_cpu_calibration_is_what_the_model_gives_today(name):
    """benchmarks/plan_cpu.py --refit: the constants fitted to the file's measurements and the predictions
    of every run are the file's (a model change that moves them needs the file refitted and the docs'
    table updated), the fitting runs are matched within 10% and the held-out one-rank run within 15%."""
    from gem.plan import cpu_calibration

    data = json.loads((RESULTS / name).read_text())
    runs = data["runs"]
    fitted, checks, _ = cpu_calibration.fit(
        {r["run"]: r["step_ms"] for r in runs}, CPUMachine(**data["machine"]), {r["run"]: r["rates"] for r in runs}
    )
    assert fitted == pytest.approx(data["fitted"], rel=1e-6)
    recorded = {c["run"]: c for c in data["checks"]}
    assert {c.run for c in checks} == set(recorded) == {r.label for r in cpu_calibration.RUNS}
    for c in checks:
        assert c.predicted_ms == pytest.approx(recorded[c.run]["predicted_ms"], rel=1e-4), c.run
    assert all(abs(c.error) < 0.10 for c in checks if c.fitted), [(c.run, c.error) for c in checks]
    one_rank = [c for c, r in zip(checks, cpu_calibration.RUNS) if not c.fitted and r.nproc == 1]
    assert one_rank and all(abs(c.error) < 0.15 for c in one_rank), [(c.run, c.error) for c in one_rank]


def test_on_a_cpu_fsdp_collectives_are_not_hidden_behind_compute():
    """FSDP2 overlaps its collectives with compute through CUDA streams only: on plan.device=cpu their
    bandwidth time is exposed whole, on cuda only what exceeds the dense compute."""
    from gem.plan.steptime import predict, traffic
    from tests.test_plan import _plan

    common = ["plan.world_size=2", "plan.gpus_per_node=2", "plan.activations=none", "plan.intra_node_gbps=1"]
    rows = {d: predict(p, traffic(p, 2)) for d in ("cpu", "cuda") for p in [_plan(*common, f"plan.device={d}")]}
    t = traffic(_plan(*common, "plan.device=cpu"), 2)
    bandwidth_ms = (t.fsdp_gather_bytes + t.fsdp_reduce_bytes) / 1e9 * 1e3
    latency_ms = t.gathers * 0.71  # plan.collective_latency_ms's default
    assert bandwidth_ms > 0 and rows["cpu"].parts_ms["fsdp exposed"] == pytest.approx(bandwidth_ms + latency_ms)
    dense = rows["cuda"].parts_ms["dense"]
    assert rows["cuda"].parts_ms["fsdp exposed"] == pytest.approx(max(0.0, bandwidth_ms - dense) + latency_ms)


def test_profiled_operators_are_booked_to_the_model_parts():
    from gem.plan.cpu_calibration import profile_parts

    ops = [
        {"name": "FSDP::all_gather (top)", "ms_per_step": 3.0},
        {"name": "c10d::_reduce_scatter_base_", "ms_per_step": 1.0},
        {"name": "All2All_Seq_Req_Wait", "ms_per_step": 2.0},
        {"name": "## KJTAllToAllTensorsAwaitable wait() ##", "ms_per_step": 0.5},
        {"name": "fbgemm::permute_2D_sparse_data", "ms_per_step": 4.0},
        {"name": "fbgemm::split_embedding_nobag_backward_codegen_rowwise_adagrad_cpu", "ms_per_step": 5.0},
        {"name": "aten::mm", "ms_per_step": 7.0},
        {"name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "ms_per_step": 0.25},
    ]
    assert profile_parts(ops) == {
        "data": 0.25,
        "fsdp": 4.0,
        "all-to-all": 2.5,
        "input dist": 4.0,
        "embedding": 5.0,
        "dense": 7.0,
    }
