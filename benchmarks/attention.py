"""Benchmark of kernels.jagged_attention against torch baselines, on one CUDA GPU.

Shapes are those of /work/shared/PERFORMANCE_TARGETS.md (H=4, D=128, bf16): "self" rows
(jagged Q and K/V of the same lengths) and the "pffn" row (jagged Q, dense K/V of 256 rows
per example), each for GDPA (fast_gelu) and Jagged Flash (softmax); plus a length sweep
256..16k for the linear modes (BlockAttention 64, sliding window 256) at a fixed token count.

FLOPs are counted on the true jagged lengths: forward = 4 * H * D * (visible pairs),
backward = 2.5 x forward, forward+backward = 3.5 x forward. Baselines, measured in the same
run: torch ``varlen_attn`` (softmax), nested-tensor SDPA (softmax), padded SDPA with a key
padding mask (softmax), Meta's public GDPA (GDPA without a mask, where tritonbench, from
github.com/meta-pytorch/tritonbench, is installed), and the padded reference under torch.compile
(same activation); a baseline that is missing or runs out of memory is recorded as such.

    python benchmarks/attention.py                  # everything, writes results/attention-h200.json + .png
    python benchmarks/attention.py --quick          # two shapes, no compiled baseline
    GEM_KERNELS_AUTOTUNE=0 python benchmarks/attention.py --quick   # default configs, no tuning
    GEM_KERNELS_TUNE_SPACE=wide python benchmarks/attention.py     # a larger autotune search
    python benchmarks/attention.py --no-sweep --variants           # + every setting of KERNEL_VARIANTS
    python benchmarks/attention.py --lengths    # GDPA without a mask, 128..2048 at fill 0.5: which
                                                # forward and backward win where (its own JSON)
    python benchmarks/attention.py --flagship   # gem_base's two attention calls at its history lengths,
                                                # kernel time and error of every backend (its own JSON);
                                                # and the personalized FFN with K/V generated in the
                                                # kernels against the model's path (a second JSON)
    python benchmarks/attention.py --generated-kv   # that second JSON only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import pathlib
import platform
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.scaling import commit  # noqa: E402
from kernels import jagged_attention  # noqa: E402
from kernels.jagged_attention import jagged_attention_reference, num_visible_pairs, settings, testing  # noqa: E402
from kernels.jagged_attention.autotune import tuned_configs  # noqa: E402
from kernels.jagged_attention.inputs import generated_kv_inputs, make_inputs, random_lengths  # noqa: E402

NUM_HEADS, HEAD_DIM, DTYPE = 4, 128, torch.bfloat16
# (name, layout, B, max_len, fill): PERFORMANCE_TARGETS.md rows.
TARGET_SHAPES = [
    ("self 1152x512 fill 0.5", "jagged", 1152, 512, 0.5),
    ("self 1152x1024 fill 0.5", "jagged", 1152, 1024, 0.5),
    ("self 1152x2048 fill 0.5", "jagged", 1152, 2048, 0.5),
    ("self 1152x1024 fill 1.0", "jagged", 1152, 1024, 1.0),
    ("pffn 1024x1000 fill 0.5 kv256", "dense_kv", 1024, 1000, 0.5),
]
# Reference figures (TFLOP/s fwd, fwd+bwd) from PERFORMANCE_TARGETS.md.
META_GDPA = {0: (302, 259), 1: (350, 291), 2: (403, 331), 3: (427, 342), 4: (294, 265)}
VARLEN_LISTED = {0: (231, 178), 1: (281, 240), 2: (302, 282), 3: (335, 288), 4: (244, 199)}
SWEEP_LENGTHS = [256, 1024, 4096, 16384]
SWEEP_TOKENS = 1 << 19
SWEEP_MODES = {"block64": dict(block_size=64), "window256": dict(window=256)}
SWEEP_ACTIVATIONS = {"block64": ("fast_gelu", "softmax"), "window256": ("softmax",)}
# --lengths: GDPA fast_gelu without a mask at fill 0.5 and SWEEP_TOKENS true tokens, with the
# switches that pick between kernels: the data behind GLUON_MIN_Q_LEN (at 128 and below the
# default is the Triton forward, above it the Gluon one).
LENGTHS = [128, 256, 384, 512, 768, 1024, 2048]
LENGTHS_VARIANTS = (
    "gem triton (no gluon forward)",
    "gem triton (gluon forward at every length)",
    "gem triton (recomputing dQ backward)",
)

# --flagship: the two attention calls of each gem_base layer (experiment=gem_base_h200) at its
# history lengths, lognormal(5, 1) events rounded and capped at 512 (at least 1), batch 1024: the
# self-attention (softmax over the jagged rows) and the personalized FFN (silu GDPA against 256
# generated K/V rows per example). Under torch.compile the op runs its Triton kernels only, so the
# Gluon ones are variants here.
FLAGSHIP_CASES = [
    ("gem_base self-attention", "jagged", "softmax", {}),
    ("gem_base personalized FFN", "dense_kv", "silu", {}),
]
FLAGSHIP_BATCH, FLAGSHIP_MAX_LEN, FLAGSHIP_LOG_MEAN, FLAGSHIP_LOG_STD = 1024, 512, 5.0, 1.0
FLAGSHIP_VARIANTS = (
    "gem triton (no gluon forward)",
    "gem triton (triton dK/dV)",
    "gem triton (no gluon: the kernels under torch.compile)",
    "gem triton (gluon softmax forward, unverified)",
)


# Seconds of idle before each implementation's measurements, so that none inherits the power
# and clock state of a long run before it (see _gpu_state).
SETTLE_S = 2.0


def bench(fn, grad_to_none=None) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def measure(forward, tensors) -> dict:
    """Median ms of forward, backward and forward+backward, and peak memory of one step."""
    result = {}
    with torch.no_grad():
        result["fwd_ms"] = bench(forward)
    out = forward()
    grad = torch.randn_like(out)
    result["bwd_ms"] = bench(lambda: out.backward(grad, retain_graph=True), grad_to_none=tensors)
    out = None  # frees the retained graph

    def step():
        forward().backward(grad)

    result["full_ms"] = bench(step, grad_to_none=tensors)
    for t in tensors:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    result["peak_mem_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return result


def _gpu_state() -> dict:
    """SM clock (MHz) and board power (W) now, through NVML; {} where it cannot be read. Under
    sustained load an H200 reaches its 700 W limit and lowers the SM clock from 1980 MHz to
    1600-1800 (measured), which moves a kernel's time by up to 10%."""
    try:
        return {"sm_clock_mhz": torch.cuda.clock_rate(), "power_w": torch.cuda.power_draw() / 1000}
    except Exception:
        return {}


