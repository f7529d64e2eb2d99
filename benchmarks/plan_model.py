"""Calibrate gem.plan's step-time model on the measured H200 runs and report its error on them.

    python benchmarks/plan_model.py

Fits ``plan.mfu``, ``plan.embedding_efficiency`` and ``plan.collective_latency_ms``
(gem/plan/steptime.py ``calibrate``) to benchmarks/results/e2e-h200-fbgemm.json and scaling-h200.json,
predicts the other runs of those files and of e2e-h200.json, prints a table and writes
``benchmarks/results/plan_model-h200.json``. Runs on a CPU in seconds (no GPU: it reads the results).
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scaling import commit  # noqa: E402
from gem.plan.steptime import calibrate  # noqa: E402


def main() -> None:
    fitted, checks = calibrate()
    print("fitted: " + ", ".join(f"plan.{k}={v:.4g}" for k, v in fitted.items()))
    print(f"{'run':<90} {'measured ms':>11} {'predicted ms':>12} {'error':>7}  fitted")
    for c in checks:
        print(f"{c.run:<90} {c.measured_ms:>11.1f} {c.predicted_ms:>12.1f} {c.error:>+7.1%}  {c.fitted or ''}")
    held_out = [abs(c.error) for c in checks if not c.fitted]
    print(f"held-out runs: mean |error| {sum(held_out) / len(held_out):.1%}, max {max(held_out):.1%}")
    out = {
        "benchmark": "plan_model",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "commit": commit(),
        "hardware": "calibrated on 1x and 2x NVIDIA H200 runs (read, not run)",
        "fitted": fitted,
        "checks": [
            {
                "run": c.run,
                "source": c.source,
                "measured_ms": c.measured_ms,
                "predicted_ms": c.predicted_ms,
                "error": c.error,
                "fitted": c.fitted,
            }
            for c in checks
        ],
    }
    path = ROOT / "benchmarks" / "results" / "plan_model-h200.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
