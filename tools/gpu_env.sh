# Source this on a lent GPU machine (repository root, wheels carried in .whl/): installs the
# wheels the image lacks into /tmp/site and puts it and the repository on PYTHONPATH.
#   . tools/gpu_env.sh
# Wheels (downloaded on a machine with PyPI, for CPython 3.12, manylinux x86_64): torchrec 1.6.1,
# fbgemm-gpu-cpu 1.6.0, tensordict 0.13.0, hydra-core, omegaconf, antlr4-python3-runtime 4.9.3,
# iopath, pyvers, orjson, importlib_metadata, and pytest-xdist + execnet for tools/gpu_kernels_check.sh
# (the image has torch 2.11, triton 3.6, pyarrow, torchmetrics, tqdm, pyre-extensions).
# Pins: omegaconf 2.3.1 (hydra-core 1.3.8 needs < 2.4); iopath 0.1.10 and antlr4 built with `pip wheel`; the rest by
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform any`.
if [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.installed || return 1
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# A bytecode cache, as a pip install has: in a warm gem_base start profiled on 2026-12-03 (a lease's
# fourth process) Python still compiled 2,833 modules from source, so the image's python kept none
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