def kernel_ms(forward, tensors, grad_out, steps=10) -> float:
    """Device time of the CUDA kernels of one forward+backward (torch.profiler), without the host's
    work between them: what the step of a compiled model would pay for the call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.autograd.grad(forward(), tensors, grad_out)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e3 / steps


def relative_errors(forward, tensors, reference) -> dict:
    """max |x - ref| / max |ref| of the output and each gradient, against ``reference``
    (grad_out, out, grads) from the float32 reference on the same inputs."""
    grad_out, out_ref, grads_ref = reference
    out = forward()
    grads = torch.autograd.grad(out, tensors, grad_out)
    names = ("out", "dq", "dk", "dv")
    return {
        n: float((x.float() - r).abs().max() / r.abs().max().clamp_min(1e-30))
        for n, x, r in zip(names, (out, *grads), (out_ref, *grads_ref))
    }


def run_impl(name, make_forward, tensors, flops_fwd, reference=None) -> dict:
    row = {"impl": name}
    try:
        forward = make_forward()
        if reference is not None:
            row["rel_err"] = relative_errors(forward, tensors, reference)
            row["kernel_ms"] = kernel_ms(forward, tensors, reference[0])
        torch.cuda.synchronize()
        time.sleep(SETTLE_S)  # every implementation starts from the same idle GPU
        row.update(measure(forward, tensors))
        row["gpu_after"] = _gpu_state()
        row["fwd_tflops"] = flops_fwd / row["fwd_ms"] / 1e9
        row["bwd_tflops"] = 2.5 * flops_fwd / row["bwd_ms"] / 1e9
        row["full_tflops"] = 3.5 * flops_fwd / row["full_ms"] / 1e9
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError as error:
        row["status"] = "out of memory" + (f" ({error})" if "skipped" in str(error) else "")
    except Exception as error:  # a baseline that does not exist here
        row["status"] = f"unavailable: {type(error).__name__}: {str(error)[:200]}"
    for t in tensors:
        t.grad = None
    torch.cuda.empty_cache()
    return row


def _baselines(inputs, activation, mask, compiled_reference):
    """(name, make_forward) for every baseline that applies to this case."""
    q, k, v = inputs.tensors()
    q_off, kv_off = inputs.q_offsets, inputs.kv_offsets
    num_batches = inputs.q_lengths.numel()
    dense_kv = kv_off is None
    kv_rows = (lambda t: t.reshape(-1, *t.shape[2:])) if dense_kv else (lambda t: t)
    if dense_kv:
        kv_off = torch.arange(num_batches + 1, device="cuda", dtype=torch.int64) * k.shape[1]
    max_q, max_kv = int(inputs.q_lengths.max()), int(inputs.kv_lengths.max())
    causal = mask.get("causal", False)
    out = []
    if activation == "softmax" and not mask.get("block_size"):

        def varlen():
            from torch.nn.attention.varlen import varlen_attn

            cu_q, cu_k = q_off.to(torch.int32), kv_off.to(torch.int32)
            kwargs = {"is_causal": causal} if causal else {}
            if mask.get("window") is not None:
                kwargs["window_size"] = [mask["window"], mask["window"]]
            return lambda: varlen_attn(q, kv_rows(k), kv_rows(v), cu_q, cu_k, max_q, max_kv, **kwargs)

        out.append(("torch varlen_attn", varlen))
    if activation == "softmax" and not mask:

        def nested():
            def forward():
                nq = torch.nested.nested_tensor_from_jagged(q, q_off).transpose(1, 2)
                nk = torch.nested.nested_tensor_from_jagged(kv_rows(k), kv_off).transpose(1, 2)
                nv = torch.nested.nested_tensor_from_jagged(kv_rows(v), kv_off).transpose(1, 2)
                return F.scaled_dot_product_attention(nq, nk, nv).transpose(1, 2).values()

            return forward

        def padded():
            from kernels.jagged import jagged_to_padded, padded_to_jagged

            def forward():
                pq = jagged_to_padded(q, q_off, max_q).transpose(1, 2)
                pk = jagged_to_padded(kv_rows(k), kv_off, max_kv).transpose(1, 2)
                pv = jagged_to_padded(kv_rows(v), kv_off, max_kv).transpose(1, 2)
                key_mask = (torch.arange(max_kv, device="cuda")[None, :] < inputs.kv_lengths.cuda()[:, None])[
                    :, None, None, :
                ]
                o = F.scaled_dot_product_attention(pq, pk, pv, attn_mask=key_mask)
                return padded_to_jagged(o.transpose(1, 2), q_off, q.shape[0])

            return forward

        def nested_cudnn():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def forward():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    nq, nk, nv = (
                        torch.nested.nested_tensor_from_jagged(t, off, max_seqlen=n).transpose(1, 2)
                        for t, off, n in ((q, q_off, max_q), (kv_rows(k), kv_off, max_kv), (kv_rows(v), kv_off, max_kv))
                    )
                    return F.scaled_dot_product_attention(nq, nk, nv).transpose(1, 2).values()

            return forward

        out += [
            ("nested-tensor SDPA", nested),
            ("nested-tensor SDPA, cuDNN", nested_cudnn),
            ("padded SDPA (key mask)", padded),
        ]
    if activation != "softmax" and not mask:
        # Meta's public GDPA: tritonbench's operator (github.com/meta-pytorch/tritonbench, not on PyPI),
        # where it is installed; its three variants as tritonbench registers them. Its defaults differ
        # from gem's (qk_scale 1.0), so the scale is passed; the rows' errors show what else differs.
        def meta(**options):
            def make():
                from tritonbench.operators.gdpa.gdpa import gdpa

                kwargs = dict(qk_scale=q.shape[-1] ** -0.5, activation=activation, is_causal=False) | options
                if kwargs.pop("sort", False):
                    kwargs["seq_index"] = torch.argsort(inputs.q_lengths.to(q.device), descending=True).contiguous()
                cu_q, cu_k = q_off.to(torch.int32), kv_off.to(torch.int32)
                return lambda: gdpa(q, kv_rows(k), kv_rows(v), cu_q, cu_k, max_q, max_kv, **kwargs)

            return make

        fast = dict(
            enable_persistent=True, enable_tma=True, enable_ws=False, use_dq_atomic_add=True, bwd_opt_tech="base"
        )
        out += [
            ("Meta GDPA (tritonbench)", meta()),
            ("Meta GDPA (tritonbench, persistent + TMA)", meta(**fast)),
            ("Meta GDPA (tritonbench, persistent + TMA, sorted)", meta(sort=True, **fast)),
        ]
    padded_bytes = 16 * num_batches * NUM_HEADS * max_q * max_kv  # fp32 scores, probs, grads
    if compiled_reference and padded_bytes > torch.cuda.mem_get_info()[0]:

        def compiled():
            raise torch.cuda.OutOfMemoryError(
                f"skipped: needs about {padded_bytes / 2**30:.0f} GiB of padded fp32 scores"
            )

        out.append(("padded reference, torch.compile", compiled))
    elif compiled_reference:

        def compiled():
            fn = torch.compile(jagged_attention_reference, dynamic=False)
            return lambda: fn(*inputs.args(), activation=activation, **mask)

        out.append(("padded reference, torch.compile", compiled))
    return out


# --variants: the kernels' settings (kernels/jagged_attention/settings.py) measured in the same
# run as the default, forward and backward, each set here on the settings object (testing.override);
# in a training run, by the config key in its comment (docs/kernels.md, "Settings"). Not all apply
# to every activation.
KERNEL_VARIANTS = {
    "gem triton (float32 activation)": dict(packed_act=False),  # experimental.kernels.packed_act=false
    "gem triton (no gluon forward)": dict(gluon=False),  # kernels.gluon=false (or GEM_KERNELS_GLUON=0)
    "gem triton (gluon forward at every length)": dict(gluon_min_q_len=0),  # experimental.kernels.gluon_min_q_len=0
    "gem triton (recomputing dQ backward)": dict(store_ds=False),  # kernels.store_ds=false
    "gem triton (triton dK/dV)": dict(gluon_bwd=False),  # kernels.gluon_bwd=false
    "gem triton (no gluon: the kernels under torch.compile)": dict(gluon=False, gluon_bwd=False),
    "gem triton (gluon softmax forward, unverified)": {},  # (runs under testing.unverified_gluon)
}
_GDPA_ONLY = {"packed_act", "gluon", "gluon_min_q_len", "gluon_bwd"}  # settings that change nothing for softmax
# Variants of Gluon kernels that have passed the GPU gate on no Triton release yet
# (kernels.jagged_attention.call.GLUON_VERIFIED), run inside testing.unverified_gluon(); each is
# softmax's alone: with the Gluon kernels verified for GDPA, its rows would repeat the default's.
UNVERIFIED_VARIANTS = {"gem triton (gluon softmax forward, unverified)"}


def run_case(
    shape_name,
    layout,
    num_batches,
    max_len,
    fill,
    activation,
    mask,
    *,
    compiled_reference,
    baselines=True,
    variants=False,
    seed=0,
    lengths=None,
    check=False,
) -> list[dict]:
    """``lengths``: the examples' lengths (default: drawn by ``random_lengths`` at ``fill``);
    ``check``: every row also gets its kernel time and its errors against the float32 reference."""
    gen = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = random_lengths(num_batches, max_len, fill, gen)
    inputs = make_inputs(
        lengths,
        num_heads=NUM_HEADS,
        head_dim=HEAD_DIM,
        layout=layout,
        num_dense_kv=256,
        dtype=DTYPE,
        device="cuda",
        generator=gen,
    )
    inputs.max_q_len = max_len  # the data pipeline's bound, not the batch's true maximum
    if inputs.max_kv_len is not None:
        inputs.max_kv_len = max_len
    pairs = num_visible_pairs(
        inputs.q_lengths, inputs.kv_lengths, mask.get("causal", False), mask.get("window"), mask.get("block_size")
    )
    flops_fwd = 4 * NUM_HEADS * HEAD_DIM * pairs
    tensors = list(inputs.tensors())
    reference = None
    if check:
        exact = [t.detach().float().requires_grad_() for t in tensors]
        args = (*exact, *inputs.args()[3:])
        out = jagged_attention_reference(*args, activation=activation, **mask)
        grad_out = torch.randn_like(out).to(DTYPE)
        reference = (grad_out, out.detach(), torch.autograd.grad(out, exact, grad_out.float()))
        del exact, out

    def ours():
        return lambda: jagged_attention(*inputs.args(), activation=activation, backend="triton", **mask)

    impls = [("gem triton", ours, {})]
    names = KERNEL_VARIANTS if variants is True else (variants or ())
    impls += [
        (name, ours, KERNEL_VARIANTS[name])
        for name in names
        if not (activation == "softmax" and _GDPA_ONLY & set(KERNEL_VARIANTS[name]))
        and (activation == "softmax" or name not in UNVERIFIED_VARIANTS)
    ]
    if baselines:
        impls += [(name, make, {}) for name, make in _baselines(inputs, activation, mask, compiled_reference)]
    rows = []
    for name, make_forward, flags in impls:
        unverified = testing.unverified_gluon() if name in UNVERIFIED_VARIANTS else contextlib.nullcontext()
        with testing.override(**flags), unverified:
            row = run_impl(name, make_forward, tensors, flops_fwd, reference)
        row.update(
            shape=shape_name,
            layout=layout,
            batch=num_batches,
            max_len=max_len,
            fill=fill,
            activation=activation,
            mask=mask,
            num_tokens=int(lengths.sum()),
            flops_fwd=flops_fwd,
        )
        rows.append(row)
        print(_format(row), flush=True)
    return rows


def _format(row) -> str:
    head = f"{row['shape']:<32} {row['activation']:<9} {str(row['mask']):<22} {row['impl']:<32}"
    if row["status"] != "ok":
        return head + " " + row["status"][:80]
    return (
        head + f" fwd {row['fwd_ms']:8.3f} ms {row['fwd_tflops']:6.1f} TF/s | bwd "
        f"{row['bwd_ms']:8.3f} ms | fwd+bwd {row['full_ms']:8.3f} ms "
        f"{row['full_tflops']:6.1f} TF/s | peak {row['peak_mem_gib']:6.2f} GiB"
    )


def _versions() -> dict:
    config = settings.current()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "git_commit": commit(),
        "hardware": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        # the kernels' settings (docs/kernels.md, "Settings"), under their config keys
        **{
            name: getattr(config, name)
            for name in (
                "autotune",
                "tune_space",
                "packed_act",
                "gluon",
                "gluon_min_q_len",
                "store_ds",
                "gluon_bwd",
                "store_ds_max_mib",
            )
        },
    }


def _plot(rows, path, hardware) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tf, ax_tok) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = {}
    for row in rows:
        if row.get("sweep") and row["status"] == "ok":
            series.setdefault(f"{row['impl']} {row['activation']} {row['sweep']}", []).append(row)
    for label, points in series.items():
        lengths = [p["max_len"] for p in points]
        ax_tf.plot(lengths, [p["full_tflops"] for p in points], marker="o", label=label)
        ax_tok.plot(lengths, [p["full_ms"] * 1e6 / p["num_tokens"] for p in points], marker="o", label=label)
    for ax, title in ((ax_tf, "fwd+bwd TFLOP/s"), (ax_tok, "fwd+bwd ns per token")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"sequence length (fill 1.0, {SWEEP_TOKENS} tokens)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax_tok.set_ylim(0, 1.2 * max([ax_tok.get_ylim()[1], 1e-9]))
    ax_tf.legend(fontsize=7)
    fig.suptitle(
        f"gem jagged attention (Triton), {hardware}, H={NUM_HEADS} D={HEAD_DIM} bf16, "
        "BlockAttention 64 / sliding window 256"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, no compiled baseline")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument(
        "--plot-only", metavar="JSON", help="redraw the PNG and the summary from a results JSON (no GPU)"
    )
    parser.add_argument(
        "--compiled-reference-rows",
        default="0,1,2,3,4",
        help="target rows (0-based) that also time the compiled padded reference",
    )
    parser.add_argument(
        "--variants",
        action="store_true",
        help=f"also time the kernel switches {list(KERNEL_VARIANTS)} on the target rows",
    )
    parser.add_argument(
        "--keep-sweeps",
        action="store_true",
        help="run the target rows only and keep the sweep rows of the existing "
        "results JSON (the sweeps time the masked paths)",
    )
    parser.add_argument(
        "--lengths",
        action="store_true",
        help=f"only GDPA without a mask at lengths {LENGTHS} (fill 0.5), with "
        f"{list(LENGTHS_VARIANTS)}; writes attention-h200-lengths.json",
    )
    parser.add_argument(
        "--flagship",
        action="store_true",
        help="only gem_base's self-attention and personalized FFN at its history lengths, with kernel "
        "times and errors; writes attention-h200-flagship.json",
    )
    parser.add_argument(
        "--generated-kv",
        action="store_true",
        help="only the personalized FFN with K/V generated in the kernels (forward and backward) against "
        "the model's path (the end of --flagship); writes attention-h200-flagship-generated-kv.json",
    )
    parser.add_argument(
        "--only-sweeps",
        metavar="NAMES",
        help=f"run only these sweeps (comma-separated, of {list(SWEEP_MODES)}) and "
        "replace their rows in the existing results JSON",
    )
    args = parser.parse_args()
    if args.plot_only:
        record = json.loads(pathlib.Path(args.plot_only).read_text())
        print("\n".join(summarize(record["rows"])["lines"]))
        _plot(record["rows"], pathlib.Path(args.plot_only).with_suffix(".png"), record["hardware"])
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.lengths:
        return length_sweep(pathlib.Path(args.out))
    if args.flagship:
        return flagship(pathlib.Path(args.out))
    if args.generated_kv:
        return generated_kv(pathlib.Path(args.out))

    rows = []
    shapes = [TARGET_SHAPES[1], TARGET_SHAPES[4]] if args.quick else TARGET_SHAPES
    compiled_rows = {int(i) for i in args.compiled_reference_rows.split(",") if i}
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "attention-h200" + ("-quick" if args.quick else "")
    sweeps = dict(SWEEP_MODES)
    earlier = {"rows": [], "tuned_configs": {}}
    if args.only_sweeps:
        sweeps = {k: SWEEP_MODES[k] for k in args.only_sweeps.split(",")}
        earlier = json.loads((out_dir / f"{name}.json").read_text())
        earlier["rows"] = [r for r in earlier["rows"] if r.get("sweep") not in sweeps]
        shapes = []
    elif args.keep_sweeps:
        sweeps = {}
        earlier = json.loads((out_dir / f"{name}.json").read_text())
        earlier["rows"] = [r for r in earlier["rows"] if "sweep" in r]
    for row in earlier["rows"]:  # kept rows of files written before rows carried "measured"
        row.setdefault("measured", {"date": earlier["date"], "git_commit": earlier.get("git_commit")})

    versions = _versions()

    def save():  # after every case, so that a run cut short still leaves its numbers
        for row in rows:  # where each row was measured (kept rows keep theirs)
            row.setdefault("measured", {"date": versions["date"], "git_commit": versions["git_commit"]})
        all_rows = earlier["rows"] + rows
        tuned = {
            kind: {**earlier["tuned_configs"].get(kind, {}), **chosen} for kind, chosen in _tuned_configs().items()
        }
        record = {
            **versions,
            "num_heads": NUM_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": str(DTYPE),
            "flops": "fwd = 4*H*D*sum(visible pairs); bwd = 2.5x fwd; fwd+bwd = 3.5x fwd",
            "shapes": earlier.get("shapes")
            or [dict(zip(("name", "layout", "batch", "max_len", "fill"), s)) for s in shapes],
            "tuned_configs": tuned,
            "rows": all_rows,
            "summary": summarize(all_rows)["targets"],
        }
        kept = sorted({(r["measured"]["date"], r["measured"]["git_commit"]) for r in earlier["rows"]})
        if args.only_sweeps or args.keep_sweeps:
            record["notes"] = (
                f"{'sweeps ' + args.only_sweeps if args.only_sweeps else 'target rows'} "
                f"run on {record['date']}; the other rows kept from (date, commit) {kept}; "
                "each row's 'measured' says which"
            )
        (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1))

    for shape in shapes:
        index = TARGET_SHAPES.index(shape)
        for activation in ("fast_gelu", "softmax"):
            # The compiled padded reference is the table's "padded GELU attention" column.
            case = run_case(
                *shape,
                activation,
                {},
                variants=args.variants,
                compiled_reference=(not args.quick and activation != "softmax" and index in compiled_rows),
            )
            for row in case:
                row["target_row"] = index
                row["meta_gdpa_listed"] = META_GDPA[index]
                row["varlen_listed"] = VARLEN_LISTED[index]
            rows += case
            save()
    if not args.no_sweep:
        lengths = SWEEP_LENGTHS[::2] if args.quick else SWEEP_LENGTHS
        for sweep, mask in sweeps.items():
            for activation in SWEEP_ACTIVATIONS[sweep]:
                for length in lengths:
                    case = run_case(
                        f"sweep {sweep} L={length}",
                        "jagged",
                        SWEEP_TOKENS // length,
                        length,
                        1.0,
                        activation,
                        mask,
                        compiled_reference=False,
                        baselines=activation == "softmax" and length == lengths[-1],
                    )
                    for row in case:
                        row["sweep"] = sweep
                    rows += case
                    save()

    summary = summarize(earlier["rows"] + rows)
    print("\n" + "\n".join(summary["lines"]))
    save()
    if any("sweep" in r for r in earlier["rows"] + rows):
        _plot(earlier["rows"] + rows, out_dir / f"{name}.png", torch.cuda.get_device_name())
    print(f"wrote {out_dir / name}.json")
    for kind, chosen in _tuned_configs().items():
        for key, config in chosen.items():
            print(f"autotuned {kind} {key}: {config}")


def _write_rows(path: pathlib.Path, versions: dict, rows: list[dict], **fields) -> None:
    """A results JSON of ``rows`` with the run's versions, the shape constants and ``fields``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        **versions,
        "num_heads": NUM_HEADS,
        "head_dim": HEAD_DIM,
        "dtype": str(DTYPE),
        "flops": "fwd = 4*H*D*sum(visible pairs); bwd = 2.5x fwd; fwd+bwd = 3.5x fwd",
        **fields,
        "tuned_configs": _tuned_configs(),
        "rows": rows,
    }
    path.write_text(json.dumps(record, indent=1))


