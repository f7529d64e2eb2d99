"""Shared pieces of the Triton jagged attention kernels: constants, activations, masks, loads.

The forward (``triton_fwd.py``) and backward (``triton_bwd.py``) kernels are built from these
``@triton.jit`` helpers; the math they implement is specified by ``reference.py``.

One program handles one (example, head, row block). Every mask (jagged length, causal,
sliding window, BlockAttention) keeps, for each query row, one contiguous interval of keys,
so each program visits only the key blocks that intersect the union of its rows'
intervals: blocks visible to every row run without any mask, the few border blocks run
masked (without a causal, window or block mask: one loop over all blocks, see BOUNDS below).
BlockAttention and sliding window therefore cost O(length), not O(length^2).
Programs are ordered longest example first (``batch_order.py``), so the short and empty
examples fill the tail of the grid instead of leaving long ones to run alone.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels import fallback
from kernels.jagged_attention.reference import ACTIVATIONS
from kernels.jagged_attention.settings import KernelSettings

# Activation codes passed to the kernels as a constexpr.
SOFTMAX, SILU, GELU, FAST_GELU, RELU, IDENTITY = range(6)
ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Every kernels op's backends: its Triton kernels, or its PyTorch reference (the spec).
BACKENDS = ("triton", "reference")


def resolve_backend(backend: str | None, t: torch.Tensor, kernel: str | None = None, variant: tuple = ()) -> str:
    """An op's ``backend`` argument: None picks Triton for a CUDA tensor ``t`` and the reference
    elsewhere; anything but :data:`BACKENDS` is a ValueError naming them. Given the op's name
    ``kernel`` (a key of ``kernels.fallback.PROBES``) and the call's ``variant`` (flags, dtype and
    sizes), a Triton choice turns into the reference where those kernels fail to build or run on
    ``t``'s device (``kernels.fallback.triton_usable``: checked once per variant). Under
    ``torch.compile`` the sizes are left out (None: the check uses gem_base's), since Dynamo may
    trace them as symbols and takes the check's arguments as constants."""
    if backend is None:
        backend = "triton" if t.is_cuda else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS} or None")
    if backend == "triton" and kernel is not None and not INTERPRET:  # the interpreter compiles nothing
        if torch.compiler.is_compiling():  # sizes may be traced as symbols: the check takes its own
            variant = tuple(v if isinstance(v, (str, bool)) else None for v in variant)
        if not fallback.triton_usable(kernel, (*variant, t.device.index or 0)):
            return "reference"
    return backend


# act(scale * x) = ACT_UNIT * scale * gdpa_act(x) and act'(scale * x) = ACT_UNIT * (its
# second factor in gdpa_act_and_grad): the launchers fold these constants into the output,
# dV and dQ / dK scales.
ACT_UNIT = {"silu": 0.5, "gelu": 0.5, "fast_gelu": 0.5, "relu": 1.0, "identity": 1.0}


