"""Jagged attention: Jagged Flash Attention (softmax), GDPA (pointwise), BlockAttention.

The public entry point is :func:`jagged_attention` (validation, layouts, backend choice);
``reference.py`` is the spec. The package by role (docs/kernels.md, "Layout"):

* ``settings.py``: the switches (one frozen object, from the config; a few ``GEM_KERNELS_*`` overrides for debugging);
* ``call.py``: one call's description (``AttentionCall``) and the kernels' choice for it (pure);
* ``launch.py``: the launchers (the chosen kernels, and the recoveries only a launch finds);
* ``op.py``: the torch.library ops, their autograd and FLOP formulas;
* ``triton_common.py``, ``triton_fwd.py``, ``triton_bwd.py``, ``batch_order.py``,
  ``autotune.py``: the Triton kernels, their launchers and launch configs;
* ``gluon_common.py``, ``gluon_fwd.py``, ``gluon_bwd.py``: the Hopper (sm_90) Gluon kernels;
* ``inputs.py`` (random inputs) and ``testing.py`` (hooks) for tests and benchmarks.
"""

from __future__ import annotations

import math

import torch

from kernels import fallback
from kernels.jagged_attention import settings as settings_module
from kernels.jagged_attention.call import AttentionCall
from kernels.jagged_attention.reference import (
    ACTIVATIONS,
    jagged_attention_reference,
    num_visible_pairs,
)
from kernels.jagged_attention.settings import KernelSettings
from kernels.jagged_attention.triton_common import resolve_backend

