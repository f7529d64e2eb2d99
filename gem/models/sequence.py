"""Sequence building blocks over jagged event streams, on ``kernels.jagged_attention`` (pooling:
``kernels.attention_pooling``).

Every block reads and writes jagged rows ``values [T, D]`` + ``offsets [B+1]`` + a host-side
``max_len`` (kernels/jagged.py); nothing here pads. Each block also states its forward FLOPs
(``flops``), counted on the true jagged lengths, for gem/train/flops.py.

Example, two histories of lengths 2 and 0 with two CLS tokens prepended::

    #                 i = 0              i = 1     <- batch
    # before          [h0 h1]            []           offsets [0, 2, 2]
    # after           [c0 c1 h0 h1]      [c0' c1']    offsets [0, 4, 6]
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention_pooling import attention_pooling
from kernels.generated_weights import generated_weights_backward
from kernels.jagged import jagged_positions
from kernels.jagged_attention import jagged_attention, packed_kv_attention, rotary_self_attention
from kernels.jagged_attention.settings import KernelSettings
from kernels.jagged_attention.settings import current as current_kernel_settings


def linear_flops(rows: int, in_dim: int, out_dim: int) -> int:
    """Forward FLOPs of ``[rows, in_dim] @ [in_dim, out_dim]`` (bias adds are not counted, as in FlopCounterMode)."""
    return 2 * rows * in_dim * out_dim


def attention_flops(num_heads: int, head_dim: int, pairs: int) -> int:
    """Forward FLOPs of attention over ``pairs`` visible (query, key) pairs: ``Q K^T`` and ``P V``."""
    return 4 * num_heads * head_dim * pairs


def self_attention_pairs(lengths: torch.Tensor, window: int | None = None, causal: bool = False) -> int:
    """Visible (query, key) pairs of self-attention with an optional sliding window, in closed form
    per example (O(B), cheap enough for every training step). Non-causal: ``L^2`` if
    ``L <= window + 1`` else ``L (2 window + 1) - window (window + 1)``; causal: ``L (L + 1) / 2``
    if ``L <= window + 1`` else ``(window + 1) (L - window / 2)``."""
    lengths = lengths.long()
    full = lengths * (lengths + 1) // 2 if causal else lengths * lengths
    if window is None:
        return int(full.sum())
    if causal:
        banded = (window + 1) * lengths - window * (window + 1) // 2
    else:
        banded = lengths * (2 * window + 1) - window * (window + 1)
    return int(torch.where(lengths <= window + 1, full, banded).sum())


def attention_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in one dtype for the attention op: autocast's (bf16 / fp16) when it is on,
    else the first tensor's (LayerNorm outputs and parameters stay fp32 under autocast)."""
    device = tensors[0].device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensors[0].dtype
    return tuple(t.to(dtype) for t in tensors)