def length_sweep(out_dir: pathlib.Path) -> None:
    """--lengths: the default path and LENGTHS_VARIANTS at each of LENGTHS, one JSON."""
    versions, rows = _versions(), []
    for length in LENGTHS:
        rows += run_case(
            f"lengths L={length} fill 0.5",
            "jagged",
            2 * SWEEP_TOKENS // length,
            length,
            0.5,
            "fast_gelu",
            {},
            compiled_reference=False,
            baselines=False,
            variants=LENGTHS_VARIANTS,
        )
        _write_rows(out_dir / "attention-h200-lengths.json", versions, rows)
    for length in LENGTHS:
        line = [r for r in rows if r["max_len"] == length and r["status"] == "ok"]
        print(
            f"L={length:5d} "
            + " | ".join(
                f"{r['impl'][len('gem triton') :].strip(' ()') or 'default'}: {r['fwd_tflops']:.0f} / "
                f"{r['full_tflops']:.0f}"
                for r in line
            )
        )


def flagship_lengths() -> torch.Tensor:
    """The flagship's history lengths ``[FLAGSHIP_BATCH]``: lognormal, seed 0, in [1, FLAGSHIP_MAX_LEN]."""
    normal = torch.randn(FLAGSHIP_BATCH, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (FLAGSHIP_LOG_MEAN + FLAGSHIP_LOG_STD * normal).exp().round().clamp(1, FLAGSHIP_MAX_LEN).long()


def flagship(out_dir: pathlib.Path) -> None:
    """--flagship: FLAGSHIP_CASES with their baselines and FLAGSHIP_VARIANTS, one JSON."""
    lengths = flagship_lengths()
    versions, rows = _versions(), []
    for name, layout, activation, mask in FLAGSHIP_CASES:
        rows += run_case(
            name,
            layout,
            FLAGSHIP_BATCH,
            FLAGSHIP_MAX_LEN,
            None,
            activation,
            mask,
            compiled_reference=False,
            variants=FLAGSHIP_VARIANTS,
            lengths=lengths,
            check=True,
        )
        _write_rows(
            out_dir / "attention-h200-flagship.json",
            versions,
            rows,
            lengths=f"lognormal({FLAGSHIP_LOG_MEAN}, {FLAGSHIP_LOG_STD}), in [1, {FLAGSHIP_MAX_LEN}]",
            mean_length=float(lengths.double().mean()),
            kernel_ms="device time of the CUDA kernels of one forward+backward (torch.profiler)",
            rel_err="max |x - ref| / max |ref| against the float32 reference on the same inputs",
        )
    for r in rows:
        if r["status"] == "ok":
            errors = " ".join(f"{k} {v:.1e}" for k, v in r["rel_err"].items())
            print(f"{r['shape']:<26} {r['impl']:<34} kernels {r['kernel_ms']:6.3f} ms | errors {errors}")
    generated_kv(out_dir)


def generated_kv(out_dir: pathlib.Path) -> None:
    """--generated-kv (and the end of --flagship): generated_kv_rows at the flagship's lengths, one JSON."""
    lengths = flagship_lengths()
    generated = generated_kv_rows(lengths)
    _write_rows(
        out_dir / "attention-h200-flagship-generated-kv.json",
        _versions(),
        generated,
        lengths=f"lognormal({FLAGSHIP_LOG_MEAN}, {FLAGSHIP_LOG_STD}), in [1, {FLAGSHIP_MAX_LEN}]",
        what="gem_base's personalized FFN: the model's path against K/V generated in the kernels; forward "
        "and backward (fwd_ms, bwd_ms, full_ms) for the defaults, forward alone for each forward config",
        rel_err="max |out - ref| / max |ref| against generated_kv_reference on the same inputs; "
        "grad_err: |grad - ref| / |ref| (norms) of each input's gradient",
    )
    for r in generated:
        if r["status"] != "ok":
            print(f"{'personalized FFN':<26} {r['impl']:<60} {r['status']}")
            continue
        timed = " | ".join(f"{key} {r[key]:6.3f}" for key in ("fwd_ms", "bwd_ms", "full_ms") if key in r)
        worst = max([r.get("rel_err", 0.0), *r.get("grad_err", {}).values()])
        print(f"{'personalized FFN':<26} {r['impl']:<60} {timed} | largest error {worst:.1e}")


# The generated-K/V kernels' launch configs (no autotuner yet), each timed alone: the forward's
# (BLOCK_M, BLOCK_N, warps, stages) and the backward dK/dV kernel's (BLOCK_M, BLOCK_N, warps); the
# first backward one is the default (8 warps: with 4 its inner loop spills, docs/log/kernels.md;
# BLOCK_N 32 runs mma.sync, no spills).
GENERATED_KV_CONFIGS = [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 4, 3)]
GENERATED_KV_BWD_CONFIGS = [(32, 64, 8), (16, 64, 8), (64, 64, 8), (32, 32, 4)]


