"""One attention call, described once, and the kernels it gets: a pure choice.

The entry points (``kernels.jagged_attention``: :func:`jagged_attention`,
``rotary_self_attention``, ``packed_kv_attention``) build an :class:`AttentionCall` once (length
bounds, activation, scales, mask, layout, packing, kernel settings) and hand it down; the
registered ops carry it in their ``sizes`` / ``activation`` / ``scales`` arguments
(:meth:`AttentionCall.op_args`, :meth:`AttentionCall.of_op`), so their schemas and what
``torch.compile`` sees stay the same. The launchers (``launch.py``) describe their tensors as
:class:`Operands` and ask :func:`choose_forward` / :func:`choose_backward` which kernels run::

    call = AttentionCall(max_q_len=300, max_kv_len=256, activation="silu", scale=0.088,
                         post_scale=1 / 256, settings=KernelSettings())
    choose_forward(call, Operands.of(q, k, v, call))   # "gluon" on an sm_90 GPU, else "triton"

Both choices read only their arguments (no settings in force, no test hook), so tests call them
as plain functions. What can still go wrong at launch (a Gluon build that fails, a stored-dS
buffer that does not fit) is the launchers' to recover from.

Dynamo traces the entry points, and with them this class's constructor: its fields are plain
ints, floats, strs and bools, and ``settings`` is a required keyword (torch 2.11's Dynamo wraps
every default of a constructor it traces and cannot wrap a ``KernelSettings`` one).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from kernels.jagged_attention.settings import TUNE_SPACES, KernelSettings
from kernels.jagged_attention.triton_common import (
    ACT_UNIT,
    INTERPRET,
    LOG2E,
    device_capability,
    unmasked,
    unmasked_pointwise,
)

# The Triton releases (major.minor) on which each Gluon kernel passed the GPU gate
# (tools/gpu_gate.sh, benchmarks/results/gpu-gate.json); on any other the Triton kernels run, with
# one info line. A release joins a kernel's list only with a passing gate on it.
# gluon_softmax_fwd (the softmax forward, built without a GPU) has passed on none yet: it runs only
# under testing.unverified_gluon(), for its GPU tests and benchmarks/attention.py --flagship.
GLUON_VERIFIED = {"gluon_fwd": ("3.6",), "gluon_dkdv": ("3.6",), "gluon_softmax_fwd": ()}
_allow_unverified = False  # testing.unverified_gluon(): a new release's GPU tests run the kernels

PACKINGS = ("", "qkv", "kv")  # the packed projection whose gradient the kernels write whole, if any

# The settings the launchers read, in the order they ride in an op's ``sizes`` after the call's own.
assert TUNE_SPACES == ("default", "wide")  # (op_args codes tune_space as its index)
_LAUNCH_SETTINGS = (
    "packed_act",
    "gluon",
    "gluon_min_q_len",
    "gluon_bwd",
    "store_ds",
    "store_ds_max_mib",
    "autotune",
    "tune_space",
)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One call's shape, as every launcher reads it.

    Attributes:
        max_q_len, max_kv_len: host-side bounds on the query and key lengths (the offsets').
        activation: ``"softmax"`` or a GDPA activation (``reference.ACTIVATIONS``).
        scale: multiplies ``Q K^T``; post_scale: GDPA's factor on ``act(S)`` (1.0 for softmax).
        causal, window, block_size: the mask; ``window=-1`` / ``block_size=0`` when unused.
        q_broadcast: the same queries for every example (layout ``broadcast_q``).
        packing: ``""``, or the packed projection whose gradient the kernels write whole:
            ``"qkv"`` (rotary self-attention, ``[T, 3, H, D]``) or ``"kv"`` (``[T, 2, H, D]``).
        rotary: Q and K are rotated; their gradients are turned back as they are stored.
        settings: the kernel settings of this call (required: see the module's note on Dynamo).
    """

    max_q_len: int
    max_kv_len: int
    activation: str
    scale: float
    post_scale: float = 1.0
    causal: bool = False
    window: int = -1
    block_size: int = 0
    q_broadcast: bool = False
    packing: str = ""
    rotary: bool = False
    settings: KernelSettings = dataclasses.field(kw_only=True)

    @property
    def mask(self) -> tuple[bool, int, int, bool]:
        """``(causal, window, block_size, q_broadcast)``, as ``triton_common.unmasked`` takes them."""
        return self.causal, self.window, self.block_size, self.q_broadcast

    def op_args(self) -> tuple[list[int], str, list[float]]:
        """``(sizes, activation, scales)`` of a registered op: ``sizes`` = ``[max_q_len,
        max_kv_len, causal, window, block_size, q_broadcast]`` and the settings the launchers
        read as ints (``_LAUNCH_SETTINGS``), ``scales`` = ``[scale, post_scale]``."""
        s = self.settings  # (spelled out, in _LAUNCH_SETTINGS' order: Dynamo traces this)
        return (
            [
                self.max_q_len,
                self.max_kv_len,
                int(self.causal),
                self.window,
                self.block_size,
                int(self.q_broadcast),
                int(s.packed_act),
                int(s.gluon),
                s.gluon_min_q_len,
                int(s.gluon_bwd),
                int(s.store_ds),
                s.store_ds_max_mib,
                int(s.autotune),
                int(s.tune_space == "wide"),
            ],
            self.activation,
            [self.scale, self.post_scale],
        )

    @classmethod
    def of_op(cls, sizes, activation: str, scales, packing: str = "", rotary: bool = False) -> AttentionCall:
        """The call that :meth:`op_args` packed (``packing`` and ``rotary``: the op's own)."""
        key = (tuple(sizes), activation, tuple(scales), packing, rotary)
        try:
            return _of_op(*key)
        except TypeError:  # symbolic sizes (torch.compile's dynamic shapes) are not hashable
            return _of_op.__wrapped__(*key)

    def backward_scales(self) -> tuple[float, float, float]:
        """``(qk_scale, grad_scale, dv_scale)`` of the backward kernels: softmax's ``S`` in log2
        units; GDPA's activation factors leave out ``unit * scale`` (value) and ``unit``
        (gradient), which these put back."""
        if self.activation == "softmax":
            return self.scale * LOG2E, self.scale, 1.0
        unit = ACT_UNIT[self.activation]
        return self.scale, self.scale * self.post_scale * unit, self.post_scale * unit * self.scale


