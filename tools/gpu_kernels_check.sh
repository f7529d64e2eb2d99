#!/usr/bin/env bash
# GPU check of the kernels split (issue #26 part 1): on one H200, from the repository root,
#   bash tools/gpu_kernels_check.sh [all|bench|tests]      (default all; outputs under $OUT)
# 1. the attention benchmark with the arguments of the newest committed attention JSON,
#    benchmarks/results/attention-h200.json (committed in 44ec30b, measured at 746b90b: the target
#    rows, sweeps kept from d92a74e, i.e. `python benchmarks/attention.py --keep-sweeps`), written to
#    $OUT/attention-h200.json (the committed file is copied there first: --keep-sweeps reads its sweep
#    rows), then every target row (gem and baselines) against the committed one ($OUT/compare.txt);
# 2. the GPU kernel tests, `pytest tests/kernels -m gpu` ($OUT/pytest-gpu.txt, junit XML; -n 4 with
#    pytest-xdist; a run cut by the budget says so: rc 124). `bash ... tests` runs them alone (2026-12-01:
#    the compile tests 102 s, then the 107 GPU tests 233 s with -n 4 on a 16-core H200 host).
# 0. torch.compile (Inductor) on CUDA: test_torch_compile_fullgraph and the FLOP counter (<= 120 s).
# Budget: 470 s in all (compile tests <= 120 s, benchmark <= 300 s, the GPU tier the rest, at
# least 60 s), each under `timeout`.
set -u
OUT=${OUT:-/tmp/kernels_check}
mkdir -p "$OUT"
PY=${PY:-python}
MODE=${1:-all}
START=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,power.draw,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  # the device copy may lack .git
echo "$GIT_COMMIT" > "$OUT/commit.txt"

if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  # torch.compile with Inductor on CUDA (not gpu-marked, so -m gpu below leaves it out): the op reads
  # the settings inside its triton_op; the entry reads them outside compiled regions (9857e4e)
  timeout -k 10 120 $PY -m pytest tests/kernels/test_jagged_attention.py -q -p no:cacheprovider \
    -k "fullgraph or flop_counter or backend_none" > "$OUT/pytest-compile.txt" 2>&1
  echo "pytest (compile) rc=$?" | tee -a "$OUT/pytest-compile.txt"
  tail -5 "$OUT/pytest-compile.txt"
fi

if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  cp benchmarks/results/attention-h200.json "$OUT/attention-h200.json"
  timeout -k 10 300 $PY benchmarks/attention.py --keep-sweeps --out "$OUT" > "$OUT/bench.txt" 2>&1
  echo "benchmark rc=$?" | tee -a "$OUT/bench.txt"
  $PY - "$OUT" > "$OUT/compare.txt" 2>&1 <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
old = json.loads(pathlib.Path("benchmarks/results/attention-h200.json").read_text())
new = json.loads((out / "attention-h200.json").read_text())
def rows(record):
    return {(r["shape"], r["activation"], r["impl"]): r for r in record["rows"]
            if r.get("status") == "ok" and "target_row" in r}
before, after = rows(old), rows(new)
print(f"committed {old['git_commit'][:10]} ({old['date'][:16]}) vs this run {new['git_commit'][:10]} ({new['date'][:16]})")
for key in sorted(before):
    if key not in after:
        print(f"{key}: missing in this run")
        continue
    b, a = before[key], after[key]
    print(f"{key[0]:<32} {key[1]:<9} {key[2]:<32} fwd {a['fwd_tflops']:6.1f} / {b['fwd_tflops']:6.1f} "
          f"({a['fwd_tflops'] / b['fwd_tflops']:.3f}x)  fwd+bwd {a['full_tflops']:6.1f} / "
          f"{b['full_tflops']:6.1f} ({a['full_tflops'] / b['full_tflops']:.3f}x)")
PYEOF
  cat "$OUT/compare.txt"
fi

if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  LEFT=$(( 470 - ($(date +%s) - START) ))
  [ "$LEFT" -lt 60 ] && LEFT=60
  XDIST=""
  $PY -c "import xdist" 2>/dev/null && XDIST="-n 4"  # compile-bound: 4 workers where pytest-xdist is there
  # -v: each test's outcome is logged as it ends, so a run the timeout cuts still names its failures
  timeout -k 10 "$LEFT" $PY -m pytest tests/kernels -m gpu -v --maxfail=5 -p no:cacheprovider $XDIST \
    --junitxml="$OUT/pytest-gpu.xml" > "$OUT/pytest-gpu.txt" 2>&1
  echo "pytest rc=$? (budget ${LEFT}s, ${XDIST:-no xdist})" | tee -a "$OUT/pytest-gpu.txt"
  grep -E "FAILED|ERROR" "$OUT/pytest-gpu.txt" | head -20
  tail -5 "$OUT/pytest-gpu.txt"
fi