__all__ = [
    "ACTIVATIONS",
    "check_offsets",
    "jagged_attention",
    "jagged_attention_reference",
    "num_visible_pairs",
    "packed_kv_attention",
    "rotary_self_attention",
]


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor | None,
    max_q_len: int | None,
    max_kv_len: int | None,
    *,
    activation: str = "softmax",
    scale: float | None = None,
    post_scale: float | None = None,
    causal: bool = False,
    window: int | None = None,
    block_size: int | None = None,
    backend: str | None = None,
    check: bool | None = None,
    settings: KernelSettings | None = None,
) -> torch.Tensor:
    """Attention over jagged (variable-length) sequences, forward and backward.

    With ``S = scale * Q K^T`` per example and head, and ``visible`` the mask below:

    * ``activation="softmax"`` (Jagged Flash Attention): ``O = softmax(S | visible) V``
      (online softmax; the log-sum-exp is saved for the backward). A query that sees no key
      gets ``O = 0``.
    * ``"silu" | "gelu" | "fast_gelu" | "relu" | "identity"`` (GDPA):
      ``O = (post_scale * act(S) * visible) V`` with no normalization; ``fast_gelu`` is the
      tanh form of GELU. Formulas in ``kernels/jagged_attention/reference.py`` and
      ``docs/kernels.md``.

    Key ``j`` is visible to query ``i`` (positions counted from the example's first row)
    iff ``j < Lkv`` and: ``j <= i`` if ``causal``; ``|i - j| <= window`` if ``window`` is set;
    ``i // block_size == j // block_size`` if ``block_size`` is set (BlockAttention: cost
    linear in length). Masks combine with AND.

    Layouts (``B`` examples, ``H`` heads, head dim ``D`` in 32..256)::

        #            i = 0      i = 1   i = 2   <- batch
        # q rows     [q0 q1 q2] []      [q3]        q_offsets  = [0, 3, 3, 4]
        # k/v rows   [k0 k1]    [k2]    []          kv_offsets = [0, 2, 3, 3]

    * jagged Q ``[Tq, H, D]`` + ``q_offsets [B+1]``, jagged K/V ``[Tkv, H, D]`` +
      ``kv_offsets [B+1]`` -> ``[Tq, H, D]``.
    * dense K/V (GDPA-PFFN): ``k, v [B, N, H, D]`` and ``kv_offsets=None``
      (``max_kv_len`` may be None; it is ``N``).
    * broadcast Q (learned pooling queries, PMA): ``q [N, H, D]`` shared by every example,
      ``q_offsets=None`` (``max_q_len`` may be None) -> ``[B, N, H, D]``. Q is never copied;
      its gradient is summed over the batch.

    Args:
        q, k, v: same dtype (bf16, fp16 or fp32), layouts above.
        q_offsets, kv_offsets: ``[B+1]`` int32 or int64, ``offsets[0] = 0``, nondecreasing.
        max_q_len, max_kv_len: host-side upper bounds on the lengths (no device sync).
        activation: one of ``ACTIVATIONS``.
        scale: multiplies ``Q K^T`` before the activation; default ``1 / sqrt(D)``.
        post_scale: GDPA only, multiplies ``act(S)``; default ``1 / max_kv_len`` (keeps the
            output scale independent of length, as in Meta's GDPA; pass a constant such as
            ``1.0`` to make it independent of the batch's ``max_kv_len``).
        causal, window, block_size: masks, see above.
        backend: ``"triton"``, ``"reference"`` or None (Triton on CUDA, reference elsewhere).
        check: check the offsets against the contract below on the device too (one
            device-to-host copy, a sync); None: the settings' ``check`` (``kernels.check``,
            ``GEM_KERNELS_CHECK``).
        settings: the kernels' settings of this call (``settings.KernelSettings``; a module
            holds its own, handed to it when the model is built); None: the process default,
            ``settings.current()``.

    Contract of the host arguments (the kernels trust them: a violation reads out of range or
    gives wrong output silently):

    * ``offsets[0] == 0``, nondecreasing, ``offsets[-1] ==`` the rows of ``q`` (``q_offsets``)
      or of ``k`` / ``v`` (``kv_offsets``);
    * ``max_q_len >= `` every query length, ``max_kv_len >=`` every key length (a larger bound
      is fine: it costs work, not correctness; a smaller one drops keys or queries).

    Checked, with a ``ValueError`` naming the argument, whenever it costs no device sync: offsets
    on the CPU (the reference backend, Triton's interpreter), outside ``torch.compile`` tracing.
    CUDA offsets are checked only with ``check=True`` or the ``check`` setting, because the check
    waits for the device; the default CUDA path adds no sync.

    Returns:
        ``[Tq, H, D]`` (or ``[B, N, H, D]`` for a broadcast Q) in ``q.dtype``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; expected one of {ACTIVATIONS}")
    if post_scale is not None and activation == "softmax":
        raise ValueError("post_scale applies to pointwise activations only, not softmax")
    if window is not None and window < 0:
        raise ValueError(f"window={window} must be >= 0 (or None)")
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size={block_size} must be > 0 (or None)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D] (or [N, H, D] with q_offsets=None), got {tuple(q.shape)}")
    expected_kv_dim = 3 if kv_offsets is not None else 4
    if k.dim() != expected_kv_dim or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be {'[T, H, D]' if kv_offsets is not None else '[B, N, H, D]'}"
            f" (kv_offsets {'given' if kv_offsets is not None else 'None'}), got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[-2:] != q.shape[-2:]:
        raise ValueError(f"q and k must share [H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    for name, offsets in (("q_offsets", q_offsets), ("kv_offsets", kv_offsets)):
        if offsets is not None and offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if q_offsets is not None and kv_offsets is not None and q_offsets.shape != kv_offsets.shape:
        raise ValueError("q_offsets and kv_offsets must both be [B+1]")
    if kv_offsets is None and q_offsets is not None and q_offsets.numel() - 1 != k.shape[0]:
        raise ValueError(f"dense k/v has B={k.shape[0]} but q_offsets has {q_offsets.numel() - 1}")

    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if kv_offsets is None:
        max_kv_len = k.shape[1]
    if q_offsets is None:
        max_q_len = q.shape[0]
    if max_q_len is None or max_kv_len is None:
        raise ValueError("max_q_len / max_kv_len are required for jagged inputs")
    _check_bound("max_q_len", max_q_len)
    _check_bound("max_kv_len", max_kv_len)
    settings = settings_module.current() if settings is None else settings
    check = _resolve_check(check, settings)
    if q_offsets is not None:
        check_offsets("q_offsets", q_offsets, "q", q.shape[0], "max_q_len", max_q_len, check)
    if kv_offsets is not None:
        check_offsets("kv_offsets", kv_offsets, "k / v", k.shape[0], "max_kv_len", max_kv_len, check)
    if activation != "softmax" and post_scale is None:
        post_scale = 1.0 / max(int(max_kv_len), 1)

    layout = "broadcast_q" if q_offsets is None else "dense_kv" if kv_offsets is None else "jagged"
    variant = (
        activation,
        fallback.dtype_name(q),
        head_dim,
        bool(causal),
        window is not None,
        block_size is not None,
        layout,
        *settings_module.build_flags(settings),
    )
    if resolve_backend(backend, q, "jagged_attention", variant) == "reference":
        return jagged_attention_reference(
            q,
            k,
            v,
            q_offsets,
            kv_offsets,
            max_q_len,
            max_kv_len,
            activation=activation,
            scale=scale,
            post_scale=post_scale,
            causal=causal,
            window=window,
            block_size=block_size,
        )

    q_broadcast = q_offsets is None
    if kv_offsets is None:  # dense [B, N, H, D]: a view as jagged rows with equal lengths
        num_batches, num_keys = k.shape[0], k.shape[1]
        k = k.reshape(num_batches * num_keys, *k.shape[2:])
        v = v.reshape(num_batches * num_keys, *v.shape[2:])
        kv_offsets = _equal_offsets(num_batches, num_keys, q.device)
    num_batches = kv_offsets.numel() - 1
    if q_broadcast:
        q_offsets = _equal_offsets(num_batches, q.shape[0], q.device)  # the same queries for every example
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    call = AttentionCall(
        int(max_q_len),
        int(max_kv_len),
        activation,
        scale,
        1.0 if post_scale is None else float(post_scale),
        bool(causal),
        -1 if window is None else int(window),
        0 if block_size is None else int(block_size),
        q_broadcast,
        settings=settings,
    )
    out = op.jagged_attention_triton(q, k, v, q_offsets, kv_offsets, call)
    if q_broadcast:
        return out.view(num_batches, q.shape[0], *q.shape[1:])
    return out


def rotary_self_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    *,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    backend: str | None = None,
    check: bool | None = None,
    settings: KernelSettings | None = None,
) -> torch.Tensor:
    """Softmax self-attention over the jagged rows of a packed projection with rotary positions:
    ``jagged_attention(*rotary_qkv(qkv, cos, sin), offsets, offsets, max_len, max_len, ...)`` in
    fewer passes over memory.

    Args:
        qkv: ``[T, 3, H, D]``, each row's Q, K and V (one linear layer's output, viewed).
        cos, sin: float32 ``[T, D/2]``, the rotation of each row (``kernels.rotary.rotary_qkv``;
            ``gem.models.sequence.rotary_tables`` computes them).
        offsets, max_len: the rows' ``[B+1]`` offsets and a host-side bound on the lengths.
        causal, window, scale, backend, check, settings: as :func:`jagged_attention`'s.

    Returns ``[T, H, D]`` in ``qkv.dtype``, differentiable in ``qkv``. With the ``rotary_fused``
    setting, on the Triton backend with a head dim that is a power of two (16 and up), the kernels
    read V from ``qkv`` in place and write the gradient of ``qkv`` whole: the dK/dV and dQ kernels
    turn the gradients of Q and K back through the rotation as they store them, so neither a rotary
    backward nor a copy of V runs. Otherwise it is the two calls above.
    """
    from kernels.rotary import check_inputs, rotary_qkv

    check_inputs(qkv, cos, sin)
    if window is not None and window < 0:
        raise ValueError(f"window={window} must be >= 0 (or None)")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be int32 or int64, got {offsets.dtype}")
    _check_bound("max_len", max_len)
    settings = settings_module.current() if settings is None else settings
    check_offsets("offsets", offsets, "qkv", qkv.shape[0], "max_len", max_len, _resolve_check(check, settings))
    head_dim = qkv.shape[-1]
    backend = resolve_backend(backend, qkv)
    fused = backend == "triton" and head_dim >= 16 and not head_dim & (head_dim - 1) and settings.rotary_fused
    if fused:  # its own kernels, checked as such (the two calls below check theirs)
        variant = (
            fallback.dtype_name(qkv),
            head_dim,
            bool(causal),
            window is not None,
            *settings_module.build_flags(settings),
        )
        backend = resolve_backend(backend, qkv, "rotary_self_attention", variant)
        fused = backend == "triton"
    if not fused:
        q, k, v = rotary_qkv(qkv, cos, sin, backend=backend)
        return jagged_attention(
            q,
            k,
            v,
            offsets,
            offsets,
            max_len,
            max_len,
            causal=causal,
            window=window,
            scale=scale,
            backend=backend,
            check=False,  # checked above
            settings=settings,
        )
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    call = AttentionCall(
        int(max_len),
        int(max_len),
        "softmax",
        1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        1.0,
        bool(causal),
        -1 if window is None else int(window),
        packing="qkv",
        rotary=True,
        settings=settings,
    )
    return op.rotary_self_attention_triton(qkv, cos, sin, offsets, call)


def packed_kv_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    *,
    scale: float | None = None,
    backend: str | None = None,
    check: bool | None = None,
    settings: KernelSettings | None = None,
) -> torch.Tensor:
    """Softmax attention of the same queries over each example's rows of a packed K/V projection:
    ``jagged_attention(q, kv[:, 0], kv[:, 1], None, offsets, None, max_len)`` (pooling by
    attention), with one gradient buffer.

    Args:
        q: ``[N, H, D]``, the queries every example shares.
        kv: ``[T, 2, H, D]``, each row's K and V (one linear layer's output, viewed).
        offsets, max_len: the rows' ``[B+1]`` offsets and a host-side bound on the lengths.
        scale, backend, check, settings: as :func:`jagged_attention`'s.

    Returns ``[B, N, H, D]``, differentiable in ``q`` and ``kv``; an example without rows gets
    zeros. On the Triton backend the dK/dV kernel writes the gradient of ``kv`` whole, where the
    two tensors of :func:`jagged_attention` would be stacked into it.
    """
    if q.dim() != 3 or kv.dim() != 4 or kv.shape[1] != 2 or kv.shape[2:] != q.shape[1:]:
        raise ValueError(
            f"q must be [N, H, D] and kv [T, 2, H, D] with the same H and D, got {tuple(q.shape)} and {tuple(kv.shape)}"
        )
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be int32 or int64, got {offsets.dtype}")
    _check_bound("max_len", max_len)
    settings = settings_module.current() if settings is None else settings
    check_offsets("offsets", offsets, "kv", kv.shape[0], "max_len", max_len, _resolve_check(check, settings))
    variant = (fallback.dtype_name(kv), kv.shape[-1], *settings_module.build_flags(settings))
    backend = resolve_backend(backend, kv, "packed_kv_attention", variant)
    if backend != "triton":
        k, v = kv.unbind(1)
        return jagged_attention(
            q, k, v, None, offsets, None, max_len, scale=scale, backend=backend, check=False, settings=settings
        )
    q, kv = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, kv))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    num_batches = offsets.numel() - 1
    call = AttentionCall(q.shape[0], int(max_len), "softmax", scale, q_broadcast=True, packing="kv", settings=settings)
    out = op.packed_kv_attention_triton(q, kv, _equal_offsets(num_batches, q.shape[0], q.device), offsets, call)
    return out.view(num_batches, *q.shape)


def _equal_offsets(num_batches: int, rows: int, device) -> torch.Tensor:
    """``[B+1]`` int32 offsets of ``num_batches`` examples of ``rows`` rows each (dense K/V viewed as
    jagged rows; broadcast queries, the same ``rows`` for every example)."""
    return torch.arange(num_batches + 1, device=device, dtype=torch.int32) * rows


def _check_bound(name: str, value) -> None:
    """A ValueError unless ``value`` (a length bound) is a non-negative integer; symbolic while compiling."""
    if torch.compiler.is_compiling():
        return
    if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer: a host-side upper bound on the lengths")


def _resolve_check(check: bool | None, settings: KernelSettings) -> bool:
    """``check``, or the ``check`` setting where None; never while compiling: the check syncs, and
    torch 2.11's Dynamo fails to guard on settings."""
    if check is None:
        return not torch.compiler.is_compiling() and settings.check
    return check


