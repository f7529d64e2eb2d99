"""The jagged attention kernel on its own, without the rest of gem (``kernels`` needs torch and triton only).

    python examples/kernel_only.py                       # CPU: the PyTorch reference (the spec)
    TRITON_INTERPRET=1 python examples/kernel_only.py    # CPU: also the Triton kernel, in Triton's interpreter (slow)
    python examples/kernel_only.py                       # on a CUDA machine: the Triton kernel, bf16

Three sequences of different lengths (one empty) packed back to back, softmax attention (Jagged
Flash Attention) and a GDPA (SiLU) variant, forward and backward; where the Triton kernel runs it is
compared with the reference.
"""

from __future__ import annotations

import os

import torch

from kernels import jagged_attention


def main() -> dict[str, float]:
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    lengths = [5, 0, 3]  # jagged: no padding, an empty sequence is legal
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)  # [B+1] = [0, 5, 5, 8]
    heads, head_dim = 2, 32
    q, k, v = (
        torch.randn(offsets[-1].item(), heads, head_dim, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    backends = ["reference"] + (["triton"] if cuda or os.environ.get("TRITON_INTERPRET") == "1" else [])
    errors: dict[str, float] = {}
    for activation, causal in (("softmax", True), ("silu", False)):
        results = {}
        for backend in backends:
            out = jagged_attention(
                q,
                k,
                v,
                offsets,
                offsets,
                max(lengths),
                max(lengths),
                activation=activation,
                causal=causal,
                backend=backend,
            )  # [T, H, D], rows of every sequence
            (grad_q,) = torch.autograd.grad(out.float().square().sum(), q)
            results[backend] = (out.float(), grad_q.float())
        ref_out, ref_grad = results["reference"]
        line = f"{activation:8s} causal={causal!s:5s} out {tuple(ref_out.shape)} |out| {ref_out.abs().mean():.4f}"
        if "triton" in results:
            out_err = (results["triton"][0] - ref_out).abs().max().item()
            grad_err = (results["triton"][1] - ref_grad).abs().max().item()
            errors[activation] = max(out_err, grad_err)
            line += f"; triton vs reference: max |out| diff {out_err:.2e}, max |dq| diff {grad_err:.2e}"
        print(line)
    print(f"backends run: {', '.join(backends)} on {device}")
    return errors


if __name__ == "__main__":
    main()
