"""End to end: the flagship run (``experiment=gem_base_h200``) for both blocks, against a padded baseline.

    python benchmarks/e2e.py [--runs interformer kunlun padded-interformer padded-kunlun] [--steps 160]
                             [--warmup 40] [-- hydra overrides for every run]

Each run is ``python -m gem.train experiment=gem_base_h200 model.block=<block>`` in a fresh process
(so the time to first step includes the imports; the Inductor and Triton caches on disk are
shared, as between a user's runs). From its ``metrics.jsonl`` the benchmark takes the median of
the logged windows after ``--warmup`` steps: examples/s, step time, TFLOP/s and MFU (FLOPs on the
true jagged lengths, also for the padded runs: no credit for padding), and the peak device memory;
``startup.json`` gives the time to first step by phase; ``trainer.profile`` records six steps after
the warm-up and gives the device time by kind (windows holding a profiled step are left out).
``fbgemm-<block>`` / ``fbgemm-nopipe-<block>`` shard the tables on FBGEMM's CUDA kernels
(``sparse=torchrec``) with and without TorchRec's pipeline; ``blocks-<block>`` compiles the dense
arch a graph per block (``parallelism.compile_scope=blocks``; the flagship compiles it as one
graph); ``combo-<block>`` turns on Inductor's combo kernels (``parallelism.inductor``), ``static-<block>``
its static launcher for user Triton kernels, ``autotune-<block>`` its GEMM autotuning,
``nographs-<block>`` runs without the flagship's CUDA graphs (and the 2,048-row bucket they need),
``graphs8k-<block>`` with them over an 8,192-row bucket, ``unfused-<block>`` with the rotary
self-attention as two calls (``kernels.rotary_fused=false``), ``gluon-<block>`` with the Gluon
kernels under compile (``experimental.kernels.gluon_compiled=true``), ``noscatter-<block>`` with the gathers'
gradients scattered into gradients of zeros (``experimental.parallelism.scatter_in_place=false``), ``gemmgenw-<block>``
with the personalized FFN's K/V gradients as a sum and two GEMMs (``kernels.generated_weights=false``),
``cdt-<block>`` with Inductor's coordinate-descent tuning of its kernels (and without its static
launcher: a warm start still tuned them again, 63 s to its first step in torch 2.11), ``rowbias-<block>``
with biases on the layers' projections of every event row (``model.row_bias=true``; the flagship drops
them since stop 64, measured then as ``nobias-<block>`` against the biased flagship), ``mmadd-<block>``
with the residual added after the GEMM instead of in cuBLAS's ``addmm``
(``experimental.parallelism.residual_addmm=false``).
``cold-<block>`` and ``warm-<block>`` run a block for a few steps, on a machine without and then
with the caches (data, Inductor, Triton), for the time to first step.

**The padded baseline** (``padded-<block>``) is the model a user would write without gem's jagged
kernels: :class:`PaddedGEMDenseArch` pads every history to the batch's ``max_len`` (right-padded),
so every dense layer runs on ``B x max_len`` rows, and attention runs on ``[B, H, L, D]`` through
PyTorch's ``scaled_dot_product_attention`` with a key-padding mask (softmax) or plain PyTorch
matmuls (GDPA, and the pooling queries' scores and weighted sum: the same math as the jagged
runs' pooling, see gem.models.sequence.PoolingByAttention), compiled a graph per block, without
CUDA graphs (its steps are GPU-bound) and without the row bucket (it pads to ``max_len``). It
measures throughput only: its padded rows feed the "most recent events" summary, so its losses are
not comparable.

Writes ``benchmarks/results/e2e-<hardware>.json`` (``--tag``: ``e2e-<tag>.json``) after every run, so a
time limit that cuts a run keeps the ones before it, and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scaling import environment  # noqa: E402
from gem.models import sequence  # noqa: E402
from gem.models.gem_arch import GEMDenseArch  # noqa: E402
from gem.sparse.arch import JaggedEmbeddings, SparseOutput  # noqa: E402
from kernels.jagged import jagged_to_padded, offsets_to_lengths  # noqa: E402
from kernels.jagged_attention.reference import pointwise_activation  # noqa: E402
from kernels.rotary import rotary_reference  # noqa: E402

_jagged_attention = sequence.jagged_attention
_attention_pooling = sequence.attention_pooling
_valid_rows: dict[str, torch.Tensor] = {}  # the padded batch's true rows per example [B] (one event stream)


def padded_attention(
    q,
    k,
    v,
    q_offsets,
    kv_offsets,
    max_q_len,
    max_kv_len,
    *,
    activation="softmax",
    scale=None,
    post_scale=None,
    causal=False,
    window=None,
    block_size=None,
    backend=None,
    settings=None,
):
    """``kernels.jagged_attention``'s arguments on padded rows (every example ``max_len`` rows),
    computed as a padded model does: SDPA with a key-padding mask, or GDPA as two matmuls."""
    if backend != "padded":
        return _jagged_attention(
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
            backend=backend,
            settings=settings,
        )
    if causal or window is not None or block_size is not None:
        raise NotImplementedError("the padded baseline covers gem_base's attention: no causal, window or block mask")
    valid = _valid_rows["rows"]
    num_batches, (num_heads, head_dim) = valid.numel(), q.shape[-2:]
    if kv_offsets is None:  # GDPA-PFFN: padded queries [B*L, H, D] against dense K/V [B, N, H, D]
        qp = q.view(num_batches, -1, num_heads, head_dim)
        s = torch.einsum("blhd,bnhd->bhln", qp, k) * (scale or head_dim**-0.5)
        o = torch.einsum("bhln,bnhd->blhd", pointwise_activation(s, activation) * post_scale, v)
        return o.reshape(q.shape)
    length = max_kv_len
    keys = torch.arange(length, device=q.device)[None, :] < valid[:, None]  # [B, L]
    keys[:, 0] = True  # an empty history still has a (padding) key, so that no row is all -inf
    mask = keys[:, None, None, :]
    kp, vp = (t.view(num_batches, length, num_heads, head_dim).transpose(1, 2) for t in (k, v))
    if q_offsets is None:  # pooling queries [N, H, D] shared by the batch -> [B, N, H, D]
        qp = q.transpose(0, 1)[None].expand(num_batches, -1, -1, -1)
        return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale).transpose(1, 2)
    qp = q.view(num_batches, length, num_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
    return o.transpose(1, 2).reshape(q.shape)


def padded_pooling(x, a, offsets, max_len, backend=None):
    """``kernels.attention_pooling`` on padded rows (every example ``max_len`` rows) in PyTorch."""
    if backend != "padded":
        return _attention_pooling(x, a, offsets, max_len, backend=backend)
    valid = _valid_rows["rows"]
    rows = x.view(valid.numel(), max_len, x.shape[1])
    keys = torch.arange(max_len, device=x.device)[None, :] < valid[:, None]  # [B, L]
    keys[:, 0] = True  # as padded_attention: an empty history pools its padding row
    scores = (rows @ a).masked_fill(~keys[..., None], float("-inf"))
    return torch.softmax(scores, dim=1).transpose(1, 2) @ rows


def padded_self_attention(qkv, cos, sin, offsets, max_len, *, causal=False, window=None, backend=None, settings=None):
    """``kernels.jagged_attention.rotary_self_attention`` as a padded model computes it: the rotary
    embedding's PyTorch formula, then :func:`padded_attention`."""
    q, k, v = rotary_reference(qkv, cos, sin)
    return padded_attention(
        q, k, v, offsets, offsets, max_len, max_len, causal=causal, window=window, backend=backend, settings=settings
    )