def generated_kv_rows(lengths: torch.Tensor) -> list[dict]:
    """The personalized FFN at gem_base's shapes (256 generated rows from 4 summary tokens, silu)
    two ways: the model's path (``generate_weights`` compiled, writing K and V, then the op) and
    K/V built in the kernels (``generated_kv_attention``): forward, backward and both, with each
    input's gradient checked against the reference's; then ``generated_kv_forward`` alone at each
    of GENERATED_KV_CONFIGS and ``generated_kv_backward`` alone at each of GENERATED_KV_BWD_CONFIGS."""
    from gem.models.sequence import generate_weights
    from kernels.jagged_attention.generated_kv import (
        generated_kv_attention,
        generated_kv_backward,
        generated_kv_forward,
        generated_kv_reference,
    )

    num_kv, num_batches = 256, lengths.numel()
    args = generated_kv_inputs(
        lengths,
        num_heads=NUM_HEADS,
        head_dim=HEAD_DIM,
        num_kv=num_kv,
        num_summary=4,
        dtype=DTYPE,
        device="cuda",
        generator=torch.Generator().manual_seed(0),
    )
    q, offsets, max_len, shared_k, shared_v, mix, gen_k, gen_v = args
    leaves = [t.requires_grad_() for t in (q, shared_k, shared_v, mix, gen_k, gen_v)]
    reference = generated_kv_reference(*args)
    grad_out = torch.randn_like(reference)
    reference_grads = torch.autograd.grad(reference, leaves, grad_out)
    reference = reference.detach()
    generate = torch.compile(generate_weights)

    def model_path():
        k, v = (
            generate(w, mix, g).view(num_batches, num_kv, NUM_HEADS, HEAD_DIM)
            for w, g in ((shared_k, gen_k), (shared_v, gen_v))
        )
        return jagged_attention(q, k, v, offsets, None, max_len, None, activation="silu", post_scale=1 / num_kv)

    def out_error(out) -> float:
        return ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item()

    def grad_errors(grads) -> dict:
        names = ("q", "shared_k", "shared_v", "mix", "gen_k", "gen_v")
        return {
            n: ((g.float() - w.float()).norm() / w.float().norm()).item()
            for n, g, w in zip(names, grads, reference_grads)
        }

    def errors(fn) -> dict:
        out = fn()
        return dict(rel_err=out_error(out), grad_err=grad_errors(torch.autograd.grad(out, leaves, grad_out)))

    flops = 4 * NUM_HEADS * HEAD_DIM * int(lengths.sum()) * num_kv
    rows = []

    def run(impl, fn, timing) -> None:
        time.sleep(SETTLE_S)  # every implementation starts from the same idle GPU
        try:
            row = dict(impl=impl, status="ok", tokens=int(lengths.sum()), **timing(fn))
        except Exception as failure:  # a config that does not build here: recorded, the others still run
            rows.append(dict(impl=impl, status=f"{type(failure).__name__}: {str(failure).splitlines()[0]}"))
            return
        if "fwd_ms" in row:
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        if "full_ms" in row:
            row["full_tflops"] = 3.5 * flops / row["full_ms"] / 1e9
        rows.append(row)

    def forward_and_backward(fn) -> dict:
        return errors(fn) | measure(fn, leaves)

    def forward_only(fn) -> dict:
        with torch.no_grad():
            return dict(rel_err=out_error(fn()), fwd_ms=bench(fn))

    run("the model's path: generate_weights compiled, then the op", model_path, forward_and_backward)
    in_kernels = functools.partial(generated_kv_attention, *args)
    run("generated in the kernels (forward and backward, default configs)", in_kernels, forward_and_backward)
    for block_m, block_n, warps, stages in GENERATED_KV_CONFIGS:
        config = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        forward = functools.partial(generated_kv_forward, *args, **config)
        run(f"generated in the kernel, forward {config}", forward, forward_only)

    def backward_only(fn) -> dict:
        return dict(grad_err=grad_errors(fn()), bwd_ms=bench(fn))

    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    for block_m, block_n, warps in GENERATED_KV_BWD_CONFIGS:
        config = dict(block_m=block_m, block_n=block_n, num_warps=warps)
        backward = functools.partial(generated_kv_backward, grad_out, *detached, **config)
        run(f"generated in the kernels, backward {config}", backward, backward_only)
    return rows


