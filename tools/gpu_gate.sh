#!/usr/bin/env bash
# The GPU gate (docs/kernels.md, "The GPU gate"): a kernel or a default setting changes only with a
# passing gate on its commit. On a lent GPU, from the repository root, the wheels of
# tools/gpu_env.sh in .whl/, a clean tree at the commit named, in two device calls of under 10
# minutes each (a fresh machine compiles everything cold):
#   GIT_COMMIT=<sha> bash tools/gpu_gate.sh tests      # -> $OUT/gpu-gate-tests.json
#   GIT_COMMIT=<sha> bash tools/gpu_gate.sh flagship   # -> $OUT/gpu-gate-flagship.json
# then, here: python tools/gpu_gate.py merge <tests.json> <flagship.json> -o benchmarks/results/gpu-gate.json
# tests:    the kernel GPU tests with torch.compile on CUDA (pytest tests/kernels, -n 6: more workers ran out of GPU memory on an H100) and, at the
#           same time, the rest of the GPU tier (pytest -m gpu tests --ignore=tests/kernels, -n 2):
#           correctness only, so they may share the GPU (a cold machine took over 540 s for them);
# flagship: first, alone, the kernel tests of many tiles (the largest inputs: beside the others they
#           failed on an H100, alone they passed); then, alone on the GPU, the flagship for each block
#           with its defaults: 60 steps, its compiled evaluation and test metrics
#           (python -m gem.train experiment=gem_base_h200 model.block=...).
# Each part's JSON: commit, versions, hardware, the tests by name and outcome (from the log where a
# phase was cut before pytest wrote its XML) / each run's exit code, examples/s, MFU, test AUC and
# kernel fallbacks, each phase's and run's seconds (and a phase's slowest tests), and its verdict;
# each phase's log tail goes to $OUT too.
# GATE_SECONDS (default 600): the device call's limit. Every phase and run is cut to end SUMMARY_S
# before it, counted from this script's start (the wheels' install included), so that the part's
# JSON is written whatever the machine's speed; a run with too little time left is not started.
set -u
PART=${1:?say which part: tests or flagship}
OUT=${OUT:-/tmp/gpu_gate}
WORK=${GATE_WORK:-/tmp/gpu_gate_work}  # the runs' folders and logs (only the summaries and log tails go to $OUT)
SUMMARY_S=30
DEADLINE=$((${GATE_SECONDS:-600} - SUMMARY_S))
mkdir -p "$OUT" "$WORK/runs"
. tools/gpu_env.sh || exit 1
: "${GIT_COMMIT:?set GIT_COMMIT to the commit under test (the device copy has no .git)}"
export GIT_COMMIT

room() {  # room LIMIT_S: LIMIT_S, or the seconds left before the deadline where fewer (0 at least)
  local left=$((DEADLINE - SECONDS))
  left=$((left < 0 ? 0 : left))
  echo $(($1 < left ? $1 : left))
}

phase() {  # phase NAME LIMIT_S pytest-args...: JUnit XML, log (a line per test), exit status and seconds under $WORK
  local name=$1 limit start=$SECONDS
  limit=$(room "$2")
  shift 2
  if [ "$limit" -ge 5 ]; then  # (timeout 0 would mean no limit)
    timeout -k 5 "$limit" python -m pytest -p no:cacheprovider -v -rf --junitxml="$WORK/$name.xml" "$@" \
      > "$WORK/$name.txt" 2>&1
    echo $? > "$WORK/$name.rc"
  else
    echo "not started: $limit s left before the call's limit" > "$WORK/$name.txt"
    echo 124 > "$WORK/$name.rc"
  fi
  echo $((SECONDS - start)) > "$WORK/$name.seconds"
  echo "$name: rc $(cat "$WORK/$name.rc"); $(tail -1 "$WORK/$name.txt")"
  grep -E "^(FAILED|ERROR)" "$WORK/$name.txt" | head -40 > "$OUT/$name-failures.txt"
  grep -vE "fbgemm_torch_compat|cannot determine compat|^WARNING:root|^\s*(.\[[0-9]+m)?\s*$" "$WORK/$name.txt" \
    | tail -c 6000 > "$OUT/$name-tail.txt"
}

case "$PART" in
  tests)
    phase kernels 570 tests/kernels -n 6 -k "(test_gpu or fullgraph or flop_counter or backend_none) and not many_tiles" &
    phase gpu_tier 570 tests -m gpu --ignore=tests/kernels -n 2 &
    wait
    ;;
  flagship)
    phase kernels_alone 90 tests/kernels -n 1 -k "test_gpu and many_tiles"
    for block in interformer kunlun; do
      start=$SECONDS
      limit=$(room 240)
      if [ "$limit" -lt 60 ]; then  # (a cold run takes about 130 s to its first step)
        echo "not started: $limit s left before the call's limit" > "$WORK/$block.txt"
        echo 124 > "$WORK/$block.rc"
      else
        timeout -k 5 "$limit" python -m gem.train experiment=gem_base_h200 model.block=$block trainer.max_steps=60 \
          data.num_examples.train=70000 trainer.progress_bar=false trainer.run_dir="$WORK/runs/$block" \
          > "$WORK/$block.txt" 2>&1
        echo $? > "$WORK/$block.rc"
      fi
      echo $((SECONDS - start)) > "$WORK/$block.seconds"
      echo "flagship $block: rc $(cat "$WORK/$block.rc")"
      tail -c 4000 "$WORK/$block.txt" > "$OUT/$block-tail.txt"
    done
    ;;
  *)
    echo "unknown part $PART: tests or flagship" >&2
    exit 2
    ;;
esac
python tools/gpu_gate.py summarize "$WORK" --part "$PART" -o "$OUT/gpu-gate-$PART.json"
