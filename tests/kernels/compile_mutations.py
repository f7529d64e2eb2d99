"""Which tensors does torch.compile think each Triton kernel writes? ``python tests/kernels/compile_mutations.py``

Inductor decides from the kernel's Triton IR which of a user kernel's tensor arguments it mutates
(``identify_mutated_tensors``) and clones every such argument that it may not write in place, e.g.
a graph input such as a block's ``offsets``. A pointer passed to a ``@triton.jit`` helper whose
result feeds a store address counts as written, so such a helper once made Inductor clone the
offsets of every attention call; under dynamic shapes (evaluation, with a batch size unlike
training's) torch 2.11 then failed to compile the clone (``decompose_triton_kernel_wrapper_functional``).

This runs the real launchers on CPU tensors (no GPU: Triton's frontend runs on the CPU) for every
kernel and mode and checks that only each kernel's outputs count as written, and that each written
tensor is a whole buffer: torch 2.11 clones a written view with an offset or gaps (functionalization's
``clone_preserve_strides``) reading past the buffer Inductor sized to the view (pytorch#192226; an
illegal address on an H200 when the rotary self-attention's gradients were first written into
views of one buffer), and that no other argument names a written tensor's buffer
(functionalization clones each written argument on its own, so writes through another could be
lost, and a stand-in argument aliasing a written one could keep Inductor from writing it in
place). The CPU test tier runs it in a subprocess, since Triton's interpreter setting is fixed at
import.
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ["GEM_KERNELS_AUTOTUNE"] = "1"  # the launchers take the autotuned kernels, as on a GPU

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from kernels.attention_pooling import _backward as pooling_backward  # noqa: E402
from kernels.attention_pooling import _forward as pooling_forward  # noqa: E402
from kernels.jagged_attention import settings  # noqa: E402
from kernels.jagged_attention.batch_order import batch_order  # noqa: E402
from kernels.jagged_attention.inputs import make_inputs  # noqa: E402
from kernels.jagged_attention.testing import AttentionCall, launch_backward, launch_forward  # noqa: E402
from kernels.rotary import _backward as rotary_backward  # noqa: E402
from kernels.rotary import _forward as rotary_forward  # noqa: E402
from kernels.rotary import rotate_qk  # noqa: E402

OUTPUTS = {
    "_batch_order_kernel": {"ORDER"},
    "_fwd_kernel": {"O", "LSE"},
    "_bwd_preprocess_kernel": {"DELTA"},
    "_bwd_dkdv_kernel": {"DK", "DV", "DS"},
    "_bwd_dq_kernel": {"DQ"},
    "_bwd_dq_from_ds_kernel": {"DQ"},
    "_rotary_kernel": {"Q", "K", "V"},  # the forward; the backward writes QKV (set below)
    "_pool_fwd_kernel": {"OUT", "LSE"},
    "_pool_bwd_kernel": {"DX", "DS"},
}


def written_tensors(kernel, named: dict) -> set[str]:
    """The tensor arguments Inductor's Triton IR analysis counts as written (a private API, which
    torch 2.11 calls identify_mutated_tensors and torch 2.13 identify_accessed_tensors)."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    if hasattr(wrap, "identify_mutated_tensors"):
        return set(wrap.identify_mutated_tensors(kernel, named, {}))
    accesses = wrap.identify_accessed_tensors(kernel, named, {})
    return {dep.name for dep in accesses.read_writes.writes if isinstance(named.get(dep.name), torch.Tensor)}


class _Target:
    """The part of Triton's active driver that Inductor's IR analysis asks for: an sm_90 target."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def checked(kernel):
    """A launcher ``wrap`` that launches nothing and checks the kernel's analysed writes."""
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel

    class Grid:
        def __getitem__(self, grid):
            def check(*args, **kwargs):
                named = dict(zip(fn.arg_names, args)) | kwargs
                written = written_tensors(kernel, named)
                extra = written - OUTPUTS[fn.__name__]
                assert not extra, f"{fn.__name__}: Inductor would treat inputs {sorted(extra)} as written"
                for name in written:  # no other argument names a written tensor's buffer
                    buffer = named[name].untyped_storage().data_ptr()
                    sharing = [
                        other
                        for other, t in named.items()
                        if other != name and isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == buffer
                    ]
                    assert not sharing, (
                        f"{fn.__name__}: {sharing} share written {name}'s buffer: torch.compile clones each written "
                        "argument on its own (writes through another could be lost) and may not write one in place "
                        "that another argument reads"
                    )
                for name in written:  # a written view must span its whole storage (pytorch#192226)
                    t = named[name]
                    extent = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride())) if t.numel() else 0
                    assert (
                        t.storage_offset() == 0
                        and extent == t.numel() == t.untyped_storage().nbytes() // t.element_size()
                    ), (
                        f"{fn.__name__}: {name} is a view (offset {t.storage_offset()}, {t.numel()} of "
                        f"{t.untyped_storage().nbytes() // t.element_size()} elements): torch.compile would clone it "
                        "out of bounds; pass its buffer and an offset"
                    )
                print(f"{fn.__name__}: writes {sorted(written)}", flush=True)

            return check

    return Grid()