@functools.lru_cache(maxsize=256)
def _of_op(sizes: tuple, activation: str, scales: tuple, packing: str, rotary: bool) -> AttentionCall:
    max_q_len, max_kv_len, causal, window, block_size, q_broadcast, *launch = sizes
    values = dict(zip(_LAUNCH_SETTINGS, launch))
    if values:
        values = {name: TUNE_SPACES[v] if name == "tune_space" else type(getattr(KernelSettings, name))(v)
                  for name, v in values.items()}  # fmt: skip
    return AttentionCall(
        max_q_len,
        max_kv_len,
        activation,
        scales[0],
        scales[1],
        bool(causal),
        window,
        block_size,
        bool(q_broadcast),
        packing,
        rotary,
        settings=KernelSettings(**values),
    )


def gluon_verified(kernel: str) -> bool:
    """Whether this Triton release is in ``GLUON_VERIFIED[kernel]``."""
    return _allow_unverified or _release_verified(kernel, ".".join(triton.__version__.split(".")[:2]))


@functools.cache
def _release_verified(kernel: str, release: str) -> bool:
    import logging

    if release in GLUON_VERIFIED[kernel]:
        return True
    logging.getLogger(__name__).info(
        "the Gluon kernel %s has not passed the GPU gate on Triton %s (only on %s): the Triton kernels run instead",
        kernel,
        release,
        ", ".join(GLUON_VERIFIED[kernel]) or "none yet",
    )
    return False


@dataclasses.dataclass(frozen=True)
class Operands:
    """What the kernels' choice needs to know of a call's tensors and of the machine.

    Attributes:
        dtype: q's (and k's and v's) dtype; element_size: its bytes.
        cuda: on a CUDA device; arch: its compute capability (or the one a tool compiles for;
            ``(0, 0)`` off CUDA).
        num_heads, head_dim: of q; kv_rows: rows of k and v; num_rows: output rows.
        num_batches: examples.
        real: real tensors, not ones torch.compile traces (the Gluon launches need real ones).
        addressable: q, k and v of one dtype, each addressable by a 2-D TMA descriptor over
            ``[rows, H * D]`` (``gluon_common.addressable``).
        grads_addressable: the backward's dO, dK and dV likewise (False in a forward).
        interpret: Triton's interpreter (``TRITON_INTERPRET=1``): no Gluon, no bf16x2.
        gluon_fwd_verified, gluon_dkdv_verified, gluon_softmax_fwd_verified: this Triton release
            passed the gate with each Gluon kernel (``GLUON_VERIFIED``; the last is asked of
            softmax calls only).
    """

    dtype: torch.dtype
    element_size: int
    cuda: bool
    arch: tuple[int, int]
    num_heads: int
    head_dim: int
    kv_rows: int
    num_rows: int
    num_batches: int
    real: bool
    addressable: bool
    grads_addressable: bool = False
    interpret: bool = False
    gluon_fwd_verified: bool = False
    gluon_dkdv_verified: bool = False
    gluon_softmax_fwd_verified: bool = False

    @classmethod
    def of(cls, q, k, v, kv_offsets, call: AttentionCall, arch=None, grads=()) -> Operands:
        """The facts of ``q, k, v`` (as the launchers get them) and, for the backward, of
        ``grads`` (dO, dK, dV); ``arch`` stands in for q's device's capability."""
        num_batches = kv_offsets.numel() - 1
        cuda = q.is_cuda
        gluon_possible = cuda and not INTERPRET
        real = False
        if gluon_possible:
            from kernels.jagged_attention import gluon_common

            real = gluon_common.real(q, k, v)  # (a traced tensor has no address to look at)
        return cls(
            dtype=q.dtype,
            element_size=q.element_size(),
            cuda=cuda,
            arch=arch or (device_capability(q) if cuda else (0, 0)),
            num_heads=q.shape[1],
            head_dim=q.shape[2],
            kv_rows=k.shape[0],
            num_rows=num_batches * q.shape[0] if call.q_broadcast else q.shape[0],
            num_batches=num_batches,
            real=real,
            addressable=real and all(t.dtype == q.dtype and gluon_common.addressable(t) for t in (q, k, v)),
            grads_addressable=real and bool(grads) and all(gluon_common.addressable(t) for t in grads),
            interpret=INTERPRET,
            gluon_fwd_verified=gluon_possible and gluon_verified("gluon_fwd"),
            gluon_dkdv_verified=gluon_possible and bool(grads) and gluon_verified("gluon_dkdv"),
            gluon_softmax_fwd_verified=(
                gluon_possible and not grads and call.activation == "softmax" and gluon_verified("gluon_softmax_fwd")
            ),
        )

    @property
    def empty(self) -> bool:
        """Nothing to compute: the Triton launchers write zeros."""
        return self.num_rows == 0 or self.num_heads == 0 or self.num_batches == 0


