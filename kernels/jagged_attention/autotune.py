"""Launch configurations of the Triton kernels: per-head-dim defaults and the autotune spaces.

A kernel file asks :func:`kernel_and_config` for what to launch: the kernel under
``triton.autotune`` (``settings.autotune``; its key bucketed, see ``triton_common.bucket``)
or the plain kernel with its default config. The measurements behind the lists are in
docs/log/kernels.md.
"""

from __future__ import annotations

import functools

import triton

from kernels.jagged_attention.settings import KernelSettings
from kernels.jagged_attention.triton_common import INTERPRET, SOFTMAX


def _default_config(kind: str, block_d: int, elem_bytes: int = 2) -> dict:
    """Block sizes, warps and stages per kernel kind and padded head dim (and the forward's
    plain loop, ``LATE_PV=0``), used when autotuning is off (the autotune setting) and for head
    dims above 128."""
    config = _default_tiles(kind, block_d, elem_bytes)
    config = config | dict(LATE_PV=0) if kind == "fwd" else config
    return config | _FORCED.get(kind, {})


def _default_tiles(kind: str, block_d: int, elem_bytes: int) -> dict:
    """Block sizes, warps and stages of _default_config. fp32 inputs (``elem_bytes=4``) take
    the backward tiles of the next larger head dim: an earlier 16-bit dK/dV tile (64 x 128)
    needed 262,656 bytes of shared memory in fp32 at head dim 128, over the H200's 232,448
    (measured: OutOfResources)."""
    if INTERPRET:  # small tiles keep the interpreter fast and exercise multi-block paths
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if elem_bytes >= 4 and kind != "fwd" and block_d > 64:
        block_d = 2 * block_d
    if kind == "fwd":
        if block_d <= 64:
            return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
        if block_d <= 128:
            return dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4)
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
    if kind == "dkdv":  # BLOCK_N: key rows held; BLOCK_M: query rows streamed
        if block_d <= 128:
            return dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)
        return dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=1)
    # dq: BLOCK_M query rows held; BLOCK_N key rows streamed
    if block_d <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1)


# Autotune candidates (BLOCK_M, BLOCK_N, num_warps, num_stages[, LATE_PV]) for head dims up to
# 128: the configs the wide search below picked on an H200 for the benchmark's shapes (bf16,
# D=128; benchmarks/results/attention-h200.json, "tuned_configs"), and the forward's LATE_PV
# loop (_fwd_gdpa_late_pv): forced, it was faster than the plain loop on the benchmark's rows of
# up to 1024 and 2048 keys, slower on those of 256 and up to 512 (docs/log/kernels.md); the
# benchmark's tuning chose it at 2048.
_TUNE_SPACE = {
    "fwd": [(128, 32, 4, 4), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4, 1)],
    "dkdv": [(32, 64, 4, 3), (64, 128, 8, 3), (64, 64, 4, 2)],
    "dq": [(128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 4, 3)],
    "dq_ds": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3)],  # not yet tuned on a GPU
}
# GEM_KERNELS_TUNE_SPACE=wide: a larger search for benchmarks and for choosing the list above
# (about three times the tuning time at each new shape bucket).
_WIDE_EXTRA = {
    "fwd": [(128, 64, 8, 2), (128, 128, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 4)],
    "dkdv": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2)],
    "dq": [(128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 4, 2)],
    "dq_ds": [(128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 2), (64, 32, 4, 3)],
}

# (keys a kernel lacks are skipped)
_TUNE_KEY = [
    "max_q_bucket",
    "max_kv_bucket",
    "BLOCK_D",
    "ACTIVATION",
    "CAUSAL",
    "HAS_WINDOW",
    "HAS_BLOCK",
    "Q_BROADCAST",
    "PACKED_ACT",
    "STORE_DS",
    "ROPE",
]
# Test-facing: launch-config entries that replace the defaults' (``testing.forced_config``).
_FORCED: dict[str, dict] = {}


def tune_space(kind: str, space: str) -> list[tuple]:
    """The candidates (BLOCK_M, BLOCK_N, num_warps, num_stages[, LATE_PV]) of a kernel kind."""
    return _TUNE_SPACE[kind] + (_WIDE_EXTRA[kind] if space == "wide" else [])


@functools.cache
def _tuned(kernel, kind: str, space: str):
    """The kernel under triton.autotune over :func:`tune_space`; head dims above 128 and the fp32
    backward get their one default config."""
    configs = []
    for m, n, w, s, *late in tune_space(kind, space):
        tiles = dict(BLOCK_M=m, BLOCK_N=n)
        if kind == "fwd":
            tiles["LATE_PV"] = late[0] if late else 0
        configs.append(triton.Config(tiles, num_warps=w, num_stages=s))

    def prune(configs, named_args, **kwargs):
        args = named_args | kwargs
        block_d = args.get("BLOCK_D", 128)
        q = args.get("Q", args.get("K"))
        elem_bytes = q.element_size() if hasattr(q, "element_size") else 2
        if kind == "fwd" and not late_pv_applies(args):
            configs = [config for config in configs if not config.kwargs["LATE_PV"]]
        if block_d <= 128 and (elem_bytes < 4 or kind == "fwd"):
            return configs
        # Head dims above 128, and the fp32 backward (whose 16-bit candidates overflow shared memory
        # at head dim 128), launch their one default config.
        launch = dict(_default_config(kind, block_d, elem_bytes))
        warps, stages = launch.pop("num_warps"), launch.pop("num_stages")
        return [triton.Config(launch, num_warps=warps, num_stages=stages)]

    tuned = triton.autotune(configs=configs, key=_TUNE_KEY, prune_configs_by={"early_config_prune": prune})(kernel)
    _AUTOTUNERS[kind, space] = tuned
    return tuned


_AUTOTUNERS: dict[tuple[str, str], triton.runtime.Autotuner] = {}


def late_pv_applies(meta: dict) -> bool:
    """Whether _fwd_kernel runs its LATE_PV loop: GDPA without a causal, window or block mask."""
    return meta["ACTIVATION"] != SOFTMAX and not (meta["CAUSAL"] or meta["HAS_WINDOW"] or meta["HAS_BLOCK"])


def kernel_and_config(kernel, kind: str, block_d: int, elem_bytes: int, config: KernelSettings):
    """(kernel, launch kwargs): the autotuned kernel (``config.autotune`` on a GPU), or the plain
    one with its default config."""
    if config.autotune and not INTERPRET:
        return _tuned(kernel, kind, config.tune_space), {}
    return kernel, _default_config(kind, block_d, elem_bytes)


def tuned_configs() -> dict:
    """``{kind: {autotune key: chosen config}}`` for every shape bucket tuned in this process."""
    chosen = {}
    for (kind, _), tuned in _AUTOTUNERS.items():
        chosen.setdefault(kind, {}).update(
            {str(key): str(config) for key, config in getattr(tuned, "cache", {}).items()}
        )
    return chosen
