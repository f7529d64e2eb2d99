"""Triton kernels for jagged attention (Jagged Flash Attention and GDPA) and their launchers.

Reads top-down: ``@triton.jit`` helpers and kernels (forward, backward preprocess, dK/dV,
dQ), then the launchers that check inputs, allocate outputs and compute grids. The
autograd function and the torch.library registration live in ``op.py``; the math is
specified by ``reference.py``.

One program handles one (example, head, row block). Every mask (jagged length, causal,
sliding window, BlockAttention) keeps, for each query row, one contiguous interval of keys,
so each program visits only the key blocks that intersect the union of its rows'
intervals: blocks visible to every row run without any mask, the few border blocks run
masked (without a causal, window or block mask: one loop over all blocks, see BOUNDS below).
BlockAttention and sliding window therefore cost O(length), not O(length^2).
Programs are ordered longest example first (``batch_order``), so the short and empty
examples fill the tail of the grid instead of leaving long ones to run alone.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from kernels.jagged_attention.reference import ACTIVATIONS

# Activation codes passed to the kernels as a constexpr.
SOFTMAX, SILU, GELU, FAST_GELU, RELU, IDENTITY = range(6)
ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _env_flag(name: str, default: bool) -> bool:
    """A switch from the environment: 1 or 0 (also true / false, on / off, yes / no); unset or
    empty, ``default``. Anything else is an error that names the variable."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1 or 0")


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)}")
    return value