def packed_act(call: AttentionCall, operands: Operands) -> bool:
    """Whether the kernels take the bf16x2 activation path: ``settings.packed_act``, bf16 silu or
    fast_gelu, on a GPU with the sm_90 bf16x2 instructions (Hopper or newer), not interpreted."""
    return (
        call.settings.packed_act
        and not operands.interpret
        and operands.dtype == torch.bfloat16
        and call.activation in ("silu", "fast_gelu")
        and operands.arch[0] >= 9
    )


def _gluon_tensors(operands: Operands) -> bool:
    """``gluon_common.tensors_apply``: real 16-bit CUDA tensors on an sm_90 GPU, head dim 64 or
    128, addressable by the kernels' descriptors."""
    from kernels.jagged_attention.gluon_common import HEAD_DIMS

    return (
        operands.cuda
        and not operands.interpret
        and operands.dtype in (torch.bfloat16, torch.float16)
        and operands.real
        and operands.arch[0] == 9
        and operands.head_dim in HEAD_DIMS
        and operands.addressable
    )


def choose_forward(call: AttentionCall, operands: Operands) -> str:
    """``"gluon"``: the Gluon forward (``settings.gluon``, no mask, jagged queries, ``max_q_len >
    settings.gluon_min_q_len``, its tensors as :func:`_gluon_tensors` asks): GDPA's on a verified
    Triton release, softmax's on a verified one (none yet, ``GLUON_VERIFIED``); else ``"triton"``."""
    softmax = call.activation == "softmax"
    gluon = (  # (in this order: a traced length is compared, and guarded, where it was before)
        not operands.empty
        and call.settings.gluon
        and (not softmax or (unmasked(*call.mask) and operands.gluon_softmax_fwd_verified))
        and call.max_q_len > call.settings.gluon_min_q_len
        and (softmax or (unmasked_pointwise(call.activation, *call.mask) and operands.gluon_fwd_verified))
        and _gluon_tensors(operands)
    )
    return "gluon" if gluon else "triton"


def store_ds_row(max_q_len: int) -> int:
    """Elements per row of the stored-dS buffer: ``max_q_len`` rounded up to a multiple of 128,
    which every BLOCK_M divides, so that whole query blocks fit (``_bwd_dq_from_ds_kernel``)."""
    return triton.cdiv(max(int(max_q_len), 1), 128) * 128


def store_ds_bytes(call: AttentionCall, operands: Operands) -> int:
    """Bytes of the stored-dS buffer, ``H x (K/V rows) x store_ds_row(max_q_len)`` elements, or 0
    where the stored-dS backward does not apply (a causal, window or block mask, whose dK/dV
    kernel skips tiles; a broadcast Q)."""
    if not unmasked(*call.mask):
        return 0
    return operands.num_heads * operands.kv_rows * store_ds_row(call.max_q_len) * operands.element_size


@dataclasses.dataclass(frozen=True)
class Backward:
    """The backward's kernels: ``dkdv`` ``"gluon"`` or ``"triton"``; ``store_ds``: the dK/dV kernel
    stores dS and dQ = dS K reads it (else dQ recomputes S and dP)."""

    dkdv: str
    store_ds: bool


def choose_backward(call: AttentionCall, operands: Operands) -> Backward:
    """The stored-dS backward where ``settings.store_ds`` and its buffer is under the cap
    (:func:`store_ds_bytes`, ``settings.store_ds_max_mib``); its dK/dV in Gluon
    (``settings.gluon_bwd``) for bf16 silu / fast_gelu on the bf16x2 path, unrotated, into
    separate dK and dV, its tensors and dO, dK, dV as the Gluon kernels ask, on a verified release."""
    settings = call.settings
    store_ds = settings.store_ds and 0 < store_ds_bytes(call, operands) <= settings.store_ds_max_bytes
    gluon = (
        store_ds
        and settings.gluon_bwd
        and packed_act(call, operands)
        and not call.rotary
        and not call.packing
        and unmasked_pointwise(call.activation, *call.mask)
        and operands.gluon_dkdv_verified
        and _gluon_tensors(operands)
        and operands.grads_addressable
    )
    return Backward("gluon" if gluon else "triton", store_ds)
