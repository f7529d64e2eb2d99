#!/usr/bin/env bash
# Bring the CUDA build of fbgemm-gpu (465 MB) to a lent GPU machine whose calls carry 64 MiB each.
#
# Here (a machine with PyPI):   tools/fbgemm_gpu_parts.sh split
#   downloads fbgemm-gpu (cp312, CUDA 13, like the H200 image's torch 2.11 cu130) into .whl-fbgemm/
#   and cuts it into parts of 50 MiB (part.00, part.01, ...) plus MANIFEST (name, sha256, parts).
# There, one call per part in quick succession (the machine is kept only about 30 s between calls),
# each carrying [.whl, .whl-fbgemm/MANIFEST, .whl-fbgemm/part.NN]:
#   bash tools/fbgemm_gpu_parts.sh receive && <the call's own work>
#   appends the carried part to /tmp/fbgemm_gpu/ (outside the checkout, kept while the machine is
#   warm); after the last part it checks the sha256 and installs the wheel into /tmp/site over the
#   CPU build that tools/gpu_env.sh installed. Then `. tools/gpu_env.sh` sees the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${FBGEMM_GPU_VERSION:-1.6.0}
HERE=.whl-fbgemm
THERE=/tmp/fbgemm_gpu

split_wheel() {
  mkdir -p "$HERE/wheel"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$HERE/wheel" "fbgemm-gpu==$VERSION"
  local wheel
  wheel=$(ls "$HERE"/wheel/fbgemm_gpu-"$VERSION"-*.whl)
  rm -f "$HERE"/part.*
  split -b 50M -d "$wheel" "$HERE/part."
  printf '%s %s %s\n' "$(basename "$wheel")" "$(sha256sum "$wheel" | cut -d' ' -f1)" \
    "$(ls "$HERE"/part.* | wc -l)" >"$HERE/MANIFEST"
  cat "$HERE/MANIFEST"
}

received() { if [ -f "$THERE/received" ]; then wc -l <"$THERE/received"; else echo 0; fi; }

receive() {
  read -r name sha parts <"$HERE/MANIFEST"
  mkdir -p "$THERE"
  if [ -f "$THERE/installed" ]; then echo "fbgemm-gpu: $name already installed"; return; fi
  local part have
  for part in $(find "$HERE" -maxdepth 1 -name "part.*" | sort); do
    have=$(received)
    if [ "$(basename "$part")" != "part.$(printf '%02d' "$have")" ]; then
      echo "fbgemm-gpu: carried $(basename "$part"), but part.$(printf '%02d' "$have") is next; carry the parts in order" >&2
      return 1
    fi
    cat "$part" >>"$THERE/$name"
    basename "$part" >>"$THERE/received"
    rm -f "$part"  # ignored files stay in the checkout between calls: do not append one twice
  done
  have=$(received)
  echo "fbgemm-gpu: $have of $parts parts received"
  [ "$have" -lt "$parts" ] && return 0
  echo "$sha  $THERE/$name" | sha256sum -c --quiet || { echo "fbgemm-gpu: sha256 mismatch; start over" >&2; rm -rf "$THERE"; return 1; }
  . tools/gpu_env.sh  # the other wheels (and the CPU build, replaced next)
  rm -rf /tmp/site/fbgemm_gpu /tmp/site/fbgemm_gpu_cpu-*.dist-info
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$THERE/$name"
  rm -f "$THERE/$name"
  touch "$THERE/installed"
  python3 -c "import fbgemm_gpu, torch; print('fbgemm-gpu', fbgemm_gpu.__version__, fbgemm_gpu.__variant__, 'torch', torch.__version__)"
}

case "${1:-}" in
  split) split_wheel ;;
  receive) receive ;;
  *) echo "usage: $0 split | receive" >&2; exit 2 ;;
esac
