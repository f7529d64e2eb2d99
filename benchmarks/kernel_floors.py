"""Each attention-side kernel of a flagship step against its compute and memory floor (issue #71, item 4).

    python benchmarks/kernel_floors.py   # -> benchmarks/results/kernel-floors-h200.json, and a table

For each block of ``experiment=gem_base_h200``, at the flagship's lengths
(``benchmarks.attention.flagship_lengths``: 1,024 examples, lognormal(5, 1) in [1, 512]), the
model's attention calls are read off its modules (meta device): softmax self-attention, the
personalized FFN (GDPA against per-example K/V), and the pooling (rows pooled, or softmax over
projected rows with a broadcast Q). Each call adds, to the kernels that run it, the FLOPs of its
products and the bytes those kernels must move at least as they are designed: each operand read
once and each result written once (re-reads of K/V tiles are left to L2). The stored dS is counted
at the true pairs, not at its padded rows. FLOPs are the products each kernel executes, the
backward's recomputed scores counted (so a softmax call sums to 3.5x its forward, not the model's
3x of ``benchmarks/model_flops.py``). These are set against a profile's device time per
kernel (``breakdown.top`` of a ``benchmarks/e2e.py`` results JSON with ``--profile``) and the
GPU's peaks: a kernel's floor is the larger of ``FLOPs / peak`` and ``bytes / bandwidth``, and its
distance from that floor is what a better kernel of the same design could still gain. No GPU is
used: the times are those of the profile named.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.attention import flagship_lengths  # noqa: E402
from benchmarks.model_flops import dense_arch  # noqa: E402
from benchmarks.scaling import commit  # noqa: E402
from gem.models import sequence  # noqa: E402

# Dense bf16 tensor-core peak and HBM bandwidth, from the vendor's data sheets (SXM parts).
PEAKS = {"NVIDIA H200": (989.4e12, 4.8e12), "NVIDIA H100 80GB HBM3": (989.4e12, 3.35e12)}
PROFILES = {
    "interformer": ("e2e-h200-rowbias.json", "nobias-interformer"),
    "kunlun": ("e2e-h200-rowbias-kunlun.json", "nobias-kunlun"),
}
BF16, FP32 = 2, 4


def attention_calls(block: str, lengths: torch.Tensor) -> list[dict]:
    """One entry per attention call of a training step of the flagship's ``block``: its kind and sizes."""
    dense, _ = dense_arch(["experiment=gem_base_h200", f"model.block={block}"])
    rows, examples = int(lengths.sum()), lengths.numel()
    calls = []
    for name, module in dense.named_modules():
        common = dict(
            module=name, heads=getattr(module, "num_heads", 0), head_dim=getattr(module, "head_dim", 0), rows=rows
        )
        if isinstance(module, sequence.JaggedSelfAttention):
            masked = module.window is not None or module.causal
            pairs = sequence.self_attention_pairs(lengths, module.window, module.causal)
            calls.append(common | dict(kind="self", pairs=pairs, store_ds=not masked))
        elif isinstance(module, sequence.PersonalizedFFN):
            kv = examples * module.num_kv
            calls.append(common | dict(kind="pffn", pairs=rows * module.num_kv, kv_rows=kv))
        elif isinstance(module, sequence.PoolingByAttention):
            queries = module.queries.shape[0]
            kind = "pool_rows" if module.pool_rows else "pool_softmax"
            calls.append(common | dict(kind=kind, queries=queries, examples=examples, pairs=queries * rows))
    return calls


def kernel_costs(call: dict) -> dict[str, tuple[float, float]]:
    """``{kernel name: (FLOPs, bytes)}`` of one call, for the kernels the flagship's profile shows."""
    h, d, t, pairs = call["heads"], call["head_dim"], call["rows"], call["pairs"]
    c = h * d
    rows_bytes = t * c * BF16  # one [T, H*D] bf16 tensor
    product = 2 * h * d * pairs  # one matrix product over the visible pairs
    kind = call["kind"]
    if kind == "self":  # rotary fused: Q and K rotated by their own kernel, V read from the projection
        costs = {
            "_rotary_kernel": (0, 4 * rows_bytes),
            "_fwd_kernel": (2 * product, 4 * rows_bytes + t * h * FP32),
            "_bwd_preprocess_kernel": (0, 2 * rows_bytes + t * h * FP32),
        }
        if call["store_ds"]:
            ds = h * pairs * BF16
            costs["_bwd_dkdv_kernel"] = (4 * product, 6 * rows_bytes + 2 * t * h * FP32 + ds)
            costs["_bwd_dq_from_ds_kernel"] = (product, ds + 2 * rows_bytes)
        else:
            costs["_bwd_dkdv_kernel"] = (4 * product, 6 * rows_bytes + 2 * t * h * FP32)
            costs["_bwd_dq_kernel"] = (3 * product, 6 * rows_bytes + 2 * t * h * FP32)
        return costs
    if kind == "pffn":  # K_b, V_b generated ([B, N, H*D] each), then the Gluon GDPA kernels
        kv_bytes = call["kv_rows"] * c * BF16
        ds = h * pairs * BF16
        return {
            "generation (Inductor)": (0, 2 * kv_bytes),
            "_gdpa_fwd_kernel": (2 * product, 2 * rows_bytes + 2 * kv_bytes),
            "_gdpa_dkdv_kernel": (4 * product, 2 * rows_bytes + 4 * kv_bytes + ds),
            "_bwd_dq_from_ds_kernel": (product, ds + kv_bytes + rows_bytes),
            "_bwd_kernel": (0, 2 * kv_bytes),  # the generation's backward, K's and V's
        }
    out_rows = call["examples"] * call["queries"]
    if kind == "pool_softmax":  # a broadcast Q of a few learned rows: K, V of every row
        small = out_rows * c * BF16
        return {
            "_fwd_kernel": (2 * product, 2 * rows_bytes + small + out_rows * h * FP32),
            "_bwd_preprocess_kernel": (0, 2 * small + out_rows * h * FP32),
            "_bwd_dkdv_kernel": (4 * product, 4 * rows_bytes + small + 2 * out_rows * h * FP32),
            "_bwd_dq_kernel": (3 * product, 2 * rows_bytes + small + out_rows * h * FP32),
        }
    columns = call["queries"] * h  # pool_rows: scores and sums over the unprojected rows
    flops = 2 * 2 * t * c * columns
    return {"_pool_fwd_kernel": (flops, rows_bytes), "_pool_bwd_kernel": (2 * flops, 2 * rows_bytes)}


