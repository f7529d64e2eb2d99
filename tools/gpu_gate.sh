#!/usr/bin/env bash
# The GPU gate (docs/kernels.md, "The GPU gate"): a kernel or a default setting changes only with a
# passing gate on its commit. On a lent GPU, from the repository root, the wheels of
# tools/gpu_env.sh in .whl/, a clean tree at the commit named:
#   GIT_COMMIT=<sha> bash tools/gpu_gate.sh        (about 9 minutes; results under $OUT)
# 1. the kernel GPU tests and torch.compile on CUDA (pytest tests/kernels, -n 8) and, at the same
#    time, the rest of the GPU tier (pytest -m gpu tests --ignore=tests/kernels, -n 4): correctness
#    only, so they may share the GPU;
# 2. then, alone on the GPU, the flagship for each block with its defaults: 60 steps, its compiled
#    evaluation and test metrics (python -m gem.train experiment=gem_base_h200 model.block=...);
# 3. tools/gpu_gate.py summarize: $OUT/gpu-gate.json (commit, versions, hardware, tests by name and
#    outcome, each run's exit code, examples/s, MFU, test AUC, kernel fallbacks) and a verdict.
# Copy $OUT/gpu-gate.json to benchmarks/results/gpu-gate.json and name the commit in README's status.
set -u
OUT=${OUT:-/tmp/gpu_gate}
mkdir -p "$OUT/runs"
. tools/gpu_env.sh || exit 1
: "${GIT_COMMIT:?set GIT_COMMIT to the commit under test (the device copy has no .git)}"
export GIT_COMMIT
nvidia-smi --query-gpu=name,clocks.sm,power.draw,memory.used --format=csv > "$OUT/gpu.txt" 2>&1

phase() {  # phase NAME LIMIT_S pytest-args...: JUnit XML, log and exit status under $OUT
  local name=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" python -m pytest -p no:cacheprovider -q --junitxml="$OUT/$name.xml" "$@" > "$OUT/$name.txt" 2>&1
  echo $? > "$OUT/$name.rc"
  echo "$name: rc $(cat "$OUT/$name.rc"); $(tail -1 "$OUT/$name.txt")"
}

phase kernels 270 tests/kernels -n 8 -k "test_gpu or fullgraph or flop_counter or backend_none" &
phase gpu_tier 270 tests -m gpu --ignore=tests/kernels -n 4 &
wait

for block in interformer kunlun; do
  timeout -k 10 150 python -m gem.train experiment=gem_base_h200 model.block=$block trainer.max_steps=60 \
    data.num_examples.train=70000 trainer.run_dir="$OUT/runs/$block" > "$OUT/$block.txt" 2>&1
  echo $? > "$OUT/$block.rc"
  echo "flagship $block: rc $(cat "$OUT/$block.rc")"
done

python tools/gpu_gate.py summarize "$OUT"