def main() -> None:
    triton.runtime.driver.set_active(_Target())
    order = torch.arange(3, dtype=torch.int32)
    for layout in ("jagged", "dense_kv", "broadcast_q"):
        inputs = make_inputs(
            [5, 0, 9],
            [7, 3, 0],
            num_heads=2,
            head_dim=64,
            layout=layout,
            num_dense_kv=4,
            num_queries=3,
            dtype=torch.bfloat16,
        )
        q, k, v = inputs.tensors()
        q_offsets, kv_offsets = inputs.q_offsets, inputs.kv_offsets
        if kv_offsets is None:  # as the dispatcher views them
            k, v = k.flatten(0, 1), v.flatten(0, 1)
            kv_offsets = torch.arange(4, dtype=torch.int32) * 4
        if q_offsets is None:
            q_offsets = torch.arange(4, dtype=torch.int32) * q.shape[0]
        max_q_len = q.shape[0] if layout == "broadcast_q" else inputs.max_q_len
        max_kv_len = 4 if layout == "dense_kv" else inputs.max_kv_len
        batch_order(q_offsets, kv_offsets, wrap=checked)
        for activation, causal, window, store_ds in (
            ("softmax", False, -1, True),
            ("softmax", True, 2, False),
            ("silu", False, -1, True),
            ("fast_gelu", False, -1, False),
        ):
            if layout != "jagged" and (causal or window >= 0):
                continue
            config = settings.current().replace(store_ds=store_ds)
            call = AttentionCall(
                max_q_len,
                max_kv_len,
                activation,
                0.125,
                1.0 if activation == "softmax" else 0.25,
                causal,
                window,
                0,
                layout == "broadcast_q",
                settings=config,
            )
            common = (q_offsets, kv_offsets, order, call)
            out, lse = launch_forward(q, k, v, *common, wrap=checked)
            launch_backward(torch.randn_like(out), q, k, v, out, lse, *common, wrap=checked)
            if activation == "softmax" and layout != "dense_kv":  # the packed-gradient backwards:
                # rotary self-attention's (d qkv; Q, K and V on the same rows, Q and K rotated) and
                # packed_kv_attention's (d kv, with broadcast queries)
                self_attention = layout == "jagged"
                rows, k_in, v_in = (q, q, q) if self_attention else (k, k, v)
                packed_grad = torch.empty(rows.shape[0], 3 if self_attention else 2, *rows.shape[1:], dtype=q.dtype)
                launch_backward(
                    torch.randn_like(out),
                    q,
                    k_in,
                    v_in,
                    out,
                    lse,
                    q_offsets,
                    kv_offsets,
                    order,
                    dataclasses.replace(call, packing="qkv" if self_attention else "kv", rotary=self_attention),
                    wrap=checked,
                    packed_grad=packed_grad,
                    rope=torch.randn(2, q.shape[0], 32).unbind(0) if self_attention else None,
                )
    qkv = torch.randn(6, 3, 2, 64, dtype=torch.bfloat16)
    cos, sin = torch.randn(2, 6, 32).unbind(0)
    rotary_forward(qkv, cos, sin, wrap=checked)
    rotate_qk(qkv, cos, sin, wrap=checked)  # rotary self-attention's forward: Q and K only
    OUTPUTS["_rotary_kernel"] = {"QKV"}
    rotary_backward(*qkv.unbind(1), cos, sin, wrap=checked)
    x, a = torch.randn(14, 64, dtype=torch.bfloat16), torch.randn(64, 8, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 5, 5, 14])
    out, lse = pooling_forward(x, a, offsets, 9, wrap=checked)
    pooling_backward(torch.randn_like(out), x, a, out, lse, offsets, 9, wrap=checked)
    print("every kernel writes only its outputs")


if __name__ == "__main__":
    sys.exit(main())
