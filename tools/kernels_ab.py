"""Times one tree's jagged attention kernels for an A/B between commits on one GPU.

The rows: gem triton on the five target shapes of PERFORMANCE_TARGETS.md (H=4, D=128, bf16),
softmax and fast_gelu, forward and forward+backward. Run it for each tree in turn, alternating
(A B A B), so that both see the same GPU states, and compare the JSONs::

    git archive <commit> kernels | tar -x -C /tmp/a     # the same for the other commit
    python tools/kernels_ab.py /tmp/a a1 a1.json        # TREE LABEL OUT_JSON

The timing is benchmarks/attention.py's (triton do_bench medians, an idle second before each row);
a tree that has ``testing.record_paths`` also records the kernels each row took.
"""

import json
import sys
import time

SHAPES = [  # (name, layout, B, max_len, fill), benchmarks/attention.py's TARGET_SHAPES
    ("self 1152x512 fill 0.5", "jagged", 1152, 512, 0.5),
    ("self 1152x1024 fill 0.5", "jagged", 1152, 1024, 0.5),
    ("self 1152x2048 fill 0.5", "jagged", 1152, 2048, 0.5),
    ("self 1152x1024 fill 1.0", "jagged", 1152, 1024, 1.0),
    ("pffn 1024x1000 fill 0.5 kv256", "dense_kv", 1024, 1000, 0.5),
]


def main(tree: str, label: str, out: str) -> None:
    sys.path.insert(0, tree)
    import torch
    import triton

    from kernels.jagged_attention import jagged_attention, num_visible_pairs
    from kernels.jagged_attention.inputs import make_inputs, random_lengths

    try:
        from kernels.jagged_attention.testing import record_paths
    except ImportError:  # a tree from before the split
        record_paths = None

    def bench(fn, grad_to_none=None):
        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")

    rows = []
    for name, layout, batch, max_len, fill in SHAPES:
        for activation in ("fast_gelu", "softmax"):
            gen = torch.Generator().manual_seed(0)
            lengths = random_lengths(batch, max_len, fill, gen)
            inputs = make_inputs(
                lengths,
                num_heads=4,
                head_dim=128,
                layout=layout,
                num_dense_kv=256,
                dtype=torch.bfloat16,
                device="cuda",
                generator=gen,
            )
            inputs.max_q_len = max_len
            if inputs.max_kv_len is not None:
                inputs.max_kv_len = max_len
            flops = 4 * 4 * 128 * num_visible_pairs(inputs.q_lengths, inputs.kv_lengths, False, None, None)
            tensors = list(inputs.tensors())

            def forward(activation=activation, inputs=inputs):
                return jagged_attention(*inputs.args(), activation=activation, backend="triton")

            paths = None
            if record_paths is not None:
                with record_paths() as chosen:
                    out_ = forward()
                    out_.backward(torch.randn_like(out_))
                paths = [str(p) for p in chosen]
            for t in tensors:
                t.grad = None
            torch.cuda.synchronize()
            time.sleep(1.0)
            with torch.no_grad():
                fwd_ms = bench(forward)
            grad = torch.randn_like(forward())

            def step(forward=forward, grad=grad):
                forward().backward(grad)

            full_ms = bench(step, grad_to_none=tensors)
            for t in tensors:
                t.grad = None
            row = dict(
                label=label,
                shape=name,
                activation=activation,
                fwd_ms=fwd_ms,
                full_ms=full_ms,
                fwd_tflops=flops / fwd_ms / 1e9,
                full_tflops=3.5 * flops / full_ms / 1e9,
                sm_clock_mhz=torch.cuda.clock_rate(),
                paths=paths,
            )
            rows.append(row)
            speeds = f"fwd {row['fwd_tflops']:6.1f} full {row['full_tflops']:6.1f}"
            print(f"{label:6} {name:32} {activation:9} {speeds} {paths}", flush=True)
            torch.cuda.empty_cache()
            with open(out, "w") as f:  # after every row, so that a run cut short keeps its rows
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
