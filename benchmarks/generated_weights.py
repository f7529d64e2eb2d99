"""The personalized FFN's generated K/V at gem_base's shapes on a GPU, compiled, both backwards in one run.

    python benchmarks/generated_weights.py [--out benchmarks/results]

One layer's K and V (``gem.models.sequence.generate_weights`` on each half of the projection, as
``PersonalizedFFN`` calls it): 1,024 examples, 256 K/V rows, 4 summary tokens, 512 columns each,
bf16 under torch.compile. ``reference`` is the backward as reductions and GEMMs over the gradient
(three reads of it); ``triton`` is ``kernels.generated_weights`` (one read). The forward is the
same fused Inductor kernel in both. Times are ``triton.testing.do_bench`` medians of the forward
alone and of forward and backward, the two backends in turn three times (``rounds``; ``backends``:
the medians); ``rel_diff`` compares the two backwards' gradients. Writes
``generated-weights-<hardware>.json`` with the versions and the commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scaling import environment  # noqa: E402
from gem.models.sequence import generate_weights  # noqa: E402

NUM_SEQS, NUM_KV, NUM_SUMMARY, WIDTH = 1024, 256, 4, 512
BACKENDS = ("reference", "triton")
ROUNDS = 3


def compiled_layer(backend: str, shared, mix, generated):
    """One layer's K and V through ``generate_weights`` with ``backend``, compiled."""
    parts = (slice(0, WIDTH), slice(WIDTH, None))
    return torch.compile(lambda: [generate_weights(shared[:, p], mix, generated[..., p], backend) for p in parts])


def measure(layer, leaves, grads) -> dict:
    """do_bench medians (ms) of the forward alone and of forward and backward."""
    from triton.testing import do_bench

    def forward_backward():
        torch.autograd.backward(layer(), grads)

    with torch.no_grad():
        fwd = do_bench(layer, warmup=50, rep=300)
    both = do_bench(forward_backward, warmup=50, rep=300, grad_to_none=leaves)
    return {"fwd_ms": fwd, "fwd_bwd_ms": both, "bwd_ms": both - fwd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/generated_weights.py needs a CUDA GPU")
    torch.manual_seed(0)
    shared = torch.randn(NUM_KV, 2 * WIDTH, device="cuda", requires_grad=True)
    mix = torch.randn(NUM_KV, NUM_SUMMARY, device="cuda", requires_grad=True)
    generated = torch.randn(NUM_SEQS, NUM_SUMMARY, 2 * WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.randn(NUM_SEQS, NUM_KV, WIDTH, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    record = {"benchmark": "generated_weights", **environment(), "shape": [NUM_SEQS, NUM_KV, NUM_SUMMARY, WIDTH]}
    leaves = [shared, mix, generated]
    layers, results = {}, {}
    for backend in BACKENDS:  # compiled and run once each: the gradients to compare
        layers[backend] = compiled_layer(backend, shared, mix, generated)
        for t in leaves:
            t.grad = None
        torch.autograd.backward(layers[backend](), grads)
        results[backend] = [t.grad.detach().float().clone() for t in leaves]
    record["rounds"] = []  # the backends in turn, ROUNDS times: an order effect shows as a trend
    for _ in range(ROUNDS):
        record["rounds"].append({backend: measure(layers[backend], leaves, grads) for backend in BACKENDS})
        print(record["rounds"][-1], flush=True)
    record["backends"] = {
        backend: {
            key: statistics.median(r[backend][key] for r in record["rounds"]) for key in record["rounds"][0][backend]
        }
        for backend in BACKENDS
    }
    record["rel_diff"] = {
        name: ((a - b).norm() / b.norm()).item()
        for name, a, b in zip(["d_shared", "d_mix", "d_gen"], results["triton"], results["reference"])
    }
    hardware = torch.cuda.get_device_name().split()[-1].lower()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"generated-weights-{hardware}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