def _tuned_configs() -> dict:
    """{kernel kind: {autotune key: chosen config}} for every shape bucket tuned in this run."""
    return tuned_configs()


def summarize(rows) -> dict:
    """Ratios against the targets of PERFORMANCE_TARGETS.md."""
    lines, targets = [], []
    ours = {
        (r["shape"], r["activation"]): r
        for r in rows
        if r["impl"] == "gem triton" and r["status"] == "ok" and "target_row" in r
    }
    varlen = {
        r["shape"]: r for r in rows if r["impl"] == "torch varlen_attn" and r["status"] == "ok" and "target_row" in r
    }
    for (shape, activation), r in ours.items():
        if activation == "fast_gelu":
            meta_fwd, meta_full = r["meta_gdpa_listed"]
            entry = dict(
                shape=shape,
                what="GDPA fast_gelu vs Meta Triton GDPA (listed)",
                fwd_tflops=r["fwd_tflops"],
                full_tflops=r["full_tflops"],
                fwd_ratio=r["fwd_tflops"] / meta_fwd,
                full_ratio=r["full_tflops"] / meta_full,
                target="fwd >= 1.2x, fwd+bwd >= 1.15x",
            )
        else:
            base = varlen.get(shape)
            entry = dict(
                shape=shape,
                what="softmax vs torch varlen_attn (same run)",
                fwd_tflops=r["fwd_tflops"],
                full_tflops=r["full_tflops"],
                fwd_ratio=base and r["fwd_tflops"] / base["fwd_tflops"],
                full_ratio=base and r["full_tflops"] / base["full_tflops"],
                target="fwd+bwd >= 1.1x",
            )
        targets.append(entry)
        fmt = lambda x: "n/a" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(
            f"{shape:<32} {activation:<9} fwd {entry['fwd_tflops']:6.1f} "
            f"({fmt(entry['fwd_ratio'])}) fwd+bwd {entry['full_tflops']:6.1f} "
            f"({fmt(entry['full_ratio'])})  {entry['what']}; target {entry['target']}"
        )
    for sweep in SWEEP_MODES:
        for activation in SWEEP_ACTIVATIONS[sweep]:
            points = {
                r["max_len"]: r["full_ms"] / r["num_tokens"]
                for r in rows
                if r.get("sweep") == sweep
                and r["activation"] == activation
                and r["impl"] == "gem triton"
                and r["status"] == "ok"
            }
            span = [points[n] for n in points if 1024 <= n <= 16384]
            if len(span) >= 2:
                spread = max(span) / min(span) - 1
                targets.append(
                    dict(what=f"{sweep} {activation} time/token spread 1k..16k", spread=spread, target="<= 0.15")
                )
                lines.append(
                    f"{sweep} {activation}: fwd+bwd time per token spread 1k..16k {100 * spread:.1f}% (target <= 15%)"
                )
    return {"lines": lines, "targets": targets}


if __name__ == "__main__":
    main()