# Triton 3.7's interpreter gets bf16 tl.dot wrong; there every dot runs on float32 copies of
# its (already rounded) operands, which keeps the numerics of the compiled kernel.
UPCAST_DOTS = tl.constexpr(INTERPRET)

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
def dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc + a @ b with a float32 accumulator."""
    if UPCAST_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh; FAST uses the hardware approximation (MUFU.TANH, rel. error ~5e-4, 16-bit inputs)."""
    if FAST and not UPCAST_DOTS:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def gdpa_act(x, scale, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
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


# The bf16x2 PTX of gdpa_act_packed (also used by gluon.py): two scores per 32-bit register.
# silu: $0 = x + x tanh(h x) for x = $1, h = $2 (scale / 2).
SILU_BF16X2 = tl.constexpr(
    "{ .reg .b32 h, t; mul.rn.bf16x2 h, $1, $2; tanh.approx.bf16x2 t, h; fma.rn.bf16x2 $0, $1, t, $1; }"
)
# fast_gelu: $0 = x + x tanh(x (a + b x^2)) for x = $1, a = $2, b = $3.
FAST_GELU_BF16X2 = tl.constexpr(
    "{ .reg .b32 sq, u, t; mul.rn.bf16x2 sq, $1, $1; fma.rn.bf16x2 u, sq, $3, $2; "
    "mul.rn.bf16x2 u, $1, u; tanh.approx.bf16x2 t, u; fma.rn.bf16x2 $0, $1, t, $1; }"
)


@triton.jit
def gdpa_act_packed(x, scale, ACTIVATION: tl.constexpr):
    """:func:`gdpa_act` of bf16 scores x (silu, fast_gelu), two at a time: bf16x2 multiplies
    and FMAs, and one MUFU.TANH for two values. Returns bf16. The PTX (``mul.rn.bf16x2``,
    ``tanh.approx.bf16x2``) needs sm_90; ``packed_act`` checks that."""
    if ACTIVATION == 1:
        h = tl.full(x.shape, 0.5 * scale, x.dtype)
        return tl.inline_asm_elementwise(SILU_BF16X2, "=r,r,r", [x, h], dtype=x.dtype, is_pure=True, pack=2)
    else:
        a = scale * 0.7978845608028654
        a2 = tl.full(x.shape, a, x.dtype)
        b2 = tl.full(x.shape, a * 0.044715 * scale * scale, x.dtype)
        return tl.inline_asm_elementwise(FAST_GELU_BF16X2, "=r,r,r,r", [x, a2, b2], dtype=x.dtype, is_pure=True, pack=2)


@triton.jit
def gdpa_p(
    x, scale, dtype: tl.constexpr, ACTIVATION: tl.constexpr, PACKED_ACT: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """The forward's P = :func:`gdpa_act` of the float32 scores x, in ``dtype`` (bf16x2 math
    where PACKED_ACT)."""
    if PACKED_ACT:
        return gdpa_act_packed(x.to(dtype), scale, ACTIVATION)
    return gdpa_act(x, scale, ACTIVATION, DOT_PRECISION != "ieee").to(dtype)


# The bf16x2 PTX of gdpa_act_and_grad_packed (also used by gluon.py): $0 = P and $1 = dP * g
# (the value and gradient factors of gdpa_act_and_grad) for x = $2, dP = $3.
# silu: h = $4 (scale / 2).
SILU_GRAD_BF16X2 = tl.constexpr(
    "{ .reg .b32 h, t, one, opt, omt, g; mov.b32 one, 0x3F803F80; "
    "mul.rn.bf16x2 h, $2, $4; tanh.approx.bf16x2 t, h; fma.rn.bf16x2 $0, $2, t, $2; "
    "add.rn.bf16x2 opt, one, t; sub.rn.bf16x2 omt, one, t; fma.rn.bf16x2 g, h, omt, one; "
    "mul.rn.bf16x2 g, opt, g; mul.rn.bf16x2 $1, $3, g; }"
)
# fast_gelu: a = $4, b = $5, 3 b = $6 (as in FAST_GELU_BF16X2).
FAST_GELU_GRAD_BF16X2 = tl.constexpr(
    "{ .reg .b32 sq, u, t, w, one, opt, omt; mov.b32 one, 0x3F803F80; "
    "mul.rn.bf16x2 sq, $2, $2; fma.rn.bf16x2 u, sq, $5, $4; mul.rn.bf16x2 u, $2, u; "
    "tanh.approx.bf16x2 t, u; fma.rn.bf16x2 $0, $2, t, $2; "
    "fma.rn.bf16x2 w, sq, $6, $4; mul.rn.bf16x2 w, $2, w; "
    "add.rn.bf16x2 opt, one, t; sub.rn.bf16x2 omt, one, t; mul.rn.bf16x2 omt, omt, opt; "
    "fma.rn.bf16x2 w, w, omt, opt; mul.rn.bf16x2 $1, $3, w; }"
)


@triton.jit
def gdpa_act_and_grad_packed(x, dp, scale, ACTIVATION: tl.constexpr):
    """(p, dp * g) of :func:`gdpa_act_and_grad` for bf16 scores x and bf16 dP (silu,
    fast_gelu), two at a time in bf16x2 (sm_90). Returns bf16."""
    if ACTIVATION == 1:
        h = tl.full(x.shape, 0.5 * scale, x.dtype)
        return tl.inline_asm_elementwise(
            SILU_GRAD_BF16X2, "=r,=r,r,r,r", [x, dp, h], dtype=(x.dtype, x.dtype), is_pure=True, pack=2
        )
    else:
        a = scale * 0.7978845608028654
        b = a * 0.044715 * scale * scale
        a2 = tl.full(x.shape, a, x.dtype)
        b2 = tl.full(x.shape, b, x.dtype)
        b3 = tl.full(x.shape, 3.0 * b, x.dtype)
        return tl.inline_asm_elementwise(
            FAST_GELU_GRAD_BF16X2,
            "=r,=r,r,r,r,r,r",
            [x, dp, a2, b2, b3],
            dtype=(x.dtype, x.dtype),
            is_pure=True,
            pack=2,
        )


@triton.jit
def gdpa_act_and_grad(x, scale, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """(act(s) / (unit * scale), act'(s) / unit) at s = scale * x, x float32: the dV and dS
    factors of the backward, sharing one tanh (``unit`` as in :func:`gdpa_act`)."""
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
def visible_mask(
    rows,
    cols,
    num_rows,
    num_cols,
    window,
    block_size,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
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
def key_interval(
    i_first,
    i_last,
    num_keys,
    window,
    block_size,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
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
def query_interval(
    j_first,
    j_last,
    num_queries,
    window,
    block_size,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
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
def split_blocks(lo_any, lo_all, hi_all, hi_any, BLOCK: tl.constexpr):
    """Splits [lo_any, hi_any) into masked [first, full_start), unmasked [full_start, full_end)
    (whole blocks inside [lo_all, hi_all)) and masked [full_end, hi_any)."""
    first = (lo_any // BLOCK) * BLOCK
    full_start = tl.minimum(tl.cdiv(lo_all, BLOCK) * BLOCK, hi_any)
    full_start = tl.maximum(full_start, first)
    num_full = tl.maximum(hi_all - full_start, 0) // BLOCK
    full_end = full_start + num_full * BLOCK
    return first, full_start, full_end, hi_any


@triton.jit
def program_block(pid, max_len, BLOCK: tl.constexpr, num_heads):
    """(block, rank in ``batch_order``, head) of program ``pid`` of a grid of one program per
    (example in ``batch_order``, head, block of ``BLOCK`` of the ``max_len`` rows)."""
    num_blocks = tl.cdiv(max_len, BLOCK)
    bh = pid // num_blocks
    return pid % num_blocks, bh // num_heads, bh % num_heads


@triton.jit
def example_rows(q_start, q_end, kv_start, kv_end):
    """(first output row, query rows, first K/V row, keys) of an example from its loaded offsets.
    The kernels load the offsets themselves: a pointer passed to a helper whose result feeds a
    store address counts as written for Inductor, which then clones it (compile_mutations.py)."""
    return (
        q_start.to(tl.int64),
        (q_end - q_start).to(tl.int32),
        kv_start.to(tl.int64),
        (kv_end - kv_start).to(tl.int32),
    )


@triton.jit
def load_rows(ptrs, rows, num_rows, dmask, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    if MASK_ROWS:
        if EVEN_D:
            return tl.load(ptrs, mask=(rows < num_rows)[:, None], other=0.0)
        return tl.load(ptrs, mask=(rows < num_rows)[:, None] & dmask[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=dmask[None, :], other=0.0)


@triton.jit
def load_tile(X, stride, start, rows, num_rows, offs_d, dmask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Rows ``start + [0, BLOCK)`` of one example's ``[num_rows, D]`` operand; X points at its
    first row, ``rows = start + arange(BLOCK)``, masked loads where MASKED."""
    return load_rows(X + rows[:, None] * stride + offs_d[None, :], rows, num_rows, dmask, MASKED, EVEN_D)


@triton.jit
def store_grad(
    X,
    rows,
    stride,
    offs_d,
    row_mask,
    dmask,
    g,
    COS,
    SIN,
    table_rows,
    stride_cs,
    ROPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Stores a gradient tile ``g [BLOCK, BLOCK_D]`` (float32) into rows ``rows`` of an example's
    ``[num_rows, D]`` operand (X at its first row). With ROPE, ``g`` is the gradient of the
    rotated operand and is turned back through the rotation first: ``R^T g`` on the channel pairs
    ``(j, j + D/2)``, with the tables' rows ``table_rows`` (float32 ``[T, D/2]``, as
    ``kernels.rotary``); ROPE needs ``BLOCK_D == D``."""
    if ROPE:
        HALF: tl.constexpr = BLOCK_D // 2
        g1, g2 = tl.split(tl.permute(tl.reshape(g, [g.shape[0], 2, HALF]), [0, 2, 1]))
        half = tl.arange(0, HALF)[None, :]
        table = table_rows.to(tl.int64)[:, None] * stride_cs + half
        cos = tl.load(COS + table, mask=row_mask[:, None], other=0.0)
        sin = tl.load(SIN + table, mask=row_mask[:, None], other=0.0)
        ptrs = X + rows[:, None] * stride + half
        tl.store(ptrs, (g1 * cos + g2 * sin).to(X.dtype.element_ty), mask=row_mask[:, None])
        tl.store(ptrs + HALF, (g2 * cos - g1 * sin).to(X.dtype.element_ty), mask=row_mask[:, None])
    else:
        ptrs = X + rows[:, None] * stride + offs_d[None, :]
        tl.store(ptrs, g.to(X.dtype.element_ty), mask=row_mask[:, None] & dmask[None, :])


# ---------------------------------------------------------------------------------------
# host side: what the launchers share
# ---------------------------------------------------------------------------------------


class _NoLaunch:
    """Stands in for a kernel when only output shapes are wanted (fake / meta tensors)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def no_launch(kernel) -> _NoLaunch:
    """A ``wrap`` for the launchers that allocates outputs but launches nothing."""
    return _NoLaunch()


def identity(kernel):
    """The default ``wrap``: launch the kernel itself."""
    return kernel


def define_op(name: str):
    """A decorator registering a kernels op: ``triton_op``, so that torch.compile sees the Triton
    kernels inside it (launched through :data:`OP_WRAP`). Interpreted kernels cannot be traced into
    a graph (``wrap_triton`` hands them back raw), so under ``TRITON_INTERPRET=1`` the op is an
    opaque ``custom_op``, whose fake impl the caller registers (:func:`fake_without_launch`)."""
    if INTERPRET:
        return torch.library.custom_op(name, mutates_args=())
    return triton_op(name, mutates_args=())


def fake_without_launch(op, launcher) -> None:
    """Under ``TRITON_INTERPRET=1``, registers ``op``'s fake impl: ``launcher(*op's args, wrap=no_launch)``,
    which allocates the outputs and launches nothing (a ``triton_op`` needs none: it is traced)."""
    if INTERPRET:
        op.register_fake(lambda *args: launcher(*args, wrap=no_launch))


# The ``wrap`` of the registered ops' launchers: traced by torch.compile, or the interpreted kernel itself.
OP_WRAP = identity if INTERPRET else wrap_triton


@functools.cache
def capability(device_index: int | None) -> tuple[int, int]:
    """The CUDA compute capability of a device (cached: a driver call)."""
    return torch.cuda.get_device_capability(device_index)


def device_capability(t: torch.Tensor) -> tuple[int, int]:
    """``t``'s device's compute capability, ``(0, 0)`` off CUDA."""
    return capability(t.device.index) if t.is_cuda else (0, 0)


def unmasked(causal: bool, window: int, block_size: int, q_broadcast: bool) -> bool:
    """No causal, window or block mask, and jagged queries (not one set broadcast to every example)."""
    return not (causal or window >= 0 or block_size > 0 or q_broadcast)


def unmasked_pointwise(activation: str, causal: bool, window: int, block_size: int, q_broadcast: bool) -> bool:
    """A call the Gluon kernels take, as far as its arguments say: a pointwise activation (GDPA),
    no causal, window or block mask, jagged queries (``gluon_common.applies`` checks the tensors)."""
    return activation != "softmax" and unmasked(causal, window, block_size, q_broadcast)


def packed_act(q: torch.Tensor, activation: str, config: KernelSettings, arch: tuple[int, int] | None = None) -> bool:
    """Whether the kernels take the bf16x2 activation path: ``config.packed_act``, bf16 silu or
    fast_gelu, on a GPU with the sm_90 bf16x2 instructions (Hopper or newer). ``arch`` (a compute
    capability) stands in for q's device, e.g. to compile for sm_90 without one."""
    arch = arch or device_capability(q)
    return (
        config.packed_act
        and not INTERPRET
        and q.dtype == torch.bfloat16
        and activation in ("silu", "fast_gelu")
        and arch[0] >= 9
    )


def launch_meta(q, activation, causal, window, block_size, q_broadcast, packed: bool) -> dict:
    """The constexpr arguments every forward and backward kernel takes."""
    head_dim = q.shape[-1]
    block_d = max(triton.next_power_of_2(head_dim), 16)
    return dict(
        ACTIVATION=ACTIVATION_CODES[activation],
        CAUSAL=bool(causal),
        HAS_WINDOW=window >= 0,
        HAS_BLOCK=block_size > 0,
        Q_BROADCAST=bool(q_broadcast),
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PACKED_ACT=packed,
    )


def bucket(n: int) -> int:
    """Autotune key bucket: the next power of two (a new batch never retunes)."""
    return triton.next_power_of_2(max(int(n), 16))