def _env_mib(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip() or str(default)
    try:
        return int(value) << 20
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a whole number of MiB, e.g. {default}") from None

# act(scale * x) = ACT_UNIT * scale * _gdpa_act(x) and act'(scale * x) = ACT_UNIT * (its
# second factor in _gdpa_act_and_grad): the launchers fold these constants into the output,
# dV and dQ / dK scales.
ACT_UNIT = {"silu": 0.5, "gelu": 0.5, "fast_gelu": 0.5, "relu": 1.0, "identity": 1.0}
# GEM_KERNELS_PACKED_ACT (default 1): with bf16 inputs, silu and fast_gelu (forward and
# backward) run on bf16x2 pairs (_gdpa_act_packed). Measured on H200s at the benchmark's
# shapes: forward 1-15% and forward+backward 6-10% faster than float32; relative error against
# the float64 reference 3.7e-3 (output) and 5.1e-3 (dQ, dK) instead of 2.3e-3 (docs/kernels.md).
# Set 0 for float32 math.
PACKED_ACT = not INTERPRET and _env_flag("GEM_KERNELS_PACKED_ACT", True)
# GEM_KERNELS_TMA=1 (experimental, default 0; slower on an H200, see docs/kernels.md): the
# kernels read the tiles they stream (K/V in the forward and dQ, Q/dO in dK/dV) through tensor
# descriptors (TMA on sm_90: no address arithmetic, zero fill past the sequence end instead of
# masked loads).
# See _use_tma for when it applies.
USE_TMA = _env_flag("GEM_KERNELS_TMA", False)
# GEM_KERNELS_GLUON (default 1; 0 turns it off): the GDPA forward without a mask runs the
# persistent, warp-specialized Gluon kernel of gluon.py on sm_90 GPUs where it applies
# (gluon.applies, eager calls) and max_q_len exceeds GLUON_MIN_Q_LEN; everything else, the
# backward included, stays here. At 128 rows the Triton forward measured 3-5% faster on an H200;
# from 256 rows up the Gluon one, by 5-15% at 256 and 14-19% at 512 (fill 0.5, fast_gelu;
# `benchmarks/attention.py --lengths`, docs/kernels.md "The Gluon forward").
USE_GLUON = _env_flag("GEM_KERNELS_GLUON", True)
GLUON_MIN_Q_LEN = 128
# GEM_KERNELS_GLUON_BWD (default 1; 0 turns it off): the stored-dS backward's dK/dV runs gluon.py's
# persistent, warp-specialized kernel for bf16 silu and fast_gelu on sm_90 where it applies
# (_gluon_dkdv). Measured on an H200 (fast_gelu, head dim 128), the backward 8% faster at 512 rows
# (fill 0.5), 10% at 1024, 15% at pffn, level at 2048 and 1024 fill 1.0 (docs/kernels.md).
USE_GLUON_BWD = _env_flag("GEM_KERNELS_GLUON_BWD", True)
# GEM_KERNELS_STORE_DS (default 1; 0 turns it off): without a causal, window or block mask and
# without a broadcast Q, the dK/dV kernel also stores dS (the score gradient, in the input dtype)
# and dQ = dS K comes from _bwd_dq_from_ds_kernel, one product per tile pair instead of the dQ
# kernel's three (it recomputes S and dP). The backward measured 3-13% faster on an H200. It
# costs a transient buffer of H x (K/V rows) x max_q_len (rounded up to 128) elements, at most
# GEM_KERNELS_STORE_DS_MAX_MIB (default 8192; above it the dQ kernel recomputes): at the
# benchmark's rows 1.2 GB (512), 2.2 GB (pffn), 5.0 GB (1024 fill 0.5), 9.7 GB (1024 fill 1.0,
# over the cap).
STORE_DS = _env_flag("GEM_KERNELS_STORE_DS", True)
STORE_DS_MAX_BYTES = _env_mib("GEM_KERNELS_STORE_DS_MAX_MIB", 8192)


def autotune_enabled() -> bool:
    """GEM_KERNELS_AUTOTUNE (default 1 on GPU): time a few configs per bucketed shape key.

    With 0, the per-head-dim default config below is launched directly (no tuning runs);
    the interpreter always uses one small config.
    """
    return not INTERPRET and _env_flag("GEM_KERNELS_AUTOTUNE", True)


# Triton 3.7's interpreter gets bf16 tl.dot wrong; there every dot runs on float32 copies of
# its (already rounded) operands, which keeps the numerics of the compiled kernel.
_UPCAST_DOTS = tl.constexpr(INTERPRET)

LOG2E = 1.4426950408889634
SQRT_2_OVER_PI = 0.7978845608028654
INV_SQRT_2 = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327

# How the inner loops mask a stretch of tiles (their MASK constexpr). UNMASKED tiles lie inside
# the sequence and the mask. BOUNDS tiles may run past the sequence end: masked loads fill zeros,
# and zero rows add nothing to any output or gradient, except through softmax's exp2 (a key past
# the end scores 0, and exp2(0 - lse) joins the forward's normaliser or overflows in dQ), so
# only the softmax forward and dQ mask (their key columns). VISIBLE tiles straddle a causal,
# window or block boundary and mask every score. Without a causal, window or block mask the
# kernels stream all tiles in one BOUNDS loop: one software pipeline, not a second one for the
# ragged tail.
UNMASKED, BOUNDS, VISIBLE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


# ---------------------------------------------------------------------------------------
# @triton.jit helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc + a @ b with a float32 accumulator."""
    if _UPCAST_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh; FAST uses the hardware approximation (MUFU.TANH, rel. error ~5e-4, 16-bit inputs)."""
    if FAST and not _UPCAST_DOTS:
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gdpa_act(x, scale, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """act(scale * x) / (unit * scale) for the raw score x = q . k (float32).

    The constant factor ``unit * scale`` (``ACT_UNIT``) is left to the launchers, which fold it
    into the output (forward) or dV (backward) scale: the kernels then spend four float32
    operations and one MUFU.TANH per score on fast_gelu instead of eight.
    """
    if ACTIVATION == 1:  # silu: 0.5 s (1 + tanh(s / 2))
        t = _tanh(x * (0.5 * scale), FAST)
        return x + x * t
    elif ACTIVATION == 2:  # gelu: 0.5 s (1 + erf(s / sqrt 2))
        return x + x * tl.erf(x * (scale * 0.7071067811865476))
    elif ACTIVATION == 3:  # fast_gelu: 0.5 s (1 + tanh(sqrt(2/pi) (s + 0.044715 s^3)))
        a = scale * 0.7978845608028654
        b = a * 0.044715 * scale * scale
        t = _tanh(x * (a + b * (x * x)), FAST)
        return x + x * t
    elif ACTIVATION == 4:  # relu
        return tl.maximum(x, 0.0)
    else:  # identity
        return x


# The bf16x2 PTX of _gdpa_act_packed (also used by gluon.py): two scores per 32-bit register.
# silu: $0 = x + x tanh(h x) for x = $1, h = $2 (scale / 2).
SILU_BF16X2 = tl.constexpr(
    "{ .reg .b32 h, t; mul.rn.bf16x2 h, $1, $2; tanh.approx.bf16x2 t, h; "
    "fma.rn.bf16x2 $0, $1, t, $1; }")
# fast_gelu: $0 = x + x tanh(x (a + b x^2)) for x = $1, a = $2, b = $3.
FAST_GELU_BF16X2 = tl.constexpr(
    "{ .reg .b32 sq, u, t; mul.rn.bf16x2 sq, $1, $1; fma.rn.bf16x2 u, sq, $3, $2; "
    "mul.rn.bf16x2 u, $1, u; tanh.approx.bf16x2 t, u; fma.rn.bf16x2 $0, $1, t, $1; }")


@triton.jit
def _gdpa_act_packed(x, scale, ACTIVATION: tl.constexpr):
    """:func:`_gdpa_act` of bf16 scores x (silu, fast_gelu), two at a time: bf16x2 multiplies
    and FMAs, and one MUFU.TANH for two values. Returns bf16. The PTX (``mul.rn.bf16x2``,
    ``tanh.approx.bf16x2``) needs sm_90; the launchers check (:func:`_packed_act`)."""
    if ACTIVATION == 1:
        h = tl.full(x.shape, 0.5 * scale, x.dtype)
        return tl.inline_asm_elementwise(SILU_BF16X2, "=r,r,r", [x, h], dtype=x.dtype,
                                         is_pure=True, pack=2)
    else:
        a = scale * 0.7978845608028654
        a2 = tl.full(x.shape, a, x.dtype)
        b2 = tl.full(x.shape, a * 0.044715 * scale * scale, x.dtype)
        return tl.inline_asm_elementwise(FAST_GELU_BF16X2, "=r,r,r,r", [x, a2, b2],
                                         dtype=x.dtype, is_pure=True, pack=2)


@triton.jit
def _gdpa_p(x, scale, dtype: tl.constexpr, ACTIVATION: tl.constexpr, PACKED_ACT: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """The forward's P = :func:`_gdpa_act` of the float32 scores x, in ``dtype`` (bf16x2 math
    where PACKED_ACT)."""
    if PACKED_ACT:
        return _gdpa_act_packed(x.to(dtype), scale, ACTIVATION)
    return _gdpa_act(x, scale, ACTIVATION, DOT_PRECISION != "ieee").to(dtype)


# The bf16x2 PTX of _gdpa_act_and_grad_packed (also used by gluon.py): $0 = P and $1 = dP * g
# (the value and gradient factors of _gdpa_act_and_grad) for x = $2, dP = $3.
# silu: h = $4 (scale / 2).
SILU_GRAD_BF16X2 = tl.constexpr(
    "{ .reg .b32 h, t, one, opt, omt, g; mov.b32 one, 0x3F803F80; "
    "mul.rn.bf16x2 h, $2, $4; tanh.approx.bf16x2 t, h; fma.rn.bf16x2 $0, $2, t, $2; "
    "add.rn.bf16x2 opt, one, t; sub.rn.bf16x2 omt, one, t; fma.rn.bf16x2 g, h, omt, one; "
    "mul.rn.bf16x2 g, opt, g; mul.rn.bf16x2 $1, $3, g; }")
# fast_gelu: a = $4, b = $5, 3 b = $6 (as in FAST_GELU_BF16X2).
FAST_GELU_GRAD_BF16X2 = tl.constexpr(
    "{ .reg .b32 sq, u, t, w, one, opt, omt; mov.b32 one, 0x3F803F80; "
    "mul.rn.bf16x2 sq, $2, $2; fma.rn.bf16x2 u, sq, $5, $4; mul.rn.bf16x2 u, $2, u; "
    "tanh.approx.bf16x2 t, u; fma.rn.bf16x2 $0, $2, t, $2; "
    "fma.rn.bf16x2 w, sq, $6, $4; mul.rn.bf16x2 w, $2, w; "
    "add.rn.bf16x2 opt, one, t; sub.rn.bf16x2 omt, one, t; mul.rn.bf16x2 omt, omt, opt; "
    "fma.rn.bf16x2 w, w, omt, opt; mul.rn.bf16x2 $1, $3, w; }")


@triton.jit
def _gdpa_act_and_grad_packed(x, dp, scale, ACTIVATION: tl.constexpr):
    """(p, dp * g) of :func:`_gdpa_act_and_grad` for bf16 scores x and bf16 dP (silu,
    fast_gelu), two at a time in bf16x2 (sm_90). Returns bf16."""
    if ACTIVATION == 1:
        h = tl.full(x.shape, 0.5 * scale, x.dtype)
        return tl.inline_asm_elementwise(SILU_GRAD_BF16X2, "=r,=r,r,r,r", [x, dp, h],
                                         dtype=(x.dtype, x.dtype), is_pure=True, pack=2)
    else:
        a = scale * 0.7978845608028654
        b = a * 0.044715 * scale * scale
        a2 = tl.full(x.shape, a, x.dtype)
        b2 = tl.full(x.shape, b, x.dtype)
        b3 = tl.full(x.shape, 3.0 * b, x.dtype)
        return tl.inline_asm_elementwise(FAST_GELU_GRAD_BF16X2, "=r,=r,r,r,r,r,r",
                                         [x, dp, a2, b2, b3], dtype=(x.dtype, x.dtype),
                                         is_pure=True, pack=2)


@triton.jit
def _gdpa_act_and_grad(x, scale, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """(act(s) / (unit * scale), act'(s) / unit) at s = scale * x, x float32: the dV and dS
    factors of the backward, sharing one tanh (``unit`` as in :func:`_gdpa_act`)."""
    if ACTIVATION == 1:  # silu: act' = sig (1 + s (1 - sig)), sig = (1 + t) / 2, t = tanh(s / 2)
        h = x * (0.5 * scale)
        t = _tanh(h, FAST)
        return x + x * t, (1.0 + t) * (1.0 + h * (1.0 - t))
    elif ACTIVATION == 2:  # gelu: act' = Phi(s) + s phi(s)
        z = x * (scale * 0.7071067811865476)
        e = tl.erf(z)
        return x + x * e, 1.0 + e + (x * (scale * 0.7978845608028654)) * tl.exp(-z * z)
    elif ACTIVATION == 3:  # fast_gelu: act' = 0.5 (1 + t) + 0.5 (1 - t^2) s du/ds
        a = scale * 0.7978845608028654
        b = a * 0.044715 * scale * scale
        x2 = x * x
        t = _tanh(x * (a + b * x2), FAST)
        w = x * (a + (3.0 * b) * x2)  # s du/ds
        one_plus_t = 1.0 + t
        return x + x * t, one_plus_t + w * (1.0 - t) * one_plus_t
    elif ACTIVATION == 4:  # relu
        return tl.maximum(x, 0.0), tl.where(x > 0.0, 1.0, 0.0)
    else:  # identity
        return x, x * 0.0 + 1.0


@triton.jit
def _visible(
    rows, cols, num_rows, num_cols, window, block_size,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
):
    """[len(rows), len(cols)] mask of visible (query row, key col) pairs."""
    i = rows[:, None]
    j = cols[None, :]
    mask = (i < num_rows) & (j < num_cols)
    if CAUSAL:
        mask = mask & (j <= i)
    if HAS_WINDOW:
        mask = mask & (i - j <= window) & (j - i <= window)
    if HAS_BLOCK:
        mask = mask & ((i // block_size) == (j // block_size))
    return mask


@triton.jit
def _key_interval(
    i_first, i_last, num_keys, window, block_size,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
):
    """Keys visible to queries i_first..i_last: [lo_any, hi_any) to some, [lo_all, hi_all) to all."""
    lo_any = num_keys * 0
    lo_all = num_keys * 0
    hi_any = num_keys
    hi_all = num_keys
    if CAUSAL:
        hi_any = tl.minimum(hi_any, i_last + 1)
        hi_all = tl.minimum(hi_all, i_first + 1)
    if HAS_WINDOW:
        lo_any = tl.maximum(lo_any, i_first - window)
        lo_all = tl.maximum(lo_all, i_last - window)
        hi_any = tl.minimum(hi_any, i_last + window + 1)
        hi_all = tl.minimum(hi_all, i_first + window + 1)
    if HAS_BLOCK:
        lo_any = tl.maximum(lo_any, (i_first // block_size) * block_size)
        lo_all = tl.maximum(lo_all, (i_last // block_size) * block_size)
        hi_any = tl.minimum(hi_any, (i_last // block_size + 1) * block_size)
        hi_all = tl.minimum(hi_all, (i_first // block_size + 1) * block_size)
    return lo_any, lo_all, hi_all, hi_any


@triton.jit
def _query_interval(
    j_first, j_last, num_queries, window, block_size,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr,
):
    """Queries that see keys j_first..j_last: [lo_any, hi_any) see some, [lo_all, hi_all) all."""
    lo_any = num_queries * 0
    lo_all = num_queries * 0
    hi_any = num_queries
    hi_all = num_queries
    if CAUSAL:
        lo_any = tl.maximum(lo_any, j_first)
        lo_all = tl.maximum(lo_all, j_last)
    if HAS_WINDOW:
        lo_any = tl.maximum(lo_any, j_first - window)
        lo_all = tl.maximum(lo_all, j_last - window)
        hi_any = tl.minimum(hi_any, j_last + window + 1)
        hi_all = tl.minimum(hi_all, j_first + window + 1)
    if HAS_BLOCK:
        lo_any = tl.maximum(lo_any, (j_first // block_size) * block_size)
        lo_all = tl.maximum(lo_all, (j_last // block_size) * block_size)
        hi_any = tl.minimum(hi_any, (j_last // block_size + 1) * block_size)
        hi_all = tl.minimum(hi_all, (j_first // block_size + 1) * block_size)
    return lo_any, lo_all, hi_all, hi_any


@triton.jit
def _split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK: tl.constexpr):
    """Splits [lo_any, hi_any) into masked [first, full_start), unmasked [full_start, full_end)
    (whole blocks inside [lo_all, hi_all)) and masked [full_end, hi_any)."""
    first = (lo_any // BLOCK) * BLOCK
    full_start = tl.minimum(tl.cdiv(lo_all, BLOCK) * BLOCK, hi_any)
    full_start = tl.maximum(full_start, first)
    num_full = tl.maximum(hi_all - full_start, 0) // BLOCK
    full_end = full_start + num_full * BLOCK
    return first, full_start, full_end, hi_any


@triton.jit
def _program_block(pid, max_len, BLOCK: tl.constexpr, num_heads):
    """(block, rank in ``batch_order``, head) of program ``pid`` of a grid of one program per
    (example in ``batch_order``, head, block of ``BLOCK`` of the ``max_len`` rows)."""
    num_blocks = tl.cdiv(max_len, BLOCK)
    bh = pid // num_blocks
    return pid % num_blocks, bh // num_heads, bh % num_heads


@triton.jit
def _example_rows(q_start, q_end, kv_start, kv_end):
    """(first output row, query rows, first K/V row, keys) of an example from its loaded offsets.
    The kernels load the offsets themselves: a pointer passed to a helper whose result feeds a
    store address counts as written for Inductor, which then clones it (compile_mutations.py)."""
    return (q_start.to(tl.int64), (q_end - q_start).to(tl.int32), kv_start.to(tl.int64),
            (kv_end - kv_start).to(tl.int32))


@triton.jit
def _load_rows(ptrs, rows, num_rows, dmask, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    if MASK_ROWS:
        if EVEN_D:
            return tl.load(ptrs, mask=(rows < num_rows)[:, None], other=0.0)
        return tl.load(ptrs, mask=(rows < num_rows)[:, None] & dmask[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=dmask[None, :], other=0.0)


@triton.jit
def _load_tile(X, stride, start, rows, num_rows, offs_d, dmask,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows ``start + [0, BLOCK)`` of one example's ``[num_rows, D]`` operand: X is a tensor
    descriptor (USE_TMA; zeros past num_rows) or a pointer to its first row (``rows`` =
    ``start + arange(BLOCK)``, masked loads where MASKED)."""
    if USE_TMA:
        tile = X.load([start, 0])
    else:  # (an early return would still compile the pointer code for a descriptor)
        tile = _load_rows(X + rows[:, None] * stride + offs_d[None, :], rows, num_rows, dmask, MASKED, EVEN_D)
    return tile


# ---------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc, m_i, l_i, q, K, V, stride_kt, stride_vt, rows, offs_d, dmask,
    start, end, q_len, kv_len, qk_scale, window, block_size,
    MASK: tl.constexpr, ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, PACKED_ACT: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        k = _load_tile(K, stride_kt, n0, cols, kv_len, offs_d, dmask, MASK != UNMASKED, EVEN_D, USE_TMA)
        v = _load_tile(V, stride_vt, n0, cols, kv_len, offs_d, dmask, MASK != UNMASKED, EVEN_D, USE_TMA)
        x = _dot(q, tl.trans(k), None, DOT_PRECISION)  # [M, N] raw scores
        if ACTIVATION == 0:  # online softmax, log2 domain
            s = x * qk_scale
            if MASK == BOUNDS:
                s = tl.where((cols < kv_len)[None, :], s, float("-inf"))
            elif MASK == VISIBLE:
                vis = _visible(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
                s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            p = _gdpa_p(x, qk_scale, v.dtype, ACTIVATION, PACKED_ACT, DOT_PRECISION)
            if MASK == VISIBLE:
                vis = _visible(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
                p = tl.where(vis, p, 0.0)
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _opaque_copy(x):
    """x, through an instruction the compiler cannot see through (16- or 32-bit elements, packed
    into 32-bit registers)."""
    PACK: tl.constexpr = 32 // x.dtype.primitive_bitwidth
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=True,
                                     pack=PACK)


@triton.jit
def _fwd_gdpa_late_pv(
    acc, q, K, V, stride_kt, stride_vt, offs_d, dmask, kv_len, qk_scale,
    ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PACKED_ACT: tl.constexpr,
):
    """The GDPA forward's loop over all keys (no mask but the sequence end, pointer loads) with
    each tile's ``P V`` issued one step late, after the next tile's ``Q K^T``, so the tensor cores
    run it while the warps compute that tile's activation.

    Triton waits on a product where its result is first used, and only accumulating products
    (``P V``) run asynchronously past the next one; in the plain loop the activation therefore
    never overlaps a product of its own program. The price is one extra step: the first ``P V``
    multiplies zeros, the last ``Q K^T`` reads zero keys. The autotuner chooses between this loop
    and the plain one (``LATE_PV``): on an H200 it is faster for long sequences and slower for
    short ones (docs/kernels.md)."""
    offs_n = tl.arange(0, BLOCK_N)
    p = tl.zeros([acc.shape[0], BLOCK_N], dtype=V.dtype.element_ty)
    for n0 in range(0, kv_len + BLOCK_N, BLOCK_N):
        cols = n0 + offs_n
        k = _load_tile(K, stride_kt, n0, cols, kv_len, offs_d, dmask, True, EVEN_D, False)
        prev = cols - BLOCK_N  # the rows of the tile whose P V runs now
        v_mask = ((prev >= 0) & (prev < kv_len))[:, None]
        if not EVEN_D:
            v_mask = v_mask & dmask[None, :]
        v = tl.load(V + prev[:, None] * stride_vt + offs_d[None, :], mask=v_mask, other=0.0)
        x = _dot(q, tl.trans(k), None, DOT_PRECISION)
        if not _UPCAST_DOTS:
            # An opaque copy inside the loop: Triton would stage the loop-carried operand
            # through shared memory and then wait on the product at once.
            p = _opaque_copy(p)
        acc = _dot(p, v, acc, DOT_PRECISION)
        p = _gdpa_p(x, qk_scale, v.dtype, ACTIVATION, PACKED_ACT, DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["max_q_len", "window", "block_size"])
def _fwd_kernel(
    Q, K, V, O, LSE, q_offsets, kv_offsets, batch_order,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lse_h, num_heads, head_dim, max_q_len, qk_scale, out_scale, window, block_size,
    max_q_bucket, max_kv_bucket,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr, Q_BROADCAST: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, PACKED_ACT: tl.constexpr,
    USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LATE_PV: tl.constexpr,
):
    # Inductor passes Python floats as fp64 scalars: keep the math (and acc) in float32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    out_scale = tl.cast(out_scale, tl.float32)
    m_block, rank, h = _program_block(tl.program_id(0), max_q_len, BLOCK_M, num_heads)
    b = tl.load(batch_order + rank)
    o_start, q_len, kv_start, kv_len = _example_rows(
        tl.load(q_offsets + b), tl.load(q_offsets + b + 1), tl.load(kv_offsets + b), tl.load(kv_offsets + b + 1))
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    q_start = o_start
    if Q_BROADCAST:
        q_start = o_start * 0

    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    Q += q_start * stride_qt + h * stride_qh
    K += kv_start * stride_kt + h * stride_kh
    V += kv_start * stride_vt + h * stride_vh
    q = _load_rows(Q + rows[:, None] * stride_qt + offs_d[None, :], rows, q_len, dmask, True, EVEN_D)
    if USE_TMA:
        K = tl.make_tensor_descriptor(K, shape=[kv_len, head_dim], strides=[stride_kt, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, shape=[kv_len, head_dim], strides=[stride_vt, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if CAUSAL or HAS_WINDOW or HAS_BLOCK:
        i_last = tl.minimum(m0 + BLOCK_M, q_len) - 1
        lo_any, lo_all, hi_all, hi_any = _key_interval(
            m0, i_last, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
        first, full_start, full_end, last = _split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK_N)
        acc, m_i, l_i = _fwd_inner(
            acc, m_i, l_i, q, K, V, stride_kt, stride_vt, rows, offs_d, dmask, first, full_start,
            q_len, kv_len, qk_scale, window, block_size, VISIBLE, ACTIVATION, CAUSAL, HAS_WINDOW,
            HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION, PACKED_ACT, USE_TMA)
        acc, m_i, l_i = _fwd_inner(
            acc, m_i, l_i, q, K, V, stride_kt, stride_vt, rows, offs_d, dmask, full_start, full_end,
            q_len, kv_len, qk_scale, window, block_size, UNMASKED, ACTIVATION, CAUSAL, HAS_WINDOW,
            HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION, PACKED_ACT, USE_TMA)
        acc, m_i, l_i = _fwd_inner(
            acc, m_i, l_i, q, K, V, stride_kt, stride_vt, rows, offs_d, dmask, full_end, last,
            q_len, kv_len, qk_scale, window, block_size, VISIBLE, ACTIVATION, CAUSAL, HAS_WINDOW,
            HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION, PACKED_ACT, USE_TMA)
    elif LATE_PV and ACTIVATION != 0 and not USE_TMA:
        acc = _fwd_gdpa_late_pv(acc, q, K, V, stride_kt, stride_vt, offs_d, dmask, kv_len, qk_scale,
                                ACTIVATION, BLOCK_N, EVEN_D, DOT_PRECISION, PACKED_ACT)
    else:
        acc, m_i, l_i = _fwd_inner(
            acc, m_i, l_i, q, K, V, stride_kt, stride_vt, rows, offs_d, dmask, 0, kv_len,
            q_len, kv_len, qk_scale, window, block_size, BOUNDS, ACTIVATION, CAUSAL, HAS_WINDOW,
            HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION, PACKED_ACT, USE_TMA)

    row_mask = rows < q_len
    if ACTIVATION == 0:
        seen = l_i > 0.0
        acc = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
        tl.store(LSE + h * stride_lse_h + o_start + rows, lse, mask=row_mask)
    else:
        acc = acc * out_scale
    O += o_start * stride_ot + h * stride_oh
    o_ptrs = O + rows[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_mask[:, None] & dmask[None, :])


# ---------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA, num_rows, stride_ot, stride_oh, stride_dot, stride_doh, stride_delta_h,
    head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] (softmax only)."""
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (offs_d < head_dim)[None, :]
    rows64 = rows.to(tl.int64)
    o = tl.load(O + rows64[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows64[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + h * stride_delta_h + rows, delta, mask=rows < num_rows)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, Q, DO, LSE, DELTA, DS, stride_qt, stride_dot, stride_dst, cols, offs_d, dmask,
    start, end, q_len, kv_len, qk_scale, window, block_size,
    MASK: tl.constexpr, ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, PACKED_ACT: tl.constexpr,
    USE_TMA: tl.constexpr, STORE_DS: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + offs_m
        q = _load_tile(Q, stride_qt, m0, rows, q_len, offs_d, dmask, MASK != UNMASKED, EVEN_D, USE_TMA)
        do = _load_tile(DO, stride_dot, m0, rows, q_len, offs_d, dmask, MASK != UNMASKED, EVEN_D, USE_TMA)
        x_t = _dot(k, tl.trans(q), None, DOT_PRECISION)  # [N, M] raw scores
        dp_t = _dot(v, tl.trans(do), None, DOT_PRECISION)  # [N, M]
        if ACTIVATION == 0:
            s_t = x_t * qk_scale
            if MASK != UNMASKED:  # (rows past the end: p = 0)
                lse = tl.load(LSE + rows, mask=rows < q_len, other=float("inf"))
                delta = tl.load(DELTA + rows, mask=rows < q_len, other=0.0)
            else:
                lse = tl.load(LSE + rows)
                delta = tl.load(DELTA + rows)
            p_t = tl.math.exp2(s_t - lse[None, :])
            if MASK == VISIBLE:
                vis = _visible(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
                p_t = tl.where(tl.trans(vis), p_t, 0.0)
            ds_t = p_t * (dp_t - delta[None, :])
        else:
            if PACKED_ACT:
                p_t, ds_t = _gdpa_act_and_grad_packed(x_t.to(do.dtype), dp_t.to(do.dtype), qk_scale, ACTIVATION)
            else:
                p_t, g_t = _gdpa_act_and_grad(x_t, qk_scale, ACTIVATION, DOT_PRECISION != "ieee")
                ds_t = dp_t * g_t
            if MASK == VISIBLE:
                vis_t = tl.trans(_visible(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK))
                p_t = tl.where(vis_t, p_t, 0.0)
                ds_t = tl.where(vis_t, ds_t, 0.0)
        ds_t = ds_t.to(q.dtype)
        if STORE_DS:  # [keys, queries] of this example and head (see _bwd_dq_from_ds_kernel);
            # rows past q_len hold zeros (no row mask, so the stores vectorize)
            tl.store(DS + cols.to(tl.int64)[:, None] * stride_dst + rows[None, :], ds_t,
                     mask=(cols < kv_len)[:, None])
        dv = _dot(p_t.to(do.dtype), do, dv, DOT_PRECISION)
        dk = _dot(ds_t, q, dk, DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["max_kv_len", "window", "block_size"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DS, q_offsets, kv_offsets, batch_order,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse_h, stride_dsh, stride_dst,
    num_heads, head_dim, max_kv_len, qk_scale, dk_scale, dv_scale, window, block_size,
    max_q_bucket, max_kv_bucket,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr, Q_BROADCAST: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, PACKED_ACT: tl.constexpr,
    USE_TMA: tl.constexpr, STORE_DS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 under Inductor, as in _fwd_kernel
    dk_scale = tl.cast(dk_scale, tl.float32)
    dv_scale = tl.cast(dv_scale, tl.float32)
    n_block, rank, h = _program_block(tl.program_id(0), max_kv_len, BLOCK_N, num_heads)
    b = tl.load(batch_order + rank)
    o_start, q_len, kv_start, kv_len = _example_rows(
        tl.load(q_offsets + b), tl.load(q_offsets + b + 1), tl.load(kv_offsets + b), tl.load(kv_offsets + b + 1))
    n0 = n_block * BLOCK_N
    if n0 >= kv_len:
        return
    q_start = o_start
    if Q_BROADCAST:
        q_start = o_start * 0

    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    K += kv_start * stride_kt + h * stride_kh
    V += kv_start * stride_vt + h * stride_vh
    k = _load_rows(K + cols[:, None] * stride_kt + offs_d[None, :], cols, kv_len, dmask, True, EVEN_D)
    v = _load_rows(V + cols[:, None] * stride_vt + offs_d[None, :], cols, kv_len, dmask, True, EVEN_D)
    Q += q_start * stride_qt + h * stride_qh
    DO += o_start * stride_dot + h * stride_doh
    LSE += h * stride_lse_h + o_start
    DELTA += h * stride_lse_h + o_start
    DS += h.to(tl.int64) * stride_dsh + kv_start * stride_dst
    if USE_TMA:
        Q = tl.make_tensor_descriptor(Q, shape=[q_len, head_dim], strides=[stride_qt, 1],
                                      block_shape=[BLOCK_M, BLOCK_D])
        DO = tl.make_tensor_descriptor(DO, shape=[q_len, head_dim], strides=[stride_dot, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if CAUSAL or HAS_WINDOW or HAS_BLOCK:
        j_last = tl.minimum(n0 + BLOCK_N, kv_len) - 1
        lo_any, lo_all, hi_all, hi_any = _query_interval(
            n0, j_last, q_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
        first, full_start, full_end, last = _split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK_M)
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, Q, DO, LSE, DELTA, DS, stride_qt, stride_dot, stride_dst, cols, offs_d,
            dmask, first, full_start, q_len, kv_len, qk_scale, window, block_size, VISIBLE,
            ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, BLOCK_M, EVEN_D, DOT_PRECISION, PACKED_ACT,
            USE_TMA, False)
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, Q, DO, LSE, DELTA, DS, stride_qt, stride_dot, stride_dst, cols, offs_d,
            dmask, full_start, full_end, q_len, kv_len, qk_scale, window, block_size, UNMASKED,
            ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, BLOCK_M, EVEN_D, DOT_PRECISION, PACKED_ACT,
            USE_TMA, False)
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, Q, DO, LSE, DELTA, DS, stride_qt, stride_dot, stride_dst, cols, offs_d,
            dmask, full_end, last, q_len, kv_len, qk_scale, window, block_size, VISIBLE,
            ACTIVATION, CAUSAL, HAS_WINDOW, HAS_BLOCK, BLOCK_M, EVEN_D, DOT_PRECISION, PACKED_ACT,
            USE_TMA, False)
    else:  # dS is stored on this path only (STORE_DS)
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, Q, DO, LSE, DELTA, DS, stride_qt, stride_dot, stride_dst, cols, offs_d,
            dmask, 0, q_len, q_len, kv_len, qk_scale, window, block_size, BOUNDS, ACTIVATION,
            CAUSAL, HAS_WINDOW, HAS_BLOCK, BLOCK_M, EVEN_D, DOT_PRECISION, PACKED_ACT, USE_TMA,
            STORE_DS)

    col_mask = (cols < kv_len)[:, None] & dmask[None, :]
    DK += kv_start * stride_dkt + h * stride_dkh
    DV += kv_start * stride_dvt + h * stride_dvh
    tl.store(DK + cols[:, None] * stride_dkt + offs_d[None, :], (dk * dk_scale).to(DK.dtype.element_ty), mask=col_mask)
    tl.store(DV + cols[:, None] * stride_dvt + offs_d[None, :], (dv * dv_scale).to(DV.dtype.element_ty), mask=col_mask)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse, delta, K, V, stride_kt, stride_vt, rows, offs_d, dmask,
    start, end, q_len, kv_len, qk_scale, window, block_size,
    MASK: tl.constexpr, ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, PACKED_ACT: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        k = _load_tile(K, stride_kt, n0, cols, kv_len, offs_d, dmask, MASK != UNMASKED, EVEN_D, USE_TMA)
        v = _load_tile(V, stride_vt, n0, cols, kv_len, offs_d, dmask, MASK != UNMASKED, EVEN_D, USE_TMA)
        x = _dot(q, tl.trans(k), None, DOT_PRECISION)  # [M, N] raw scores
        dp = _dot(do, tl.trans(v), None, DOT_PRECISION)  # [M, N]
        if ACTIVATION == 0:
            p = tl.math.exp2(x * qk_scale - lse[:, None])
            if MASK == BOUNDS:  # a key past the end scores 0: exp2(-lse) overflows for lse < -128
                p = tl.where((cols < kv_len)[None, :], p, 0.0)
            ds = p * (dp - delta[:, None])
        else:
            if PACKED_ACT:
                ds = _gdpa_act_and_grad_packed(x.to(k.dtype), dp.to(k.dtype), qk_scale, ACTIVATION)[1]
            else:
                ds = dp * _gdpa_act_and_grad(x, qk_scale, ACTIVATION, DOT_PRECISION != "ieee")[1]
        if MASK == VISIBLE:  # (keys past the end: k = 0, so a finite ds there adds nothing)
            vis = _visible(rows, cols, q_len, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
            ds = tl.where(vis, ds, 0.0)
        dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["max_q_len", "window", "block_size"])
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, q_offsets, kv_offsets, batch_order,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lse_h,
    num_heads, head_dim, max_q_len, qk_scale, dq_scale, window, block_size,
    max_q_bucket, max_kv_bucket,
    ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr, Q_BROADCAST: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, PACKED_ACT: tl.constexpr,
    USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 under Inductor, as in _fwd_kernel
    dq_scale = tl.cast(dq_scale, tl.float32)
    m_block, rank, h = _program_block(tl.program_id(0), max_q_len, BLOCK_M, num_heads)
    b = tl.load(batch_order + rank)
    o_start, q_len, kv_start, kv_len = _example_rows(
        tl.load(q_offsets + b), tl.load(q_offsets + b + 1), tl.load(kv_offsets + b), tl.load(kv_offsets + b + 1))
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    q_start = o_start
    if Q_BROADCAST:
        q_start = o_start * 0

    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    row_mask = rows < q_len
    Q += q_start * stride_qt + h * stride_qh
    DO += o_start * stride_dot + h * stride_doh
    K += kv_start * stride_kt + h * stride_kh
    V += kv_start * stride_vt + h * stride_vh
    q = _load_rows(Q + rows[:, None] * stride_qt + offs_d[None, :], rows, q_len, dmask, True, EVEN_D)
    do = _load_rows(DO + rows[:, None] * stride_dot + offs_d[None, :], rows, q_len, dmask, True, EVEN_D)
    if USE_TMA:
        K = tl.make_tensor_descriptor(K, shape=[kv_len, head_dim], strides=[stride_kt, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, shape=[kv_len, head_dim], strides=[stride_vt, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
    if ACTIVATION == 0:
        lse = tl.load(LSE + h * stride_lse_h + o_start + rows, mask=row_mask, other=float("inf"))
        delta = tl.load(DELTA + h * stride_lse_h + o_start + rows, mask=row_mask, other=0.0)
    else:
        lse = tl.zeros([BLOCK_M], dtype=tl.float32)
        delta = lse

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL or HAS_WINDOW or HAS_BLOCK:
        i_last = tl.minimum(m0 + BLOCK_M, q_len) - 1
        lo_any, lo_all, hi_all, hi_any = _key_interval(
            m0, i_last, kv_len, window, block_size, CAUSAL, HAS_WINDOW, HAS_BLOCK)
        first, full_start, full_end, last = _split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK_N)
        dq = _bwd_dq_inner(
            dq, q, do, lse, delta, K, V, stride_kt, stride_vt, rows, offs_d, dmask, first,
            full_start, q_len, kv_len, qk_scale, window, block_size, VISIBLE, ACTIVATION, CAUSAL,
            HAS_WINDOW, HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION, PACKED_ACT, USE_TMA)
        dq = _bwd_dq_inner(
            dq, q, do, lse, delta, K, V, stride_kt, stride_vt, rows, offs_d, dmask, full_start,
            full_end, q_len, kv_len, qk_scale, window, block_size, UNMASKED, ACTIVATION, CAUSAL,
            HAS_WINDOW, HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION, PACKED_ACT, USE_TMA)
        dq = _bwd_dq_inner(
            dq, q, do, lse, delta, K, V, stride_kt, stride_vt, rows, offs_d, dmask, full_end,
            last, q_len, kv_len, qk_scale, window, block_size, VISIBLE, ACTIVATION, CAUSAL,
            HAS_WINDOW, HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION, PACKED_ACT, USE_TMA)
    else:
        dq = _bwd_dq_inner(
            dq, q, do, lse, delta, K, V, stride_kt, stride_vt, rows, offs_d, dmask, 0,
            kv_len, q_len, kv_len, qk_scale, window, block_size, BOUNDS, ACTIVATION, CAUSAL,
            HAS_WINDOW, HAS_BLOCK, BLOCK_N, EVEN_D, DOT_PRECISION, PACKED_ACT, USE_TMA)

    DQ += o_start * stride_dqt + h * stride_dqh
    dq_ptrs = DQ + rows[:, None] * stride_dqt + offs_d[None, :]
    tl.store(dq_ptrs, (dq * dq_scale).to(DQ.dtype.element_ty), mask=row_mask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["max_q_len"])
def _bwd_dq_from_ds_kernel(
    DS, K, DQ, q_offsets, kv_offsets, batch_order,
    stride_dsh, stride_dst, stride_kt, stride_kh, stride_dqt, stride_dqh,
    num_heads, head_dim, max_q_len, dq_scale, max_q_bucket, max_kv_bucket,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ = dS K (STORE_DS): one program per (example, head, query block), as _bwd_dq_kernel,
    but reading the dS that _bwd_dkdv_kernel stored (``DS[h, kv row, query]``: a key's row of
    its example's queries) instead of recomputing S and dP. Keys past the example's end are
    masked; queries are not (so the loads vectorize): the rows are padded to a multiple of
    every BLOCK_M, and a query past the end only reaches its own dQ row, which is not stored."""
    dq_scale = tl.cast(dq_scale, tl.float32)  # fp64 under Inductor, as in _fwd_kernel
    m_block, rank, h = _program_block(tl.program_id(0), max_q_len, BLOCK_M, num_heads)
    b = tl.load(batch_order + rank)
    o_start, q_len, kv_start, kv_len = _example_rows(
        tl.load(q_offsets + b), tl.load(q_offsets + b + 1), tl.load(kv_offsets + b), tl.load(kv_offsets + b + 1))
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return

    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    row_mask = rows < q_len
    DS += h.to(tl.int64) * stride_dsh + kv_start * stride_dst
    K += kv_start * stride_kt + h * stride_kh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, kv_len, BLOCK_N):
        cols = n0 + offs_n
        ds_t = tl.load(DS + cols.to(tl.int64)[:, None] * stride_dst + rows[None, :],
                       mask=(cols < kv_len)[:, None], other=0.0)
        k = _load_rows(K + cols[:, None] * stride_kt + offs_d[None, :], cols, kv_len, dmask,
                       True, EVEN_D)
        dq = _dot(tl.trans(ds_t), k, dq, DOT_PRECISION)

    DQ += o_start * stride_dqt + h * stride_dqh
    dq_ptrs = DQ + rows[:, None] * stride_dqt + offs_d[None, :]
    tl.store(dq_ptrs, (dq * dq_scale).to(DQ.dtype.element_ty), mask=row_mask[:, None] & dmask[None, :])


@triton.jit
def _work(q_start, q_end, kv_start, kv_end):
    """Query rows x keys of an example (int64), from its offsets. It takes loaded values, not
    pointers: Inductor counts a pointer passed to a helper whose result feeds a store address as
    written, and clones it (tests/kernels/compile_mutations.py)."""
    return (q_end - q_start).to(tl.int64) * (kv_end - kv_start).to(tl.int64)


@triton.jit
def _batch_order_kernel(q_offsets, kv_offsets, ORDER, num_batches,
                        BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """``ORDER[rank] = example``, most work (query rows x keys) first, ties in index order:
    the stable descending argsort, by counting for each example the examples ranked before it
    (quadratic, so only for batches up to ``COUNTING_ORDER_MAX_BATCHES``)."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    mine = i < num_batches
    work_i = _work(tl.load(q_offsets + i, mask=mine, other=0), tl.load(q_offsets + i + 1, mask=mine, other=0),
                   tl.load(kv_offsets + i, mask=mine, other=0), tl.load(kv_offsets + i + 1, mask=mine, other=0))
    rank = tl.zeros([BLOCK_I], dtype=tl.int32)
    for j0 in range(0, num_batches, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        theirs = j < num_batches
        work_j = _work(tl.load(q_offsets + j, mask=theirs, other=0), tl.load(q_offsets + j + 1, mask=theirs, other=0),
                       tl.load(kv_offsets + j, mask=theirs, other=0), tl.load(kv_offsets + j + 1, mask=theirs, other=0))
        work_j = tl.where(theirs, work_j, -1)  # never first
        before = ((work_j[None, :] > work_i[:, None])
                  | ((work_j[None, :] == work_i[:, None]) & (j[None, :] < i[:, None])))
        rank += tl.sum(before.to(tl.int32), 1)
    tl.store(ORDER + rank, i, mask=mine)


# ---------------------------------------------------------------------------------------
# launch configurations
# ---------------------------------------------------------------------------------------


def _default_config(kind: str, block_d: int, elem_bytes: int = 2) -> dict:
    """Block sizes, warps and stages per kernel kind and padded head dim (and the forward's
    plain loop, ``LATE_PV=0``), used when autotuning is off (GEM_KERNELS_AUTOTUNE=0) and for head
    dims above 128."""
    config = _default_tiles(kind, block_d, elem_bytes)
    return config | dict(LATE_PV=0) if kind == "fwd" else config


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
# up to 1024 and 2048 keys, slower on those of 256 and up to 512 (docs/kernels.md); the
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
    "fwd": [(128, 64, 8, 2), (128, 128, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 3),
            (64, 64, 4, 4)],
    "dkdv": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2)],
    "dq": [(128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 4, 2)],
    "dq_ds": [(128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 2), (64, 32, 4, 3)],
}
TUNE_SPACE = _env_choice("GEM_KERNELS_TUNE_SPACE", "default", ("default", "wide"))
if TUNE_SPACE == "wide":
    _TUNE_SPACE = {kind: space + _WIDE_EXTRA[kind] for kind, space in _TUNE_SPACE.items()}
# (keys a kernel lacks are skipped)
_TUNE_KEY = ["max_q_bucket", "max_kv_bucket", "BLOCK_D", "ACTIVATION", "CAUSAL", "HAS_WINDOW",
             "HAS_BLOCK", "Q_BROADCAST", "PACKED_ACT", "USE_TMA", "STORE_DS"]


def _tuned(kernel, kind: str):
    """The kernel under triton.autotune; head dims above 128 and the fp32 backward get their one
    default config."""
    if INTERPRET:
        return kernel
    configs = []
    for m, n, w, s, *late in _TUNE_SPACE[kind]:
        tiles = dict(BLOCK_M=m, BLOCK_N=n)
        if kind == "fwd":
            tiles["LATE_PV"] = late[0] if late else 0
        configs.append(triton.Config(tiles, num_warps=w, num_stages=s))

    def prune(configs, named_args, **kwargs):
        args = named_args | kwargs
        block_d = args.get("BLOCK_D", 128)
        q = args.get("Q", args.get("K"))
        elem_bytes = q.element_size() if hasattr(q, "element_size") else 2
        if kind == "fwd" and not _late_pv_applies(args):
            configs = [config for config in configs if not config.kwargs["LATE_PV"]]
        if block_d <= 128 and (elem_bytes < 4 or kind == "fwd"):
            return configs
        # Head dims above 128, and the fp32 backward (whose 16-bit candidates overflow shared memory
        # at head dim 128), launch their one default config.
        launch = dict(_default_config(kind, block_d, elem_bytes))
        warps, stages = launch.pop("num_warps"), launch.pop("num_stages")
        return [triton.Config(launch, num_warps=warps, num_stages=stages)]

    return triton.autotune(configs=configs, key=_TUNE_KEY,
                           prune_configs_by={"early_config_prune": prune})(kernel)


def _late_pv_applies(meta: dict) -> bool:
    """Whether _fwd_kernel runs its LATE_PV loop: GDPA without a causal, window or block mask,
    pointer loads."""
    return (meta["ACTIVATION"] != SOFTMAX and not meta["USE_TMA"]
            and not (meta["CAUSAL"] or meta["HAS_WINDOW"] or meta["HAS_BLOCK"]))


_KERNELS = {
    "fwd": (_fwd_kernel, _tuned(_fwd_kernel, "fwd")),
    "dkdv": (_bwd_dkdv_kernel, _tuned(_bwd_dkdv_kernel, "dkdv")),
    "dq": (_bwd_dq_kernel, _tuned(_bwd_dq_kernel, "dq")),
    "dq_ds": (_bwd_dq_from_ds_kernel, _tuned(_bwd_dq_from_ds_kernel, "dq_ds")),
}


def _kernel_and_config(kind: str, block_d: int, elem_bytes: int = 2):
    """(kernel, launch kwargs): the autotuned kernel, or the plain one with its default."""
    plain, tuned = _KERNELS[kind]
    if autotune_enabled():
        return tuned, {}
    return plain, _default_config(kind, block_d, elem_bytes)


def _bucket(n: int) -> int:
    """Autotune key bucket: the next power of two (a new batch never retunes)."""
    return triton.next_power_of_2(max(int(n), 16))


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


class _NoLaunch:
    """Stands in for a kernel when only output shapes are wanted (fake / meta tensors)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def no_launch(kernel) -> _NoLaunch:
    """A ``wrap`` for the launchers that allocates outputs but launches nothing."""
    return _NoLaunch()


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _common_meta(q, activation, causal, window, block_size, q_broadcast):
    head_dim = q.shape[-1]
    block_d = max(triton.next_power_of_2(head_dim), 16)
    return dict(
        ACTIVATION=ACTIVATION_CODES[activation], CAUSAL=bool(causal), HAS_WINDOW=window >= 0,
        HAS_BLOCK=block_size > 0, Q_BROADCAST=bool(q_broadcast), BLOCK_D=block_d,
        EVEN_D=block_d == head_dim, DOT_PRECISION=_dot_precision(q.dtype),
        PACKED_ACT=_packed_act(q, activation),
    )


def _packed_act(q: torch.Tensor, activation: str) -> bool:
    """Whether the kernels take the bf16x2 activation path: GEM_KERNELS_PACKED_ACT, bf16 silu or
    fast_gelu, on a GPU with the sm_90 bf16x2 instructions (Hopper or newer)."""
    return (PACKED_ACT and q.dtype == torch.bfloat16 and activation in ("silu", "fast_gelu")
            and q.is_cuda and _capability(q.device.index)[0] >= 9)


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _use_tma(*tensors: torch.Tensor) -> bool:
    """GEM_KERNELS_TMA and ``[T, H, D]`` tensors whose streamed rows a tensor descriptor can
    address (16-byte aligned base, row and head strides, so every example's first row is aligned
    too), on an sm_90+ GPU or in the interpreter. A traced call (torch.compile: fake tensors, no
    address) keeps pointer loads."""
    first = tensors[0]
    if not USE_TMA or not (INTERPRET or (first.is_cuda and _capability(first.device.index)[0] >= 9)):
        return False
    if any(is_fake(t) for t in tensors):
        return False
    size = first.element_size()
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * size % 16 == 0
               and t.stride(1) * size % 16 == 0 for t in tensors)


def _descriptor_scratch(size: int, alignment: int, stream, device: torch.device) -> torch.Tensor:
    """Global memory for the tensor descriptors the kernels build (``triton.set_allocator``)."""
    return torch.empty(size, dtype=torch.int8, device=device)


# Up to this many examples the order comes from _batch_order_kernel, above it from
# torch.argsort. On an H200 the kernel took 10 us at 1,152 examples and 45 us at 8,192, where
# computing the work and argsorting it took 98 and 164 us (do_bench, launches included).
COUNTING_ORDER_MAX_BATCHES = 8192


def batch_order(q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
                wrap=lambda kernel: kernel) -> torch.Tensor:
    """``[B]`` int32: the examples by work (query rows x keys), most first, ties in index
    order, i.e. ``argsort(work, descending=True, stable=True)``; the order in which the
    kernels' programs take them."""
    num_batches = kv_offsets.numel() - 1
    if num_batches > COUNTING_ORDER_MAX_BATCHES:
        work = (q_offsets[1:] - q_offsets[:-1]).long() * (kv_offsets[1:] - kv_offsets[:-1]).long()
        return torch.argsort(work, descending=True, stable=True).to(torch.int32)
    order = torch.empty(num_batches, dtype=torch.int32, device=q_offsets.device)
    if num_batches > 0:
        wrap(_batch_order_kernel)[(triton.cdiv(num_batches, 32),)](
            q_offsets, kv_offsets, order, num_batches, BLOCK_I=32, BLOCK_J=512)
    return order


def jagged_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor, batch_order: torch.Tensor, max_q_len: int, max_kv_len: int,
    activation: str, scale: float, post_scale: float, causal: bool, window: int,
    block_size: int, q_broadcast: bool, wrap=lambda kernel: kernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward kernel.

    Args:
        q: ``[Tq, H, D]`` (or ``[N, H, D]`` when ``q_broadcast``), last dim contiguous.
        k, v: ``[Tkv, H, D]``, last dim contiguous.
        q_offsets: ``[B+1]`` output row offsets (``arange(B+1) * N`` when ``q_broadcast``).
        kv_offsets: ``[B+1]``.
        batch_order: ``[B]`` int32, examples in the order programs take them (longest first).
        window / block_size: ``-1`` / ``0`` when unused.
        wrap: ``torch.library.wrap_triton`` inside a triton_op, identity otherwise.

    Returns:
        out ``[To, H, D]`` in ``q.dtype`` and, for softmax, lse ``[H, To]`` float32 in log2
        units (``+inf`` for a query that sees no key); a 1-element placeholder otherwise.
    """
    num_batches = kv_offsets.numel() - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_rows = num_batches * q.shape[0] if q_broadcast else q.shape[0]
    out = q.new_empty(num_rows, num_heads, head_dim)
    softmax = activation == "softmax"
    lse = q.new_empty((num_heads, num_rows) if softmax else (1,), dtype=torch.float32)
    meta = _common_meta(q, activation, causal, window, block_size, q_broadcast)
    kernel, launch = _kernel_and_config("fwd", meta["BLOCK_D"])
    qk_scale = scale * LOG2E if softmax else scale
    out_scale = 1.0 if softmax else post_scale * ACT_UNIT[activation] * scale
    meta["USE_TMA"] = _use_tma(k, v)
    if meta["USE_TMA"]:
        triton.set_allocator(functools.partial(_descriptor_scratch, device=q.device))

    if num_rows == 0 or num_heads == 0 or max_q_len == 0 or num_batches == 0:
        return out.zero_(), lse.fill_(float("inf"))
    if USE_GLUON and not INTERPRET and not softmax:
        from kernels.jagged_attention import gluon

        if (gluon.applies(q, k, v, activation, causal, window, block_size, q_broadcast)
                and max_q_len > GLUON_MIN_Q_LEN):
            gluon.forward(q, k, v, out, q_offsets, kv_offsets, batch_order, max_q_len,
                          meta["ACTIVATION"], scale, out_scale, meta["PACKED_ACT"])
            return out, lse

    def grid(cfg):
        return (triton.cdiv(max_q_len, cfg["BLOCK_M"]) * num_batches * num_heads,)

    wrap(kernel)[grid](
        q, k, v, out, lse, q_offsets, kv_offsets, batch_order,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), num_rows, num_heads, head_dim, max_q_len,
        qk_scale, out_scale, window, block_size, _bucket(max_q_len), _bucket(max_kv_len),
        **meta, **launch,
    )
    return out, lse


def _store_ds_row(max_q_len: int) -> int:
    """Elements per row of the STORE_DS buffer: ``max_q_len`` rounded up to a multiple of 128,
    which every BLOCK_M divides, so that whole query blocks fit (see _bwd_dq_from_ds_kernel)."""
    return triton.cdiv(max(int(max_q_len), 1), 128) * 128


def _store_ds_bytes(q, k, max_q_len, causal, window, block_size, q_broadcast) -> int:
    """Bytes of the STORE_DS buffer, or 0 where the stored-dS backward does not apply (a causal,
    window or block mask, whose dK/dV kernel skips tiles; a broadcast Q)."""
    if causal or window >= 0 or block_size > 0 or q_broadcast:
        return 0
    return q.shape[1] * k.shape[0] * _store_ds_row(max_q_len) * q.element_size()


def _store_ds_buffer(q, k, max_q_len) -> torch.Tensor | None:
    """The STORE_DS buffer, or None (the backward then recomputes dQ) where the device has no room
    for it even under the cap: the caching allocator has already freed what it could."""
    shape = (q.shape[1], k.shape[0], _store_ds_row(max_q_len))
    try:
        return q.new_empty(shape)
    except torch.OutOfMemoryError:
        mib = q.shape[1] * k.shape[0] * shape[2] * q.element_size() >> 20
        warnings.warn(
            f"jagged attention backward: no memory for the stored-dS buffer ({mib} MiB); dQ is "
            f"recomputed instead. Set GEM_KERNELS_STORE_DS_MAX_MIB below {mib} to skip the "
            "attempt, or GEM_KERNELS_STORE_DS=0.", stacklevel=2)
        return None


def _gluon_dkdv(q, k, v, grad_out, activation, causal, window, block_size, q_broadcast, store_ds,
                packed) -> bool:
    """Whether gluon.py's dK/dV kernel runs the backward's dK/dV (and stores dS): with
    GEM_KERNELS_GLUON_BWD on, the stored-dS backward in bf16 silu / fast_gelu (the bf16x2 path),
    where gluon.applies holds for q, k, v and dO's rows can be addressed as q's."""
    if not (USE_GLUON_BWD and store_ds and packed) or INTERPRET:
        return False
    from kernels.jagged_attention import gluon

    return (gluon.applies(q, k, v, activation, causal, window, block_size, q_broadcast)
            and gluon._addressable(grad_out))


def jagged_attention_bwd(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
    batch_order: torch.Tensor, max_q_len: int, max_kv_len: int, activation: str, scale: float,
    post_scale: float, causal: bool, window: int, block_size: int, q_broadcast: bool,
    wrap=lambda kernel: kernel,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launches the backward kernels; arguments as in :func:`jagged_attention_fwd`.

    ``grad_out`` is ``[To, H, D]`` like ``out``. Returns ``dq, dk, dv`` shaped like
    ``q, k, v``. dK/dV come from one program per (example, head, key block) that streams
    the query blocks seeing it; dQ from one program per query block that streams the key
    blocks (no atomics, so the result is deterministic), recomputing S and dP, or, with
    ``STORE_DS`` where it applies (:func:`_store_ds_bytes`), reading the dS that the dK/dV
    kernel stored. With ``q_broadcast``, dQ is computed per example in float32 and summed over
    the batch.
    """
    num_batches = kv_offsets.numel() - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_rows = out.shape[0]
    softmax = activation == "softmax"
    meta = _common_meta(q, activation, causal, window, block_size, q_broadcast)
    # Every row of an example is written by the kernels (an empty example has no rows).
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if q_broadcast:
        dq_rows = q.new_empty(num_rows, num_heads, head_dim, dtype=torch.float32)
    else:
        dq_rows = torch.empty_like(q)
    if num_rows == 0 or num_heads == 0 or num_batches == 0 or max_q_len == 0 or max_kv_len == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    meta["USE_TMA"] = _use_tma(q, k, v, grad_out)
    if meta["USE_TMA"]:
        triton.set_allocator(functools.partial(_descriptor_scratch, device=q.device))

    if softmax:
        delta = torch.empty_like(lse)  # [H, To]
        block_t = 64
        wrap(_bwd_preprocess_kernel)[(triton.cdiv(num_rows, block_t), num_heads)](
            out, grad_out, delta, num_rows, out.stride(0), out.stride(1), grad_out.stride(0),
            grad_out.stride(1), delta.stride(0), head_dim, BLOCK_T=block_t,
            BLOCK_D=meta["BLOCK_D"],
        )
        qk_scale, grad_scale, dv_scale = scale * LOG2E, scale, 1.0
        lse_stride = lse.stride(0)
    else:
        delta = lse
        # The kernels' activation factors leave out unit * scale (value) and unit (gradient).
        unit = ACT_UNIT[activation]
        qk_scale, grad_scale, dv_scale = scale, scale * post_scale * unit, post_scale * unit * scale
        lse_stride = 0

    def grid_dkdv(cfg):
        return (triton.cdiv(max_kv_len, cfg["BLOCK_N"]) * num_batches * num_heads,)

    store_ds = STORE_DS and 0 < _store_ds_bytes(q, k, max_q_len, causal, window, block_size,
                                                q_broadcast) <= STORE_DS_MAX_BYTES
    # dS[h, kv row, query of its example], rows padded (dk stands in, unused, without a buffer)
    ds = _store_ds_buffer(q, k, max_q_len) if store_ds else None
    store_ds = ds is not None
    if ds is None:
        ds = dk
    if _gluon_dkdv(q, k, v, grad_out, activation, causal, window, block_size, q_broadcast,
                   store_ds, meta["PACKED_ACT"]):
        from kernels.jagged_attention import gluon

        gluon.dkdv(q, k, v, grad_out, dk, dv, ds, q_offsets, kv_offsets, batch_order, max_kv_len,
                   meta["ACTIVATION"], qk_scale, grad_scale, dv_scale)
    else:
        kernel, launch = _kernel_and_config("dkdv", meta["BLOCK_D"], q.element_size())
        wrap(kernel)[grid_dkdv](
            q, k, v, grad_out, lse, delta, dk, dv, ds, q_offsets, kv_offsets, batch_order,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
            dv.stride(1), lse_stride, ds.stride(0), ds.stride(1), num_heads, head_dim, max_kv_len,
            qk_scale, grad_scale, dv_scale, window, block_size, _bucket(max_q_len),
            _bucket(max_kv_len), **meta, STORE_DS=store_ds, **launch,
        )

    def grid_dq(cfg):
        return (triton.cdiv(max_q_len, cfg["BLOCK_M"]) * num_batches * num_heads,)

    if store_ds:
        kernel, launch = _kernel_and_config("dq_ds", meta["BLOCK_D"], q.element_size())
        wrap(kernel)[grid_dq](
            ds, k, dq_rows, q_offsets, kv_offsets, batch_order, ds.stride(0), ds.stride(1),
            k.stride(0), k.stride(1), dq_rows.stride(0), dq_rows.stride(1), num_heads, head_dim,
            max_q_len, grad_scale, _bucket(max_q_len), _bucket(max_kv_len),
            BLOCK_D=meta["BLOCK_D"], EVEN_D=meta["EVEN_D"], DOT_PRECISION=meta["DOT_PRECISION"],
            **launch,
        )
        return dq_rows, dk, dv

    kernel, launch = _kernel_and_config("dq", meta["BLOCK_D"], q.element_size())
    wrap(kernel)[grid_dq](
        q, k, v, grad_out, lse, delta, dq_rows, q_offsets, kv_offsets, batch_order,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dq_rows.stride(0), dq_rows.stride(1),
        lse_stride, num_heads, head_dim, max_q_len, qk_scale, grad_scale,
        window, block_size, _bucket(max_q_len), _bucket(max_kv_len),
        **meta, **launch,
    )
    if q_broadcast:
        dq = dq_rows.view(num_batches, q.shape[0], num_heads, head_dim).sum(0).to(q.dtype)
        return dq, dk, dv
    return dq_rows, dk, dv
