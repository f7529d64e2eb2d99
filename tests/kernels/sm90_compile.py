"""Compiles the Triton kernels for sm_90 (Hopper) without a GPU: ``python tests/kernels/sm90_compile.py``.

Runs the real launchers on CPU tensors with a ``wrap`` that compiles each kernel to a cubin
(Triton frontend, PTX and ptxas, all CPU-side) instead of launching it, for an sm_90 device
(``arch=(9, 0)``: the bf16x2 activation path where it applies). The CPU test tier runs it in a
subprocess (the interpreter's settings are fixed at import time), so the inline PTX of the
GPU-only paths is checked in CI.

Autotuned kernels compile their first config, and the forward's LATE_PV config where it applies;
the backward also with the stored-dS kernels (``store_ds``).
The pooling kernels (``kernels.attention_pooling``) compile at width 512 for 16 and 128 columns.
Last, the Gluon forward (``gluon_fwd.py``: inline PTX, TMA, warp specialization) for every
pointwise activation and for softmax, whose cubins must not spill, and the Gluon dK/dV kernel (bf16 silu and
fast_gelu), whose cubins may spill at most ``GLUON_DKDV_STACK`` bytes per thread.
``python tests/kernels/sm90_compile.py --resources [activation ...]`` compiles every autotune
config instead and prints each one's registers and spill (stack) bytes per thread,
read from the cubin with the cuobjdump that ships with Triton; set GEM_KERNELS_TUNE_SPACE=wide for
the wide list.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["GEM_KERNELS_AUTOTUNE"] = "1"  # the launchers take the autotuned kernels (see compile_only)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from kernels.attention_pooling import _backward as pooling_backward  # noqa: E402
from kernels.attention_pooling import _forward as pooling_forward  # noqa: E402
from kernels.jagged_attention import gluon_bwd, gluon_fwd, settings, testing  # noqa: E402
from kernels.jagged_attention.autotune import late_pv_applies  # noqa: E402
from kernels.jagged_attention.batch_order import batch_order  # noqa: E402
from kernels.jagged_attention.generated_kv import generated_kv_backward, generated_kv_forward  # noqa: E402
from kernels.jagged_attention.inputs import make_inputs  # noqa: E402
from kernels.rotary import _backward as rotary_backward  # noqa: E402
from kernels.rotary import _forward as rotary_forward  # noqa: E402
from kernels.rotary import rotate_qk  # noqa: E402

HOPPER = (9, 0)

TARGET = GPUTarget("cuda", 90, 32)
# Spill bytes per thread allowed in the Gluon dK/dV kernel: a few registers per step kept in local
# memory (16-32 with Triton 3.6, 24-32 with 3.7).
GLUON_DKDV_STACK = 32
RESOURCES = False  # --resources: every autotune config, with registers and spills (set in main)
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32"}


def _signature(fn, args, kwargs, float_type):
    """(signature, constexprs, attrs) of a launch, in the form ASTSource takes, specialized as
    Triton's launcher does: pointers and integers divisible by 16 (but those the kernel marks
    do_not_specialize) carry ``tt.divisibility`` 16, without which loads don't vectorize and
    the software pipeliner leaves every loop unpipelined. Triton's launcher types Python floats
    as fp32, Inductor's (torch.compile) as fp64."""
    values = dict(zip(fn.arg_names, args)) | kwargs
    constexpr_names = {fn.arg_names[i] for i in fn.constexprs}
    unspecialized = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        value = values[name]
        if name in constexpr_names or value is None:  # None: a constexpr, as Triton's launcher types it
            signature[name] = "constexpr"
            constexprs[(index,)] = value
            continue
        if isinstance(value, TensorDescriptor):
            signature[name] = mangle_type(value)
            continue
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            signature[name] = float_type
            aligned = False
        else:
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            aligned = value % 16 == 0 and name not in unspecialized
        if aligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _resources(cubin: bytes) -> str:
    """Registers and spill (stack) bytes per thread of a cubin, from Triton's cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [tool, "--dump-resource-usage", file.name], capture_output=True, text=True, check=True
        ).stdout
    return " ".join(re.findall(r"(?:REG|STACK):\d+", usage)).lower().replace(":", "=")


def compile_only(kernel, float_type="fp32"):
    """A launcher ``wrap``: compiles the kernel (first autotune config; every config with
    ``--resources``) for sm_90, launches nothing."""
    tuned = isinstance(kernel, triton.runtime.Autotuner)
    fn = kernel.fn if tuned else kernel

    class Grid:
        def __getitem__(self, grid):
            def compile_(*args, **kwargs):
                if not tuned:
                    return _compile(fn, args, kwargs, float_type)
                configs = (
                    kernel.configs
                    if RESOURCES
                    else kernel.configs[:1]
                    + [c for c in kernel.configs if c.kwargs.get("LATE_PV") and late_pv_applies(kwargs)]
                )
                for config in configs:
                    _compile(
                        fn,
                        args,
                        kwargs | config.kwargs | dict(num_warps=config.num_warps, num_stages=config.num_stages),
                        float_type,
                    )

            return compile_

    return Grid()


def _compile(fn, args, kwargs, float_type):
    """Compiles one launch for sm_90 and checks its PTX for the paths the flags select."""
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    signature, constexprs, attrs = _signature(fn, args, kwargs, float_type)
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    compiled = triton.compile(source(fn, signature, constexprs, attrs), target=TARGET, options=options)
    assert compiled.asm["cubin"], fn.__name__
    if source is GluonASTSource:
        ptx = compiled.asm["ptx"]
        assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx and "wgmma" in ptx
        assert "cp.async.bulk.tensor.2d.global.shared" in ptx  # TMA stores (out; dK, dV, dS)
        dkdv = fn is gluon_bwd._gdpa_dkdv_kernel
        packed = kwargs.get("PACKED", dkdv)  # the dK/dV kernel runs on bf16x2 only; softmax on neither
        assert ("tanh.approx.bf16x2" in ptx) == packed
        resources = _resources(compiled.asm["cubin"])
        stack = int(re.search(r"stack=(\d+)", resources).group(1))
        # the forwards must not spill
        assert stack <= (GLUON_DKDV_STACK if dkdv else 0), resources
        print(
            f"compiled gluon {fn.__name__} activation={kwargs.get('ACTIVATION', 'softmax')} "
            f"head_dim={kwargs['HEAD_D']} bf16x2={packed} {resources} "
            f"shared={compiled.metadata.shared}",
            flush=True,
        )
        return
    if kwargs.get("PACKED_ACT"):
        assert "tanh.approx.bf16x2" in compiled.asm["ptx"], fn.__name__
    # fp64 scale arguments are converted once; no float64 arithmetic per element
    assert not re.search(r"\b(add|sub|mul|fma|div|max|min)(\.\w+)*\.f64\b", compiled.asm["ptx"]), fn.__name__
    line = (
        f"compiled {fn.__name__} activation={kwargs.get('ACTIVATION')} "
        f"causal={kwargs.get('CAUSAL')} packed={kwargs.get('PACKED_ACT')} "
        f"floats={float_type}"
    )
    if kwargs.get("LATE_PV"):
        line += " late_pv=1"
    if kwargs.get("STORE_DS"):
        line += " store_ds=1"
    if kwargs.get("ROPE"):
        line += " rope=1"
    if RESOURCES:
        tiles = {key: kwargs[key] for key in ("BLOCK_M", "BLOCK_N") if key in kwargs}
        line += f" {tiles} {options} {_resources(compiled.asm['cubin'])} shared={compiled.metadata.shared}"
    print(line, flush=True)


def main() -> None:
    global RESOURCES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--resources",
        action="store_true",
        help="compile every autotune config and print its registers, spill and shared memory bytes",
    )
    parser.add_argument("activations", nargs="*", help="only these activations (default: all four)")
    args = parser.parse_args()
    RESOURCES = args.resources
    recompute = settings.current().replace(store_ds=False)  # the recomputing dQ kernel, but where stated
    stored = recompute.replace(store_ds=True)
    inputs = make_inputs([5, 0, 9], [7, 3, 0], num_heads=2, head_dim=128, dtype=torch.bfloat16)
    q, k, v = inputs.tensors()
    order = torch.arange(3, dtype=torch.int32)
    chosen = args.activations
    for activation in chosen or ("fast_gelu", "silu", "softmax", "gelu"):

        def compile_fwd_bwd(wrap=compile_only, causal=True, config=recompute, activation=activation):
            """Causal runs the kernels' three-loop path (masked diagonal tiles); no mask runs
            their one-loop path (masked loads only)."""
            call = testing.AttentionCall(
                inputs.max_q_len,
                inputs.max_kv_len,
                activation,
                0.088,
                1.0 if activation == "softmax" else 0.1,
                causal,
                settings=config,
            )
            common = (inputs.q_offsets, inputs.kv_offsets, order, call)
            out, lse = testing.launch_forward(q, k, v, *common, wrap=wrap, arch=HOPPER)
            testing.launch_backward(torch.randn_like(out), q, k, v, out, lse, *common, wrap=wrap, arch=HOPPER)

        compile_fwd_bwd()
        if activation != "silu":  # scalars typed as torch.compile passes them, without a mask
            compile_fwd_bwd(functools.partial(compile_only, float_type="fp64"), causal=False)
        if activation in ("fast_gelu", "softmax"):  # the stored-dS backward, without a mask,
            # with scalars as Triton's launcher and Inductor pass them
            compile_fwd_bwd(causal=False, config=stored)
            compile_fwd_bwd(functools.partial(compile_only, float_type="fp64"), causal=False, config=stored)
    batch_order(inputs.q_offsets, inputs.kv_offsets, wrap=compile_only)
    # the rotary kernel, both ways, bf16 at head dim 128 and 96 (a masked half)
    for head_dim in (128, 96):
        qkv = torch.randn(40, 3, 4, head_dim, dtype=torch.bfloat16)
        cos, sin = torch.randn(2, 40, head_dim // 2).unbind(0)
        rotary_forward(qkv, cos, sin, wrap=compile_only)
        rotary_backward(*qkv.unbind(1), cos, sin, wrap=compile_only)
    # rotary self-attention (softmax, head dim 128): Q and K rotated, and the backward's dK and dQ
    # turned back as they are stored into one packed gradient, with dS stored (no mask) and recomputed (causal)
    qkv = torch.randn(q.shape[0], 3, *q.shape[1:], dtype=torch.bfloat16)
    cos, sin = torch.randn(2, q.shape[0], 64).unbind(0)
    rotate_qk(qkv, cos, sin, compile_only)
    for causal, config in ((False, stored), (True, recompute)):
        call = testing.AttentionCall(inputs.max_q_len, inputs.max_q_len, "softmax", 0.088, 1.0, causal, settings=config)
        rotated = dataclasses.replace(call, packing="qkv", rotary=True)
        q_rot, k_rot, v_in = qkv.unbind(1)
        common = (inputs.q_offsets, inputs.q_offsets, order)
        out, lse = testing.launch_forward(q_rot, k_rot, v_in, *common, call, wrap=compile_only, arch=HOPPER)
        testing.launch_backward(
            torch.randn_like(out),
            q_rot,
            k_rot,
            v_in,
            out,
            lse,
            *common,
            rotated,
            wrap=compile_only,
            arch=HOPPER,
            packed_grad=torch.empty_like(qkv),
            rope=(cos, sin),
        )
    # the pooling kernels at gem_base's width with its launch configs: 16 columns (InterFormer's
    # PMA: 64-row backward blocks) and 128 (Kunlun's seeds: every column in one block)
    offsets = torch.tensor([0, 5, 5, 70])
    for cols in (16, 128):
        x, a = torch.randn(70, 512, dtype=torch.bfloat16), torch.randn(512, cols, dtype=torch.bfloat16)
        out, lse = pooling_forward(x, a, offsets, 65, compile_only)
        pooling_backward(torch.randn(3, cols, 512, dtype=torch.bfloat16), x, a, out, lse, offsets, 65, compile_only)
    # float32 inputs: the forward's plain and LATE_PV loops (float32 P)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    testing.launch_forward(
        q32,
        k32,
        v32,
        inputs.q_offsets,
        inputs.kv_offsets,
        order,
        testing.AttentionCall(inputs.max_q_len, inputs.max_kv_len, "gelu", 0.088, 0.1, settings=recompute),
        wrap=compile_only,
        arch=HOPPER,
    )
    # the experimental generated-K/V GDPA forward and backward: bf16 silu (bf16x2) and fast_gelu at
    # gem_base's personalized FFN shapes (4 heads of 128, 256 rows, 4 summary tokens), float32 gelu
    for dtype, activation in ((torch.bfloat16, "silu"), (torch.bfloat16, "fast_gelu"), (torch.float32, "gelu")):
        gen_q = torch.randn(inputs.q_offsets[-1], 4, 128, dtype=dtype)
        w0k, w0v = torch.randn(2, 256, 512).unbind(0)
        gen_k, gen_v = torch.randn(2, 3, 4, 512, dtype=dtype).unbind(0)
        generated = (gen_q, inputs.q_offsets, inputs.max_q_len, w0k, w0v, torch.randn(256, 4), gen_k, gen_v, activation)
        generated_kv_forward(*generated, wrap=compile_only, arch=HOPPER)
        generated_kv_backward(torch.randn_like(gen_q), *generated, wrap=compile_only, arch=HOPPER)
    # the Gluon forward: every pointwise activation in bf16 at head dim 128 (silu and fast_gelu on
    # the bf16x2 path), and fp16 at head dim 64; softmax (its own kernel) in bf16 at 128, fp16 at 64
    cases = [(torch.bfloat16, 128, name) for name in ("silu", "gelu", "fast_gelu", "relu", "identity")]
    cases += [(torch.float16, 64, "fast_gelu"), (torch.bfloat16, 128, "softmax"), (torch.float16, 64, "softmax")]
    for dtype, head_dim, activation in cases:
        inputs = make_inputs([5, 0, 130], [7, 3, 0], num_heads=2, head_dim=head_dim, dtype=dtype)
        q, k, v = inputs.tensors()
        packed = dtype == torch.bfloat16 and activation in ("silu", "fast_gelu")
        lse = torch.empty(2, q.shape[0]) if activation == "softmax" else None
        gluon_fwd.forward(
            q,
            k,
            v,
            torch.empty_like(q),
            inputs.q_offsets,
            inputs.kv_offsets,
            order,
            inputs.max_q_len,
            testing.ACTIVATION_CODES[activation],
            0.088,
            0.1,
            packed,
            wrap=compile_only,
            num_sms=132,
            lse=lse,
        )
    # the Gluon dK/dV (bf16 silu and fast_gelu at head dim 128, fast_gelu at 64)
    for head_dim, activation in ((128, "silu"), (128, "fast_gelu"), (64, "fast_gelu")):
        inputs = make_inputs([5, 0, 130], [7, 3, 200], num_heads=2, head_dim=head_dim, dtype=torch.bfloat16)
        q, k, v = inputs.tensors()
        ds = q.new_empty(2, k.shape[0], testing.store_ds_row(inputs.max_q_len))
        gluon_bwd.dkdv(
            q,
            k,
            v,
            torch.empty_like(q),
            torch.empty_like(k),
            torch.empty_like(v),
            ds,
            inputs.q_offsets,
            inputs.kv_offsets,
            order,
            inputs.max_kv_len,
            testing.ACTIVATION_CODES[activation],
            0.088,
            0.1,
            0.1,
            wrap=compile_only,
            num_sms=132,
        )


if __name__ == "__main__":
    main()