def padded_packed_kv_attention(q, kv, offsets, max_len, *, scale=None, backend=None, settings=None):
    """``kernels.jagged_attention.packed_kv_attention`` (pooling queries over packed K/V) as a
    padded model computes it: :func:`padded_attention` on K and V."""
    k, v = kv.unbind(1)
    return padded_attention(q, k, v, None, offsets, None, max_len, scale=scale, backend=backend, settings=settings)


class PaddedGEMDenseArch(GEMDenseArch):
    """GEMDenseArch on padded histories (see the module docstring); FLOPs counted on true lengths."""

    def __init__(self, *args, **kwargs) -> None:
        if len(kwargs["schema"].sequence_groups) != 1:
            raise ValueError("the padded baseline pads one event stream")
        super().__init__(*args, **(kwargs | {"attention_backend": "padded"}))
        sequence.jagged_attention = padded_attention  # the blocks' attention calls, in this process
        sequence.rotary_self_attention = padded_self_attention  # self-attention's rotary embedding: PyTorch, compiled
        sequence.attention_pooling = padded_pooling
        sequence.packed_kv_attention = padded_packed_kv_attention

    def forward(self, sparse: SparseOutput, dense: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        ((name, s),) = sparse.sequences.items()
        num_batches, length = s.offsets.numel() - 1, s.max_len
        padded = jagged_to_padded(s.values, s.offsets, length)  # [B, L, D]
        extra = self.num_summary if self.block == "interformer" else 0  # CLS rows, prepended
        _valid_rows["rows"] = offsets_to_lengths(s.offsets) + extra
        uniform = torch.arange(num_batches + 1, device=s.offsets.device) * length
        rows = JaggedEmbeddings(padded.reshape(num_batches * length, -1), uniform, length)
        return super().forward(SparseOutput(sparse.pooled, {name: rows}), dense, domain)


NO_GRAPHS = ["parallelism.row_bucket=0", "parallelism.inductor.triton.cudagraphs=false"]
# Run-name prefixes: <prefix>-<block> adds these overrides to the flagship's.
VARIANTS = {
    # compiled block by block, as its figures in docs/e2e.md were measured, without CUDA graphs (its
    # padded batches are GPU-bound) and without the row bucket (its own padding is to max_len)
    "padded": [
        "model._target_=benchmarks.e2e.PaddedGEMDenseArch",
        "parallelism.compile_scope=blocks",
        *NO_GRAPHS,
    ],
    # TorchRec-sharded tables on FBGEMM's fused CUDA kernels (needs the CUDA fbgemm-gpu build,
    # tools/fbgemm_gpu_parts.sh), with and without TrainPipelineSparseDist
    "fbgemm-nopipe": ["sparse=torchrec", "sparse.pipeline=false"],
    "fbgemm": ["sparse=torchrec", "sparse.pipeline=true"],
    # a graph per block (the flagship compiles the whole dense arch as one graph)
    "blocks": ["parallelism.compile_scope=blocks"],
    # torchao float8 on the wide projections (parallelism.float8; the torchao wheel carried in .whl/)
    "float8": ["parallelism.float8=true"],
    # Inductor's combo kernels: independent small kernels launched as one (fewer launches a step)
    "combo": ["+parallelism.inductor.combo_kernels=true"],
    # Inductor's own launcher for user Triton kernels (the attention, rotary and pooling kernels)
    "static": ["+parallelism.inductor.static_launch_user_defined_triton_kernels=true"],
    # Inductor's GEMM autotuning: cuBLAS against its Triton GEMM templates, which can take pointwise epilogues
    "autotune": ["+parallelism.inductor.max_autotune_gemm=true"],
    # the flagship without CUDA graphs and the row bucket they need (its default before 2026-12-04)
    "nographs": NO_GRAPHS,
    # CUDA graphs with the inputs padded to a multiple of 8,192 event rows (the flagship's: 2,048),
    # four times the padding and about a quarter of the shapes to record
    "graphs8k": ["parallelism.row_bucket=8192"],
    # rotary self-attention as two calls, the rotary kernel and then the attention (the flagship fuses them)
    "unfused": ["kernels.rotary_fused=false"],
    # the personalized FFN's Gluon kernels under compile, through the opaque op (docs/kernels.md)
    "gluon": ["experimental.kernels.gluon_compiled=true"],
    # row gathers' gradients scattered into a gradient of zeros, not in place (gem.distributed.inductor_passes)
    "noscatter": ["experimental.parallelism.scatter_in_place=false"],
    # the personalized FFN's K/V gradients as a sum and two GEMMs, not kernels.generated_weights' one read
    "gemmgenw": ["kernels.generated_weights=false"],
    # Inductor's coordinate-descent tuning of its own kernels at their first launch (a cold first step
    # of minutes; the tuned configs are cached beside the kernels). Without the static launcher, whose
    # cache check drops the tuned mark before pytorch#172819's fix; in torch 2.11 a warm start still
    # tuned again (2026-12-05: 63 s to the first step, docs/log/e2e.md)
    "cdt": [
        "+parallelism.inductor.coordinate_descent_tuning=true",
        "+parallelism.inductor.use_static_cuda_launcher=false",
    ],
    # biases on the layers' projections of every event row (Q/K/V, the outputs), which the flagship
    # drops since stop 64 (a model change: compare the losses too)
    "rowbias": ["model.row_bias=true"],
    # the residual added after the output projections' GEMMs, fused into the next LayerNorm kernel,
    # not by cuBLAS's addmm after a copy of the residual (gem.distributed.inductor_passes)
    "mmadd": ["experimental.parallelism.residual_addmm=false"],
}


def launch(name: str, overrides: list[str], run_dir: Path, steps: int, warmup: int) -> dict:
    """One training run in its own process."""
    block, variant = parse_run(name)
    profile = [] if _startup_only(name) else [f"trainer.profile.start={warmup + 1}", "trainer.profile.steps=6"]
    cmd = [
        sys.executable,
        "-m",
        "gem.train",
        "experiment=gem_base_h200",
        f"model.block={block}",
        *variant,
        f"trainer.max_steps={steps}",
        "trainer.log_every=10",
        "trainer.progress_bar=false",
        f"trainer.run_dir={run_dir}",
        *profile,
        *overrides,
    ]
    print("$", " ".join(cmd), flush=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    tick = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=os.environ | {"PYTHONPATH": path})
    return {"returncode": done.returncode, "wall_s": round(time.perf_counter() - tick, 1)}


def parse_run(name: str) -> tuple[str, list[str]]:
    """A run name's block and the overrides its prefix adds: ``<block>``, ``<variant>-<block>``,
    ``cold-<block>`` or ``warm-<block>``; anything else raises, naming the choices."""
    prefix, _, block = name.rpartition("-")
    if block not in ("interformer", "kunlun") or prefix not in ("", "cold", "warm", *VARIANTS):
        raise ValueError(
            f"--runs {name}: expected <block>, <variant>-<block>, cold-<block> or warm-<block> with block "
            f"interformer or kunlun and variant one of {', '.join(VARIANTS)}"
        )
    return block, VARIANTS.get(prefix, [])


def _startup_only(name: str) -> bool:
    """cold-<block> / warm-<block>: a few steps, for the time to first step (empty / warm caches)."""
    return name.startswith(("cold", "warm"))


def collect(name: str, run_dir: Path, warmup: int) -> dict:
    """A run's figures from the files it wrote."""
    result = {"name": name}
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    train = [r for r in rows if r["kind"] == "train"]
    profiled = run_dir / "profile" / "breakdown_rank0.json"
    lo, hi = json.loads(profiled.read_text())["recorded_steps"] if profiled.exists() else (0, -1)
    # windows after the warm-up that do not hold a profiled step (or the profiler's warm-up step)
    windows = [
        r
        for prev, r in zip([{"step": 0}] + train, train)
        if r["step"] > warmup and not (prev["step"] < hi and r["step"] >= lo - 1)
    ]
    if windows:
        median = lambda key: statistics.median(r[key] for r in windows) if windows[0].get(key) is not None else None  # noqa: E731
        result |= {key: median(key) for key in ("examples_per_s", "step_ms", "tflops", "mfu", "data_wait_frac")}
        result["peak_mem_gb"] = max(r.get("peak_mem_gb") or 0 for r in windows) or None  # None on CPU
        result["windows"] = len(windows)
    result["losses"] = {r["step"]: r["loss"] for r in train}
    result["step_ms_by_window"] = {r["step"]: r["step_ms"] for r in train}  # every window's, the warm-up's too
    result["test"] = next((r for r in rows if r["kind"] == "test"), None)
    log = run_dir / "train.log"
    if log.exists():  # the model line (sparse backend, tables with the fused optimizer) and the pipeline's state
        result["log"] = [line for line in log.read_text().splitlines() if "pipeline" in line or "tables" in line][:8]
    for key, file in (("startup", "startup.json"), ("breakdown", "profile/breakdown_rank0.json")):
        if (run_dir / file).exists():
            result[key] = json.loads((run_dir / file).read_text())
    return result


def loss_curves(files: list[str]) -> dict[str, dict[str, dict]]:
    """``{block: {label: {step: loss}}}`` of every run in ``files`` (a variant's runs,
    ``gluon-kunlun``, beside the block's): result files of this script, A/B files whose ``runs`` map
    a label to one (e2e-h200-pffn-ab.json), or files transcribed from a run's log whose ``runs`` map
    a run's name to its ``windows`` (e2e-h200-graphs-2.json). A curve is labelled by its run's name,
    or by its file's stem (or A/B label) where several files hold a run of that name."""
    found = []  # (block, label, run name, losses)
    for file in files:
        data = json.loads(Path(file).read_text())
        labelled = data["runs"].items() if "runs" in data else [(None, data)]
        for label, result in labelled:
            if "windows" in result:  # transcribed: the run's name, its losses in its windows
                windows = result["windows"]
                result = {"results": [{"name": label, "losses": {k: w["loss"] for k, w in windows.items()}}]}
                label = None
            for run in result["results"]:
                found.append((run["name"].split("-")[-1], label or Path(file).stem, run["name"], run["losses"]))
    runs_named = collections.Counter((block, name) for block, _, name, _ in found)
    curves: dict[str, dict[str, dict]] = {}  # block -> label -> {step: loss}
    for block, label, name, losses in found:
        repeated = runs_named[block, name] > 1
        curves.setdefault(block, {})[(label if name == block else f"{label}: {name}") if repeated else name] = losses
    return curves


def plot_losses(files: list[str], out: str) -> None:
    """The training loss per logged window of every run in ``files`` (:func:`loss_curves`), one
    panel per block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = loss_curves(files)
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
    for ax, (name, runs) in zip(axes[0], sorted(curves.items())):
        for label, losses in runs.items():
            ax.plot([int(k) for k in losses], list(losses.values()), marker="o", label=label)
        ax.set(title=name, xlabel="step (end of the 10-step window)", ylabel="mean training loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )  # a mistyped --out is an error, not --out-dir (the JSON always goes to benchmarks/results)
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["interformer", "kunlun", "padded-interformer", "padded-kunlun", "warm-interformer"],
    )  # cold-<block> first on a fresh machine
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--warmup", type=int, default=40, help="steps left out of the figures")
    parser.add_argument("--warm-steps", type=int, default=10, help="steps of a cold-* or warm-* run")
    parser.add_argument("--out-dir", default=str(ROOT / "runs" / "e2e"))
    parser.add_argument("--tag", default=None, help="file name suffix (default: the hardware, slugged)")
    parser.add_argument(
        "--collect",
        action="store_true",
        help="only read the runs already in --out-dir (e.g. after a time limit cut the benchmark)",
    )
    parser.add_argument(
        "--plot-losses", nargs="+", metavar="JSON", help="plot the loss curves of these result files and exit"
    )
    parser.add_argument("--plot-out", default="e2e-losses.png", help="where --plot-losses writes")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    if args.plot_losses:
        plot_losses(args.plot_losses, args.plot_out)
        return
    for name in args.runs:
        try:
            parse_run(name)
        except ValueError as e:
            parser.error(str(e))  # before the first run, not after an hour of them
    env = environment()
    tag = args.tag or "".join(c if c.isalnum() else "-" for c in env["hardware"].lower()).strip("-")
    out = ROOT / "benchmarks" / "results" / f"e2e-{tag}.json"
    results = []
    for name in args.runs:
        run_dir = Path(args.out_dir) / name
        launched = (
            {}
            if args.collect
            else launch(
                name, args.overrides, run_dir, args.warm_steps if _startup_only(name) else args.steps, args.warmup
            )
        )
        results.append(collect(name, run_dir, args.warmup) | launched)
        write_results(out, env, args, results)  # after every run: a time limit that cuts the next keeps these
    print(
        f"\n{'run':<20} {'rc':>3} {'examples/s':>11} {'step ms':>8} {'TFLOP/s':>8} {'MFU':>6} {'mem GB':>7} "
        f"{'first step s':>12} {'vs padded':>9}"
    )
    for r in results:
        cell = lambda key, fmt, r=r: format(r[key], fmt) if r.get(key) is not None else "-"  # noqa: E731
        first = r.get("startup", {}).get("total")
        print(
            f"{r['name']:<20} {r.get('returncode', '-'):>3} {cell('examples_per_s', '11.0f')} "
            f"{cell('step_ms', '8.1f')} "
            f"{cell('tflops', '8.1f')} {cell('mfu', '6.1%')} {cell('peak_mem_gb', '7.1f')} "
            f"{format(first, '12.1f') if first else '-':>12} {cell('vs_padded', '9.2f')}"
        )
    print(f"wrote {out}")


def write_results(out: Path, env: dict, args: argparse.Namespace, results: list[dict]) -> None:
    """The benchmark's JSON: the environment, the arguments and the runs so far (each padded
    baseline's ratio filled in once both runs are in)."""
    by_name = {r["name"]: r for r in results}
    for r in results:
        base = by_name.get(f"padded-{r['name']}")
        if base and r.get("examples_per_s") and base.get("examples_per_s"):
            r["vs_padded"] = r["examples_per_s"] / base["examples_per_s"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "e2e",
                "date": datetime.datetime.now(datetime.UTC).isoformat(),
                **env,
                "experiment": "gem_base_h200",
                "steps": args.steps,
                "warmup": args.warmup,
                "overrides": args.overrides,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