def rotary_tables(
    offsets: torch.Tensor, total: int, head_dim: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` float32 ``[T, D/2]`` of the rotary embedding at every row's position in
    its own sequence (0 = oldest), for :func:`kernels.jagged_attention.rotary_self_attention`.
    The tables depend only on the offsets: computed once per event stream and batch, every layer
    reuses them."""
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, device=offsets.device, dtype=torch.float32) / half)
    angles = jagged_positions(offsets, total).to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles.cos(), angles.sin()


class SelfGate(nn.Module):
    """``y = x * sigmoid(W x + b)``: the gating of InterFormer's Cross Arch, on the last dim."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.proj(x))

    def flops(self, rows: int) -> int:
        return linear_flops(rows, self.proj.in_features, self.proj.out_features)


class JaggedSelfAttention(nn.Module):
    """Pre-norm multi-head softmax self-attention over jagged rows with rotary positions and an
    optional sliding ``window``, residual: ``x + drop(W_o attn(rope(q), rope(k), v))``.

    Args:
        dim: row width, ``num_heads * head_dim``.
        window: each row sees rows at most ``window`` positions away (None: the whole sequence).
        causal: each row sees only itself and earlier rows (next-event prediction).
        backend: ``kernels.jagged_attention`` backend (None: Triton on CUDA, reference elsewhere).
        dropout: on the attention's output before the residual add (0: none).
        bias: biases on the Q/K/V and output projections (False: none, which spares the backward
            a sum over every row of their gradients).
        kernel_settings: the attention kernels' settings (None: the process default); the
            trainer hands the run's to every attention module (:func:`use_kernel_settings`).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window: int | None = None,
        backend: str | None = None,
        causal: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        kernel_settings: KernelSettings | None = None,
    ) -> None:
        super().__init__()
        if dim % num_heads or (dim // num_heads) % 2:
            raise ValueError(f"model.streams: width {dim} must split into {num_heads} heads of an even head_dim")
        self.num_heads, self.head_dim, self.window, self.backend = num_heads, dim // num_heads, window, backend
        self.causal, self.kernel_settings = causal, kernel_settings
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.out = nn.Linear(dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout) if dropout else None

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``rope``: the stream's :func:`rotary_tables` (computed here when None)."""
        if rope is None:
            rope = rotary_tables(offsets, x.shape[0], self.head_dim)
        (qkv,) = attention_inputs(self.qkv(self.norm(x)).view(-1, 3, self.num_heads, self.head_dim))
        o = rotary_self_attention(  # [T, H, D]
            qkv,
            *rope,
            offsets,
            max_len,
            causal=self.causal,
            window=self.window,
            backend=self.backend,
            settings=self.kernel_settings,
        )
        o = self.out(o.reshape(x.shape))
        return x + (o if self.dropout is None else self.dropout(o))

    def flops(self, lengths: torch.Tensor, max_len: int, padded: bool) -> int:
        dim = self.num_heads * self.head_dim
        rows = int(lengths.sum())
        if padded:  # as the reference computes it: every example padded to max_len, masks applied after
            pairs = lengths.numel() * max_len * max_len
        else:
            pairs = self_attention_pairs(lengths, self.window, self.causal)
        return (
            linear_flops(rows, dim, 3 * dim)
            + linear_flops(rows, dim, dim)
            + attention_flops(self.num_heads, self.head_dim, pairs)
        )


def generate_weights(
    shared: torch.Tensor,
    mix: torch.Tensor,
    generated: torch.Tensor,
    backend: str | None = None,
    settings: KernelSettings | None = None,
) -> torch.Tensor:
    """``shared + mix @ generated_b`` for every example ``b`` (``[N, C] + [N, N_s] @ [B, N_s, C]``
    -> ``[B, N, C]``, in ``generated``'s dtype): the personalized FFN's weights.

    The product's inner dimension is the few summary tokens, so the result's write bounds it.
    Eager: ``baddbmm``, which copies ``shared`` into the output and then adds a GEMM's result
    to it. Compiled: :class:`_GeneratedWeights`, a forward that Inductor fuses into one kernel
    that writes the result once, and a backward that reads the gradient once for all three
    gradients with the Triton backend (``backend``: a ``kernels.jagged_attention`` backend, None:
    Triton on CUDA; ``kernels.generated_weights``) unless the kernels' ``generated_weights``
    setting is off (``settings``; None: the process default), else three times (a sum and two GEMMs)."""
    if torch.compiler.is_compiling():
        triton_backend = backend == "triton" or (backend is None and generated.is_cuda)
        settings = current_kernel_settings() if settings is None else settings
        kernel = triton_backend and settings.generated_weights
        return _GeneratedWeights.apply(shared, mix, generated, kernel)
    return torch.baddbmm(shared, mix.expand(generated.shape[0], -1, -1), generated)


class _GeneratedWeights(torch.autograd.Function):
    """Forward: the broadcast product summed over ``N_s`` (Inductor unrolls so short a sum, and
    the ``[B, N, N_s, C]`` product is never written), in float32, rounded once to ``generated``'s
    dtype. Backward: ``kernels.generated_weights``, with ``kernel`` its Triton kernel (one read of
    the gradient), else its reference, reductions and GEMMs over the gradient (cuBLAS reads it
    faster than the reductions Inductor derives from the forward's broadcast)."""

    @staticmethod
    def forward(ctx, shared, mix, generated, kernel):
        ctx.save_for_backward(mix, generated)
        ctx.kernel = kernel
        product = (mix.unsqueeze(-1) * generated.unsqueeze(1)).sum(2)
        return (shared + product).to(generated.dtype)

    @staticmethod
    def backward(ctx, grad):
        mix, generated = ctx.saved_tensors
        backend = "triton" if ctx.kernel else "reference"
        grad_shared, grad_mix, grad_generated = generated_weights_backward(grad, mix, generated, backend)
        return grad_shared.to(mix.dtype), grad_mix, grad_generated, None


class PersonalizedFFN(nn.Module):
    """The personalized FFN of InterFormer / Kunlun in its GDPA form, residual, pre-norm.

    Each example ``b`` gets its own two-layer FFN whose weights are generated from its
    non-sequence summary ``xs_b [N_s, d]``: ``[K_b; V_b] = W_0 + mix(xs_b W) [N, H, D]`` (``W_0``
    the shared weights, ``W`` a projection to the row width, ``mix`` a learned map from the
    ``N_s`` summary tokens to the ``N`` hidden units). Its sequence rows go through
    ``act(x K_b^T / sqrt(D)) V_b / N`` per head, which is attention of the jagged rows against a
    dense per-example K/V with a pointwise activation (GDPA): one ``kernels.jagged_attention``
    call with ``kv_offsets=None``. ``post_scale = 1 / N`` is fixed, so the result does not
    depend on the batch.

    Args:
        dim: row width ``H * D``; summary_dim / num_summary: the summary's token width and count.
        num_kv: ``N``, the FFN's hidden width per head.
        bias: a bias on the output projection (False: none).
        kernel_settings: as :class:`JaggedSelfAttention`'s.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        summary_dim: int,
        num_summary: int,
        num_kv: int,
        activation: str = "silu",
        backend: str | None = None,
        bias: bool = True,
        kernel_settings: KernelSettings | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv = num_heads, dim // num_heads, num_kv
        self.activation, self.backend, self.kernel_settings = activation, backend, kernel_settings
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(summary_dim, 2 * dim, bias=False)
        self.mix = nn.Linear(num_summary, num_kv, bias=False)
        self.shared = nn.Parameter(torch.empty(num_kv, 2 * dim))  # W_0
        self.out = nn.Linear(dim, dim, bias=bias)

    def init_own_parameters(self) -> None:
        nn.init.normal_(self.shared, std=self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int, summary: torch.Tensor) -> torch.Tensor:
        num_seqs, width = summary.shape[0], self.num_heads * self.head_dim
        generated = self.proj(summary)  # [B, N_s, 2*H*D]
        # K_b = W_0 + M (xs_b W) per example, K and V apart, each written once in its final layout
        k, v = (
            generate_weights(
                self.shared[:, part], self.mix.weight, generated[..., part], self.backend, self.kernel_settings
            ).view(num_seqs, self.num_kv, self.num_heads, self.head_dim)
            for part in (slice(0, width), slice(width, None))
        )  # [B, N, H, D] each
        h, k, v = attention_inputs(self.norm(x).view(-1, self.num_heads, self.head_dim), k, v)
        o = jagged_attention(
            h,
            k,
            v,
            offsets,
            None,
            max_len,
            None,
            activation=self.activation,
            post_scale=1.0 / self.num_kv,
            backend=self.backend,
            settings=self.kernel_settings,
        )
        return x + self.out(o.reshape(x.shape))

    def flops(self, lengths: torch.Tensor, max_len: int, padded: bool) -> int:
        dim = self.num_heads * self.head_dim
        num_seqs, rows = lengths.numel(), int(lengths.sum())
        num_summary = self.mix.in_features
        pairs = (num_seqs * max_len if padded else rows) * self.num_kv
        return (
            linear_flops(num_seqs * num_summary, self.proj.in_features, 2 * dim)
            + linear_flops(num_seqs * 2 * dim, num_summary, self.num_kv)
            + linear_flops(rows, dim, dim)
            + attention_flops(self.num_heads, self.head_dim, pairs)
        )


class PoolingByAttention(nn.Module):
    """``num_queries`` learned queries attend (softmax) to each example's rows: ``[B, num_queries, dim]``.

    PMA in InterFormer, seed pooling in Kunlun: per head, ``softmax(q K^T / sqrt(D)) V`` with
    ``K, V = x W_k^T + b_k, x W_v^T + b_v`` (``kv``). Two ways to compute it, same function and
    parameters; an empty sequence pools to zeros:

    * rows projected: K and V of every row (one ``[T, dim] x [dim, 2 dim]`` GEMM), then the
      attention kernel with a broadcast Q (``kernels.jagged_attention.packed_kv_attention``, which
      writes the gradient of the packed K/V whole);
    * rows pooled as they are (kernels.attention_pooling): the scores are ``x . (W_k^T q) / sqrt(D)``
      (``b_k`` shifts every score of a query alike, which the softmax ignores), and ``W_v``, ``b_v``
      apply to the pooled rows (the weights sum to one): ``4 T dim N H`` FLOPs instead of
      ``4 T dim^2``. Taken when ``N H < dim / 4`` (``pool_rows=None``; True / False force a
      path): on an H200 at width 512 it took a third of the projected path's time for 16 columns
      (InterFormer's 4 x 4) and about the same for 128 (Kunlun's 32 seeds x 4 heads), where its
      kernels run far below the GEMMs' rate.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_queries: int,
        backend: str | None = None,
        pool_rows: bool | None = None,
        kernel_settings: KernelSettings | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.backend = num_heads, dim // num_heads, backend
        self.kernel_settings = kernel_settings  # (as JaggedSelfAttention's)
        self.queries = nn.Parameter(torch.empty(num_queries, num_heads, self.head_dim))
        self.kv = nn.Linear(dim, 2 * dim)
        self.pool_rows = 4 * num_queries * num_heads < dim if pool_rows is None else pool_rows

    def init_own_parameters(self) -> None:
        nn.init.normal_(self.queries, std=self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        if not self.pool_rows:
            q, kv = attention_inputs(self.queries, self.kv(x).view(-1, 2, self.num_heads, self.head_dim))
            out = packed_kv_attention(q, kv, offsets, max_len, backend=self.backend, settings=self.kernel_settings)
            return out.flatten(2)  # [B, N, H*D]
        num_queries, dim = self.queries.shape[0], x.shape[1]
        w_k, w_v = self.kv.weight.view(2, self.num_heads, self.head_dim, dim).unbind(0)  # [H, D, dim] each
        b_v = self.kv.bias.view(2, self.num_heads, self.head_dim)[1]
        a = torch.einsum("nhd,hdc->cnh", self.queries, w_k).reshape(dim, -1) * self.head_dim**-0.5  # [dim, N*H]
        x, a = attention_inputs(x, a)
        pooled = attention_pooling(x, a, offsets, max_len, backend=self.backend)  # [B, N*H, dim]
        out = torch.einsum("bnhc,hdc->bnhd", pooled.view(-1, num_queries, self.num_heads, dim), w_v)
        has_rows = (offsets[1:] > offsets[:-1]).to(out.dtype)[:, None, None, None]
        return (out + b_v * has_rows).flatten(2)

    def flops(self, lengths: torch.Tensor, max_len: int, padded: bool) -> int:
        dim = self.num_heads * self.head_dim
        num_queries = self.queries.shape[0]
        keys = lengths.numel() * max_len if padded else int(lengths.sum())
        if not self.pool_rows:
            return linear_flops(int(lengths.sum()), dim, 2 * dim) + attention_flops(
                self.num_heads, self.head_dim, num_queries * keys
            )
        columns = num_queries * self.num_heads
        return (
            linear_flops(columns, self.head_dim, dim)  # the queries through W_k
            + 4 * keys * dim * columns  # scores and weighted sum
            + linear_flops(lengths.numel() * columns, dim, self.head_dim)  # W_v on the pooled rows
        )


ATTENTION_MODULES = (JaggedSelfAttention, PersonalizedFFN, PoolingByAttention)


def use_kernel_settings(model: nn.Module, settings: KernelSettings | None) -> int:
    """Hands ``settings`` (the attention kernels' settings; None: the process default) to every
    attention module of a built model (:data:`ATTENTION_MODULES`), which passes them to each of its
    calls; before ``torch.compile``, which traces them as constants. Returns how many took them."""
    modules = [m for m in model.modules() if isinstance(m, ATTENTION_MODULES)]
    for module in modules:
        module.kernel_settings = settings
    return len(modules)