def check_offsets(
    name: str, offsets: torch.Tensor, rows_of: str, rows: int, max_name: str, max_len: int, on_device: bool
) -> None:
    """Raises a ValueError naming ``name`` where ``offsets`` break the contract of
    :func:`jagged_attention` (rows of ``rows_of``, bound ``max_name``); reads the values only where
    that costs no sync (CPU offsets, not tracing) or ``on_device``."""
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(
            f"{name} must be [B+1] (one dimension, at least one element), got shape {tuple(offsets.shape)}"
        )
    if torch.compiler.is_compiling() or isinstance(offsets, torch._subclasses.FakeTensor) or offsets.is_meta:
        return  # no values to look at while tracing
    if offsets.device.type != "cpu" and not on_device:
        return  # a device-to-host copy is a sync: only under check=True / GEM_KERNELS_CHECK=1
    o = offsets.detach().to("cpu", torch.int64)
    fix = "offsets are the cumulative lengths [0, L0, L0+L1, ...]"
    if o[0] != 0:
        raise ValueError(f"{name}[0]={int(o[0])} must be 0; {fix}")
    lengths = o[1:] - o[:-1]
    if lengths.numel() and bool((lengths < 0).any()):
        i = int((lengths < 0).nonzero()[0])
        raise ValueError(
            f"{name} must be nondecreasing: {name}[{i}]={int(o[i])} > {name}[{i + 1}]={int(o[i + 1])}; {fix}"
        )
    if int(o[-1]) != rows:
        raise ValueError(f"{name}[-1]={int(o[-1])} must equal the number of rows of {rows_of} ({rows})")
    if lengths.numel():
        longest, b = (int(x) for x in lengths.max(0))
        if longest > max_len:
            raise ValueError(
                f"{max_name}={max_len} is less than the longest sequence in {name} ({longest} rows, "
                f"example {b}); pass an upper bound on the lengths (larger is correct, only slower)"
            )


# Registers the ops and their FLOP formulas at import: a FlopCounterMode copies the formula
# registry when it is created, so one opened before a lazy import would count zero.
from kernels.jagged_attention import op, probes  # noqa: E402

fallback.PROBES |= {  # each builds and launches every kernel of a variant once (probes.py)
    "jagged_attention": probes.jagged_attention,
    "gluon_gdpa": probes.gluon_gdpa,  # the Gluon kernels only (kernels.fallback.gluon_checked)
    "gluon_softmax": probes.gluon_softmax,  # likewise
    "rotary_self_attention": probes.rotary_self_attention,
    "packed_kv_attention": probes.packed_kv_attention,
}