def floors(block: str, lengths: torch.Tensor, profile: dict, peak_flops: float, bandwidth: float) -> list[dict]:
    """A row per kernel: the step's FLOPs and bytes, the profile's time, rates and floors."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for call in attention_calls(block, lengths):
        for kernel, (flops, nbytes) in kernel_costs(call).items():
            totals[kernel][0] += flops
            totals[kernel][1] += nbytes
            totals[kernel][2] += 1
    measured = {k["name"]: k for k in profile["breakdown"]["top"]}
    generation = [k for k in measured if k.startswith("triton_poi_") and "sum_unsqueeze" in k]
    if generation:  # Inductor's name for the fused generation kernel varies with the graph
        measured["generation (Inductor)"] = measured[generation[0]]
    rows = []
    for kernel, (flops, nbytes, calls) in totals.items():
        compute_ms, memory_ms = 1e3 * flops / peak_flops, 1e3 * nbytes / bandwidth
        row = dict(
            kernel=kernel,
            calls=calls,
            tflop=flops / 1e12,
            gbytes=nbytes / 1e9,
            compute_floor_ms=compute_ms,
            memory_floor_ms=memory_ms,
            bound="compute" if compute_ms >= memory_ms else "memory",
        )
        if kernel in measured:
            ms = measured[kernel]["ms_per_step"]
            row |= dict(
                ms=ms,
                profiled_calls=measured[kernel]["calls_per_step"],
                tflops=flops / ms / 1e9,
                tbytes_per_s=nbytes / ms / 1e9,
                over_floor=ms / max(compute_ms, memory_ms),
            )
        rows.append(row)
    return sorted(rows, key=lambda r: -r.get("ms", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/kernel-floors-h200.json"))
    args = parser.parse_args()
    lengths = flagship_lengths()
    record = {
        "date": datetime.now(timezone.utc).isoformat(),
        "git_commit": commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "lengths": "benchmarks.attention.flagship_lengths (no empty histories)",
        "rows_per_step": int(lengths.sum()),
        "bytes": "each operand read once and each result written once, as the kernels are designed "
        "(stored dS at the true pairs); FLOPs: the products over the visible pairs",
        "blocks": {},
    }
    for block, (file, run) in PROFILES.items():
        results = json.loads((ROOT / "benchmarks/results" / file).read_text())
        profile = next(r for r in results["results"] if r["name"] == run)
        peak_flops, bandwidth = PEAKS[results["hardware"].removeprefix("1x ")]
        rows = floors(block, lengths, profile, peak_flops, bandwidth)
        record["blocks"][block] = dict(
            profile=f"{file}: {run} (commit {results['commit'][:8]}, {results['hardware']})",
            peak_tflops=peak_flops / 1e12,
            bandwidth_tb_s=bandwidth / 1e12,
            rows=rows,
        )
        print(f"{block} ({results['hardware']}, profile {file}: {run})")
        print(f"{'kernel':28} {'ms':>6} {'TFLOP/s':>8} {'TB/s':>5} {'floor ms':>9} {'bound':>8} {'x floor':>8}")
        for r in rows:
            floor = max(r["compute_floor_ms"], r["memory_floor_ms"])
            if "ms" in r:
                line = f"{r['ms']:6.2f} {r['tflops']:8.0f} {r['tbytes_per_s']:5.2f}"
                ratio = f"{r['over_floor']:8.1f}"
            else:
                line, ratio = f"{'-':>6} {'-':>8} {'-':>5}", f"{'-':>8}"
            print(f"{r['kernel']:28} {line} {floor:9.2f} {r['bound']:>8} {ratio}")
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
