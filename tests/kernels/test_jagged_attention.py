"""Numerics of kernels.jagged_attention: Triton backend vs the reference (the spec).

CPU tier: small shapes in Triton's interpreter, hypothesis-drawn jagged lengths (zeros
included). GPU tier (``-m gpu``): real shapes on CUDA, torch.compile with Inductor.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
from importlib import metadata

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from gem.versions import KNOWN_GOOD
from kernels import jagged_attention
from kernels.jagged_attention import ACTIVATIONS, check_offsets, num_visible_pairs, testing
from kernels.jagged_attention import settings as kernel_config
from kernels.jagged_attention.batch_order import batch_order
from kernels.jagged_attention.inputs import LAYOUTS, make_inputs

# ||triton - reference|| / ||reference||, reference in float64 on the same rounded inputs.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
MASKS = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": 5},
    "block": {"block_size": 16},
    "causal_window": {"causal": True, "window": 7},
    "causal_block": {"causal": True, "block_size": 16},
}
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


ROOT = pathlib.Path(__file__).resolve().parents[2]


# The sm_90 compile check runs with each Triton release of gem.versions.KNOWN_GOOD: the venv's, and
# every other one from the folder that `make install` puts it in (Makefile).
TRITON_PINS = sorted({combo.triton_pin for combo in KNOWN_GOOD})


@pytest.fixture
def kernel_settings():
    """``kernel_settings(store_ds=False, ...)`` changes the kernels' settings for the rest of the
    test (``testing.override``); they are restored after it."""
    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(testing.override(**values))


@pytest.fixture
def paths():
    """The kernels each launch of the test chose, in order (``testing.record_paths``)."""
    with testing.record_paths() as chosen:
        yield chosen


def _run_python(args: list[str], timeout: int, drop=(), path=(), **env) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root with ``path`` and it first on PYTHONPATH: this
    environment, less the variables in ``drop``, plus ``env``."""
    environ = {k: v for k, v in os.environ.items() if k not in drop} | env
    environ["PYTHONPATH"] = os.pathsep.join([*map(str, path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout
    )


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e||, with an absolute floor of 1e-2 per element for (near-)zero
    references, e.g. dQ of a softmax over one key, which is exactly zero."""
    expected = expected.double()
    floor = 1e-2 * max(expected.numel(), 1) ** 0.5
    return (actual.double() - expected).norm().item() / max(expected.norm().item(), floor)


def _check_against_reference(inputs, dtype, tolerance=None, **kwargs) -> None:
    """Output and dQ, dK, dV of the Triton backend vs the float64 reference: finite, and within
    ``tolerance`` (the dtype's by default) in relative error."""
    out = jagged_attention(*inputs.args(), backend="triton", **kwargs)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs.tensors(), grad_out)

    ref_tensors = [t.detach().double().requires_grad_() for t in inputs.tensors()]
    ref_args = (*ref_tensors, *inputs.args()[3:])
    ref_out = jagged_attention(*ref_args, backend="reference", **kwargs)
    ref_grads = torch.autograd.grad(ref_out, ref_tensors, grad_out.double())

    assert out.dtype == dtype and out.shape == ref_out.shape
    for name, actual, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert torch.isfinite(actual).all(), f"{name} has non-finite values"
        error = _relative_error(actual, expected)
        assert error < (tolerance or TOLERANCE[dtype]), f"{name}: relative error {error:.2e} ({kwargs})"


@st.composite
def _lengths(draw, max_batches=4, max_len=40):
    num_batches = draw(st.integers(1, max_batches))
    return draw(st.lists(st.integers(0, max_len), min_size=num_batches, max_size=num_batches))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    q_lengths=_lengths(),
    kv_lengths=_lengths(),
    mask=st.sampled_from(sorted(MASKS)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    head_dim=st.sampled_from([32, 48, 64]),
    offsets_dtype=st.sampled_from([torch.int32, torch.int64]),
    max_len_slack=st.integers(0, 5),
    num_dense_kv=st.integers(1, 24),
    num_queries=st.integers(1, 20),
)
def test_matches_reference(
    activation,
    layout,
    q_lengths,
    kv_lengths,
    mask,
    dtype,
    head_dim,
    offsets_dtype,
    max_len_slack,
    num_dense_kv,
    num_queries,
):
    num_batches = min(len(q_lengths), len(kv_lengths))
    inputs = make_inputs(
        q_lengths[:num_batches],
        kv_lengths[:num_batches],
        num_heads=2,
        head_dim=head_dim,
        layout=layout,
        num_dense_kv=num_dense_kv,
        num_queries=num_queries,
        dtype=dtype,
        device=DEVICE,
        offsets_dtype=offsets_dtype,
        max_len_slack=max_len_slack,
    )
    _check_against_reference(inputs, dtype, activation=activation, **MASKS[mask])


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_mode_fixed_lengths(activation, mask):
    """Every activation x mask on lengths with an empty example, odd lengths, multi-block."""
    torch.manual_seed(0)
    inputs = make_inputs([0, 17, 33, 1], [3, 0, 37, 1], num_heads=2, head_dim=32, device=DEVICE)
    _check_against_reference(inputs, torch.float32, activation=activation, **MASKS[mask])


def test_custom_scale_and_post_scale():
    inputs = make_inputs([9, 21], [30, 4], device=DEVICE)
    _check_against_reference(inputs, torch.float32, activation="silu", scale=0.3, post_scale=0.7)
    _check_against_reference(inputs, torch.float32, activation="softmax", scale=0.05)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_empty_sequences_give_zero_output_and_gradients(activation):
    inputs = make_inputs([0, 5, 0], [4, 0, 0], device=DEVICE)  # 2nd example sees no key
    out = jagged_attention(*inputs.args(), activation=activation, backend="triton")
    out.backward(torch.randn_like(out))
    assert torch.equal(out, torch.zeros_like(out))
    for t in inputs.tensors():
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_all_empty_batch():
    inputs = make_inputs([0, 0], [0, 0], device=DEVICE)
    out = jagged_attention(*inputs.args(), backend="triton")
    assert out.shape == (0, 2, 32)
    out.sum().backward()
    assert inputs.k.grad.shape == inputs.k.shape


def test_strided_inputs_from_fused_projection():
    """q, k, v as views of one [T, 3, H, D] projection (row stride 3 * H * D)."""
    torch.manual_seed(0)
    lengths = [7, 0, 26]
    qkv = torch.randn(sum(lengths), 3, 2, 32, device=DEVICE, requires_grad=True)
    inputs = make_inputs(lengths, device=DEVICE)
    inputs.q, inputs.k, inputs.v = qkv.unbind(1)
    out = jagged_attention(*inputs.args(), activation="fast_gelu", backend="triton")
    ref = jagged_attention(*inputs.args(), activation="fast_gelu", backend="reference")
    (grad,) = torch.autograd.grad(out.square().sum(), qkv)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), qkv)
    assert _relative_error(out, ref) < 1e-4 and _relative_error(grad, ref_grad) < 1e-4


def test_backend_none_picks_triton_on_cuda_else_reference():
    inputs = make_inputs([5, 3], device=DEVICE)
    chosen = jagged_attention(*inputs.args())
    expected = jagged_attention(*inputs.args(), backend="triton" if HAS_CUDA else "reference")
    assert torch.equal(chosen, expected)


def test_softmax_gradients_stay_finite_for_very_negative_scores():
    """Every score about -200 in log2 units: lse < -128, so a key past an example's end (score 0)
    would get probability exp2(-lse) = inf in the dQ kernel and turn dQ into NaN. Scores near
    -800 carry float32 rounding of about 1e-4 into the exponent, hence the looser bound."""
    torch.manual_seed(0)
    inputs = make_inputs([5, 19], [7, 21], num_heads=1, head_dim=32, device=DEVICE)
    inputs.q = (5.0 + 0.1 * torch.randn_like(inputs.q)).requires_grad_()
    inputs.k = (-5.0 + 0.1 * torch.randn_like(inputs.k)).requires_grad_()
    _check_against_reference(inputs, torch.float32, tolerance=1e-3, activation="softmax")


def test_flop_counter_counts_the_first_call_of_a_process():
    """The ops and FLOP formulas register when ``kernels`` is imported: a FlopCounterMode opened
    before the first call (it copies the formula registry when created) counted zero while they
    registered lazily on that call."""
    code = (
        "import torch, kernels\n"
        "from torch.utils.flop_counter import FlopCounterMode\n"
        "from kernels.jagged_attention.inputs import make_inputs\n"
        f"inputs = make_inputs([5, 7], num_heads=2, head_dim=32, device={DEVICE!r})\n"
        "with FlopCounterMode(display=False) as counter:\n"
        "    kernels.jagged_attention(*inputs.args(), activation='silu', backend='triton')\n"
        "print(counter.get_total_flops())\n"
    )
    result = _run_python(["-c", code], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) == 4 * 2 * 32 * (5 * 5 + 7 * 7)


def test_flop_counter_counts_true_jagged_lengths():
    inputs = make_inputs([5, 0, 12], [8, 3, 12], num_heads=2, head_dim=32, device=DEVICE)
    with FlopCounterMode(display=False) as counter:
        out = jagged_attention(*inputs.args(), activation="silu", causal=True, backend="triton")
        out.sum().backward()
    pairs = num_visible_pairs(inputs.q_lengths, inputs.kv_lengths, causal=True)
    assert pairs == 15 + 0 + 78
    assert counter.get_total_flops() == 4 * 2 * 32 * pairs * 7 // 2


@pytest.mark.parametrize("mask", [{"window": 4}, {}])  # without a mask, the stored-dS backward
def test_torch_compile_fullgraph(mask, kernel_settings, paths):
    """No graph break: fullgraph=True raises on one. CPU: aot_eager; CUDA: Inductor."""
    kernel_settings(store_ds=True)
    inputs = make_inputs([6, 0, 19], [11, 2, 19], device=DEVICE)

    def attention(q, k, v):
        return jagged_attention(q, k, v, *inputs.args()[3:], activation="silu", backend="triton", **mask)

    compiled = torch.compile(attention, fullgraph=True, backend="inductor" if HAS_CUDA else "aot_eager")
    out = compiled(*inputs.tensors())
    grads = torch.autograd.grad(out.sum(), inputs.tensors())
    ref = attention(*inputs.tensors())
    ref_grads = torch.autograd.grad(ref.sum(), inputs.tensors())
    for actual, expected in zip((out, *grads), (ref, *ref_grads)):
        assert _relative_error(actual, expected) < 1e-5
    assert ("dq_from_ds" in paths) == (not mask)


@pytest.mark.parametrize("on", [False, True])
def test_gluon_compiled_sends_unmasked_pointwise_calls_to_the_opaque_op(on, kernel_settings):
    """settings.gluon_compiled: under torch.compile an unmasked GDPA call goes to the opaque op,
    which launches its kernels itself (the Gluon ones where they apply, on an H200); softmax and
    masked calls stay on the traced op. The same outputs and gradients as eager."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    kernel_settings(gluon_compiled=on)
    inputs = make_inputs([6, 0, 19], [11, 2, 19], device=DEVICE)
    rest = inputs.args()[3:]

    def attention(q, k, v):
        gdpa = jagged_attention(q, k, v, *rest, activation="silu", backend="triton")
        softmax = jagged_attention(q, k, v, *rest, activation="softmax", backend="triton")
        window = jagged_attention(q, k, v, *rest, activation="fast_gelu", window=4, backend="triton")
        return gdpa + softmax + window

    graphs = EagerAndRecordGraphs()
    torch._dynamo.reset()
    out = torch.compile(attention, fullgraph=True, backend=graphs)(*inputs.tensors())
    grads = torch.autograd.grad(out.sum(), inputs.tensors())
    ref = attention(*inputs.tensors())
    ref_grads = torch.autograd.grad(ref.sum(), inputs.tensors())
    for actual, expected in zip((out, *grads), (ref, *ref_grads)):
        assert _relative_error(actual, expected) < 1e-6
    (graph,) = graphs.graphs
    ops = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert ops.count("gem_kernels.jagged_attention_fwd_eager") == on
    assert ops.count("gem_kernels.jagged_attention_fwd") == 3 - on


def test_inductor_counts_only_the_kernels_outputs_as_written():
    """torch.compile clones every kernel argument it counts as written and may not write in
    place; a pointer passed to a @triton.jit helper whose result fed a store address counted as
    written, so every compiled attention call cloned its offsets, and torch 2.11 failed to
    compile that clone under dynamic shapes (gem_base's compiled evaluation). Every kernel, every
    layout: tests/kernels/compile_mutations.py in a subprocess."""
    result = _run_python([str(ROOT / "tests/kernels/compile_mutations.py")], timeout=300, drop=("TRITON_INTERPRET",))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every kernel writes only its outputs" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("pin", TRITON_PINS, ids=lambda pin: f"triton-{pin}")
def test_kernels_compile_for_hopper_without_a_gpu(pin):
    """Every kernel, including the bf16x2 activation path (inline PTX that the interpreter never
    runs), compiles to an sm_90 cubin: tests/kernels/sm90_compile.py in a subprocess. Also with
    fp64 scale arguments, as torch.compile (Inductor) launches them: float32 kernels once failed
    there (a float64 accumulator) or ran their activations in float64.

    With each Triton of gem.versions.KNOWN_GOOD (a Gluon kernel that compiled with 3.7 once failed
    with 3.6): the venv's, and each other one from .venv/triton-<version>/ (`make install`), first
    on PYTHONPATH, with its own cache directory and without gem's version check."""
    path, env = [], {}
    if pin != metadata.version("triton"):
        folder = ROOT / ".venv" / f"triton-{pin}"
        assert (folder / "triton").is_dir(), (
            f"triton {pin} (gem.versions.KNOWN_GOOD) is not installed in {folder}: run `make install`"
        )
        home = os.environ.get("TRITON_HOME", os.path.expanduser("~"))
        cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")
        path, env = [folder], {"TRITON_CACHE_DIR": f"{cache}-{pin}", "GEM_SKIP_VERSION_CHECK": "1"}
    script = str(ROOT / "tests/kernels/sm90_compile.py")
    code = f"import runpy, triton; print('triton', triton.__version__); runpy.run_path({script!r}, run_name='__main__')"
    result = _run_python(["-c", code], timeout=600, drop=("TRITON_INTERPRET",), path=path, **env)
    assert result.returncode == 0, f"the sm_90 compile check failed with triton {pin}:\n{result.stderr[-3000:]}"
    used, *lines = result.stdout.splitlines()
    assert used == f"triton {pin}", f"the sm_90 compile check for triton {pin} ran with {used}"
    where = f"with triton {pin}: {lines}"
    # fast_gelu (fp32 scalars, and fp64 ones as Inductor passes them) and silu: fwd, dK/dV, dQ on
    # the bf16x2 path; gelu (float32 activations; fp32 and fp64 scalars): fwd, dK/dV, dQ; softmax
    # (fp32 and fp64 scalars): fwd, preprocess, dK/dV, dQ.
    # The fp64 passes run without a mask (the kernels' one-loop path), the others causal; the
    # fp64 fast_gelu and gelu passes compile the forward's LATE_PV loop too; last, the float32
    # input forward, plain and LATE_PV. fast_gelu and softmax again without a mask and with
    # the stored-dS backward (the forward, LATE_PV for fast_gelu, the preprocess for softmax, dK/dV
    # storing dS, dQ from dS), with fp32 and with fp64 scalars, and the batch order kernel. Then
    # the Gluon forward (six GDPA cases and two softmax ones, each with its work-list kernel): bf16
    # silu and fast_gelu on the bf16x2 path, no spills (checked in the script); the Gluon dK/dV (three cases on bf16x2,
    # each with its work-list kernel). And kernels.rotary's kernel, both ways, at two head dims;
    # rotary self-attention (Q and K rotated, then the softmax forward and a backward turning dK and
    # dQ back, once storing dS without a mask and once recomputing dQ, causal); and
    # kernels.attention_pooling's two kernels at 16 and 128 columns; the experimental generated-K/V
    # forward and backward's two kernels (bf16 silu and fast_gelu on the bf16x2 path, float32 gelu),
    # each with its batch order.
    assert sum(line.startswith("compiled gluon") for line in lines) == 11, where
    assert sum("_softmax_fwd_kernel" in line for line in lines) == 2, where
    assert sum("bf16x2=True" in line for line in lines) == 5, where
    assert sum("_work_list_kernel" in line for line in lines) == 11, where
    assert sum("packed=True" in line for line in lines) == 22, where
    assert sum("floats=fp64" in line for line in lines) == 20, where
    assert sum("causal=False" in line for line in lines) == 25, where
    assert sum("late_pv=1" in line for line in lines) == 5, where
    assert sum("store_ds=1" in line for line in lines) == 5, where
    assert sum("_bwd_dq_from_ds_kernel" in line for line in lines) == 5, where
    assert sum("_batch_order_kernel" in line for line in lines) == 7, where
    assert sum("_generated_kv_fwd_kernel" in line for line in lines) == 3, where
    assert sum("_generated_kv_dkdv_kernel" in line for line in lines) == 3, where
    assert sum("_generated_kv_dq_kernel" in line for line in lines) == 3, where
    assert sum("_rotary_kernel" in line for line in lines) == 5, where
    assert sum("rope=1" in line for line in lines) == 4, where
    assert sum("_pool_" in line for line in lines) == 4, where
    assert len(lines) == 98, where


@pytest.fixture
def late_pv(kernel_settings):
    """Launch the forward's LATE_PV loop, an autotune candidate that the default config (the
    interpreter's, and the GPU tests' with autotuning off) never takes; the Gluon forward off."""
    kernel_settings(gluon=False)
    with testing.forced_config("fwd", LATE_PV=1):
        yield


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ["fast_gelu", "relu"])
def test_late_pv_forward_loop(activation, layout, late_pv):
    torch.manual_seed(0)
    inputs = make_inputs(
        [0, 17, 33, 1],
        [3, 0, 37, 16],
        num_heads=2,
        head_dim=48,
        layout=layout,
        num_dense_kv=5,
        num_queries=6,
        device=DEVICE,
    )
    _check_against_reference(inputs, torch.float32, activation=activation)


def _stored_ds(paths):
    """A function counting the backwards in ``paths`` that took the dQ-from-dS kernel."""
    return lambda: [path for path in paths if path == "dq_from_ds"]


@pytest.mark.parametrize("layout", ["jagged", "dense_kv"])
@pytest.mark.parametrize("activation", ["softmax", "fast_gelu", "silu", "identity"])
def test_stored_ds_backward(activation, layout, kernel_settings, paths):
    """The stored-dS backward (settings.store_ds, the default): dQ from the dS that the dK/dV
    kernel stored matches the reference (empty and odd lengths, more and fewer keys than queries,
    several key and query blocks); with a mask, a broadcast Q or a buffer over
    settings.store_ds_max_mib the dQ kernel recomputes, and matches too."""
    kernel_settings(store_ds=True)
    calls = _stored_ds(paths)
    torch.manual_seed(0)
    inputs = make_inputs(
        [0, 17, 40, 1, 33],
        [5, 0, 37, 16, 50],
        num_heads=2,
        head_dim=48,
        layout=layout,
        num_dense_kv=21,
        max_len_slack=3,
        device=DEVICE,
    )
    for dtype in (torch.float32, torch.bfloat16):
        inputs.q, inputs.k, inputs.v = (t.detach().to(dtype).requires_grad_() for t in inputs.tensors())
        _check_against_reference(inputs, dtype, activation=activation)
    assert len(calls()) == 2
    _check_against_reference(inputs, torch.bfloat16, activation=activation, causal=True)
    kernel_settings(store_ds_max_mib=0)
    for dtype in (torch.float32, torch.bfloat16):
        inputs.q, inputs.k, inputs.v = (t.detach().to(dtype).requires_grad_() for t in inputs.tensors())
        _check_against_reference(inputs, dtype, activation=activation)
    assert len(calls()) == 2
    broadcast = make_inputs(
        [0, 17, 40], [5, 0, 37], num_heads=2, head_dim=48, layout="broadcast_q", num_queries=6, device=DEVICE
    )
    kernel_settings(store_ds_max_mib=8192)
    _check_against_reference(broadcast, torch.float32, activation=activation)
    assert len(calls()) == 2


def test_stored_ds_out_of_memory(kernel_settings, paths, monkeypatch):
    """No room for the dS buffer (its allocation, the only ``new_empty`` of a shape tuple of three,
    raises the allocator's error): the backward warns, names the setting, recomputes dQ and
    still matches the reference."""
    kernel_settings(store_ds=True)
    allocate = torch.Tensor.new_empty

    def no_room_for_ds(self, *size, **kwargs):
        if len(size) == 1 and isinstance(size[0], tuple) and len(size[0]) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return allocate(self, *size, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_empty", no_room_for_ds)
    torch.manual_seed(0)
    inputs = make_inputs([0, 17, 40, 1], [5, 0, 37, 16], num_heads=2, head_dim=48, device=DEVICE)
    with pytest.warns(UserWarning, match="experimental.kernels.store_ds_max_mib below"):
        _check_against_reference(inputs, torch.float32, activation="fast_gelu")
    assert "dq" in paths and "dq_from_ds" not in paths


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("counting", [True, False])
def test_batch_order(offsets_dtype, counting):
    """The order programs take examples in: the stable descending argsort of query rows x keys,
    from the counting kernel (many ties, empty examples, more examples than its blocks) and from
    torch.argsort above ``max_counting_batches``."""
    most = 8192 if counting else 100
    gen = torch.Generator().manual_seed(1)
    q_lengths = torch.randint(0, 9, (1100,), generator=gen)
    kv_lengths = torch.randint(0, 9, (1100,), generator=gen)
    q_lengths[3] = 70_000  # a product past int32
    kv_lengths[3] = 40_000
    offsets = [
        torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).to(offsets_dtype) for n in (q_lengths, kv_lengths)
    ]
    order = batch_order(*(o.to(DEVICE) for o in offsets), max_counting_batches=most)
    expected = torch.argsort(q_lengths * kv_lengths, descending=True, stable=True)
    assert order.dtype == torch.int32
    assert order.cpu().tolist() == expected.tolist()
    assert batch_order(offsets[0][:1], offsets[1][:1]).numel() == 0


def test_invalid_arguments_are_rejected():
    inputs = make_inputs([3, 2])
    with pytest.raises(ValueError, match="activation"):
        jagged_attention(*inputs.args(), activation="tanh")
    with pytest.raises(ValueError, match="post_scale"):
        jagged_attention(*inputs.args(), activation="softmax", post_scale=1.0)
    with pytest.raises(ValueError, match="window"):
        jagged_attention(*inputs.args(), window=-1)
    with pytest.raises(ValueError, match="int32 or int64"):
        jagged_attention(*inputs.args()[:3], inputs.q_offsets.float(), *inputs.args()[4:])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_host_arguments_that_break_the_contract_are_rejected_on_the_cpu(backend):
    """Issue #27.7: an understated max_kv_len gave silently wrong output, decreasing offsets were
    accepted and an understated max_q_len raised a misleading assertion. CPU offsets cost no sync,
    so they are checked on every call, with a message naming the argument."""
    if backend == "triton" and HAS_CUDA:
        pytest.skip("Triton runs on CPU tensors only in its interpreter (no CUDA)")
    inputs = make_inputs([3, 5, 0], [4, 7, 2])
    q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len = inputs.args()
    call = lambda *args, **kw: jagged_attention(q, k, v, *args, backend=backend, **kw)  # noqa: E731
    assert call(q_offsets, kv_offsets, max_q_len + 3, max_kv_len + 1).shape == q.shape  # larger bounds are fine
    with pytest.raises(
        ValueError,
        match=r"max_kv_len=6 is less than the longest sequence in kv_offsets \(7 rows, "
        r"example 1\); pass an upper bound",
    ):
        call(q_offsets, kv_offsets, max_q_len, 6)
    with pytest.raises(
        ValueError, match=r"max_q_len=4 is less than the longest sequence in q_offsets \(5 rows, example 1\)"
    ):
        call(q_offsets, kv_offsets, 4, max_kv_len)
    with pytest.raises(ValueError, match=r"kv_offsets must be nondecreasing: kv_offsets\[1\]=9 > kv_offsets\[2\]=4"):
        call(q_offsets, torch.tensor([0, 9, 4, 13]), max_q_len, max_kv_len)
    with pytest.raises(ValueError, match=r"q_offsets\[0\]=1 must be 0"):
        call(q_offsets + 1, kv_offsets, max_q_len, max_kv_len)
    with pytest.raises(ValueError, match=r"kv_offsets\[-1\]=12 must equal the number of rows of k / v \(13\)"):
        call(q_offsets, torch.tensor([0, 4, 11, 12]), max_q_len, max_kv_len)
    with pytest.raises(ValueError, match="max_q_len=-1 must be a non-negative integer"):
        call(q_offsets, kv_offsets, -1, max_kv_len)


def test_offsets_on_the_device_are_checked_only_on_request():
    """The default CUDA path trusts its arguments (reading device offsets is a sync); the debug
    switch (check=True, or the check setting: kernels.check, GEM_KERNELS_CHECK=1) checks them there
    too. A stand-in for device offsets counts the reads here; test_gpu_offsets_are_checked_only_on_request
    runs on CUDA."""

    class DeviceOffsets:  # offsets that live on a GPU: reading them is a device-to-host copy
        device, is_meta, reads = torch.device("cuda", 0), False, 0

        def __init__(self, values):
            self.values = torch.tensor(values)

        def dim(self):
            return 1

        def numel(self):
            return self.values.numel()

        def detach(self):
            self.reads += 1
            return self.values

    bad = DeviceOffsets([0, 3, 8])
    check_offsets("kv_offsets", bad, "k / v", 8, "max_kv_len", 2, on_device=False)
    assert bad.reads == 0
    with pytest.raises(ValueError, match="max_kv_len=2 is less than the longest sequence in kv_offsets"):
        check_offsets("kv_offsets", bad, "k / v", 8, "max_kv_len", 2, on_device=True)
    assert bad.reads == 1
    meta = torch.tensor([0, 3, 2], device="meta")  # no values (FLOP counting, building on meta): never read
    check_offsets("q_offsets", meta, "q", 2, "max_q_len", 3, on_device=True)
    out = _run_python(
        ["-c", "from kernels.jagged_attention import settings; print(settings.current().check)"],
        timeout=300,
        GEM_KERNELS_CHECK="1",
    )
    assert out.stdout.strip() == "True", out.stderr


def test_settings_from_config_and_environment(monkeypatch):
    """The settings: one default each, config values over the defaults, the few debugging
    variables (``GEM_KERNELS_*``: check, autotune, tune_space, gluon) over the config (1 / 0 and
    their spellings; unset or empty: no override), and a clear error naming the key or the
    variable for a bad value, also at the first call of a fresh process."""
    assert set(kernel_config.ENV.values()) == {
        "GEM_KERNELS_CHECK", "GEM_KERNELS_AUTOTUNE", "GEM_KERNELS_TUNE_SPACE", "GEM_KERNELS_GLUON"
    }  # fmt: skip
    for name in kernel_config.ENV.values():
        monkeypatch.delenv(name, raising=False)
    with testing.preserved():
        assert kernel_config.configure() == kernel_config.KernelSettings()
        assert kernel_config.configure(store_ds=False, tune_space="wide").store_ds is False
        assert kernel_config.current().tune_space == "wide"
        for value, expected in [("1", True), ("true", True), (" ON ", True), ("0", False), ("no", False), ("", True)]:
            monkeypatch.setenv("GEM_KERNELS_GLUON", value)
            assert kernel_config.configure().gluon is expected
        monkeypatch.setenv("GEM_KERNELS_GLUON", "2")
        with pytest.raises(ValueError, match="GEM_KERNELS_GLUON='2': expected 1 or 0"):
            kernel_config.configure()
        monkeypatch.delenv("GEM_KERNELS_GLUON")
        monkeypatch.setenv("GEM_KERNELS_TUNE_SPACE", "Wide")
        assert kernel_config.configure().tune_space == "wide"
        monkeypatch.setenv("GEM_KERNELS_TUNE_SPACE", "narrow")
        with pytest.raises(ValueError, match="GEM_KERNELS_TUNE_SPACE='narrow': expected one of default, wide"):
            kernel_config.configure()
        monkeypatch.delenv("GEM_KERNELS_TUNE_SPACE")
        monkeypatch.setenv("GEM_KERNELS_STORE_DS", "0")  # not a debugging switch: said, and no effect
        with pytest.warns(
            UserWarning, match="GEM_KERNELS_STORE_DS is not read .* maps to the config key kernels.store_ds"
        ):
            assert kernel_config.configure().store_ds is True
        monkeypatch.delenv("GEM_KERNELS_STORE_DS")
        with pytest.raises(ValueError, match="kernels.store_ds='yes': expected true or false"):
            kernel_config.configure(store_ds="yes")
        with pytest.raises(ValueError, match="kernels.gluon_min_q_len=-1: expected a whole number >= 0"):
            kernel_config.configure(gluon_min_q_len=-1)
        with pytest.raises(ValueError, match=r"unknown kernel setting\(s\) \['tma'\]"):
            kernel_config.configure(tma=True)
    result = _run_python(
        ["-c", "from kernels.jagged_attention import settings; settings.current()"],
        timeout=300,
        GEM_KERNELS_GLUON="maybe",
    )
    assert result.returncode != 0
    assert "GEM_KERNELS_GLUON='maybe': expected 1 or 0" in result.stderr


@gpu
@requires_cuda
def test_gpu_offsets_are_checked_only_on_request(kernel_settings):
    """On CUDA the default path adds no sync and trusts its arguments; check=True (or
    GEM_KERNELS_CHECK=1) reads the offsets and rejects what breaks the contract."""
    kernel_settings(check=False)
    inputs = make_inputs([3, 5, 0], [4, 7, 2], device="cuda", requires_grad=False)
    q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len = inputs.args()
    decreasing = torch.tensor([0, 9, 4, 13], device="cuda")
    jagged_attention(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, backend="triton")  # compile, warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host copy or synchronize raises
    try:
        jagged_attention(q, k, v, q_offsets, kv_offsets, max_q_len, 6, backend="triton")  # trusted, unchecked
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with pytest.raises(ValueError, match=r"max_kv_len=6 is less than the longest sequence in kv_offsets \(7 rows"):
        jagged_attention(q, k, v, q_offsets, kv_offsets, max_q_len, 6, backend="triton", check=True)
    kernel_settings(check=True)
    with pytest.raises(ValueError, match=r"kv_offsets must be nondecreasing: kv_offsets\[1\]=9 > kv_offsets\[2\]=4"):
        jagged_attention(q, k, v, q_offsets, decreasing, max_q_len, max_kv_len, backend="triton")
    out = jagged_attention(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, backend="triton")
    ref = jagged_attention(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, backend="reference")
    assert _relative_error(out, ref) < 1e-4


# --------------------------------------------------------------------------------------
# GPU tier: real shapes
# --------------------------------------------------------------------------------------


@gpu
@requires_cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])
@pytest.mark.parametrize("activation", ["softmax", "fast_gelu", "silu"])
def test_gpu_real_shapes(activation, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    lengths = torch.randint(0, 1000, (12,), generator=gen)
    lengths[3] = 0
    inputs = make_inputs(
        lengths, num_heads=4, head_dim=head_dim, dtype=torch.bfloat16, device="cuda", max_len_slack=24, generator=gen
    )
    _check_against_reference(inputs, torch.bfloat16, activation=activation)


def _gpu_layout_inputs(layout, seed, empty):
    """bf16, 4 heads of 128: six examples of up to 700 rows (example ``empty`` has none), dense
    K/V of 256 rows, 64 broadcast queries, in ``layout``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 700, (6,), generator=gen)
    lengths[empty] = 0
    return make_inputs(
        lengths,
        torch.randint(0, 700, (6,), generator=gen),
        num_heads=4,
        head_dim=128,
        layout=layout,
        num_dense_kv=256,
        num_queries=64,
        dtype=torch.bfloat16,
        device="cuda",
        generator=gen,
    )


@gpu
@requires_cuda
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ["softmax", "gelu"])
def test_gpu_layouts_and_masks(activation, layout, mask):
    inputs = _gpu_layout_inputs(layout, seed=7, empty=0)
    masks = {
        "window": {"window": 100},
        "block": {"block_size": 64},
        "causal_window": {"causal": True, "window": 77},
        "causal_block": {"causal": True, "block_size": 64},
    }
    _check_against_reference(inputs, torch.bfloat16, activation=activation, **masks.get(mask, MASKS[mask]))


@gpu
@requires_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_dtypes(dtype, head_dim):
    """float32 at head dim 128 needs the backward's smaller tiles (shared memory)."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 600, (8,), generator=gen)
    inputs = make_inputs(
        lengths, num_heads=4, head_dim=head_dim, dtype=dtype, device="cuda", offsets_dtype=torch.int32, generator=gen
    )
    for activation in ("softmax", "identity"):
        _check_against_reference(inputs, dtype, activation=activation, causal=True)


@gpu
@requires_cuda
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", ["softmax", "fast_gelu"])
def test_gpu_autotuned_configs(activation, dtype, causal, kernel_settings):
    """Every autotune candidate config runs during tuning; the chosen one must be right (float32:
    the pruned backward launches only its shared-memory-safe default; GDPA without a mask: the
    forward's candidates include the LATE_PV loop; the Gluon forward is off for that)."""
    kernel_settings(gluon=False, autotune=True)
    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(0, 900, (10,), generator=gen)
    inputs = make_inputs(lengths, num_heads=4, head_dim=128, dtype=dtype, device="cuda", generator=gen)
    _check_against_reference(inputs, dtype, activation=activation, causal=causal)


@gpu
@requires_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ["fast_gelu", "gelu"])
def test_gpu_late_pv_forward_loop(activation, layout, late_pv):
    """The LATE_PV loop at real shapes: bf16x2 (fast_gelu) and float32 (gelu) activations."""
    _check_against_reference(_gpu_layout_inputs(layout, seed=9, empty=4), torch.bfloat16, activation=activation)


@gpu
@requires_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ["fast_gelu", "silu"])
def test_gpu_packed_activation_path(activation, layout, kernel_settings):
    """bf16 silu / fast_gelu take the bf16x2 path on sm_90 (the default); it and the float32 path
    (settings.packed_act off) both match the reference, with and without border masks."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bf16x2 instructions need sm_90")
    inputs = _gpu_layout_inputs(layout, seed=5, empty=2)
    for packed in (True, False):
        config = kernel_settings(gluon=False, packed_act=packed)  # the Triton forward's bf16x2
        assert testing.packed_act(inputs.q, activation, config) == packed
        for mask in ({}, {"causal": True, "window": 77}):
            _check_against_reference(inputs, torch.bfloat16, activation=activation, **mask)


@gpu
@requires_cuda
@pytest.mark.parametrize("layout", ["jagged", "dense_kv"])
@pytest.mark.parametrize("activation", ["fast_gelu", "softmax", "gelu"])
def test_gpu_stored_ds_backward(activation, layout, kernel_settings, paths):
    """The stored-dS backward at real shapes (bf16, head dim 128, up to 700 rows, an empty
    example): dQ from the stored dS matches the reference, and dQ, dK, dV match the recomputing
    backward's to rounding."""
    kernel_settings(store_ds=True)
    calls = _stored_ds(paths)
    inputs = _gpu_layout_inputs(layout, seed=13, empty=1)
    _check_against_reference(inputs, torch.bfloat16, activation=activation)
    assert len(calls()) == 1
    out = jagged_attention(*inputs.args(), activation=activation, backend="triton")
    grad_out = torch.randn_like(out)
    stored = torch.autograd.grad(out, inputs.tensors(), grad_out)
    kernel_settings(store_ds=False)
    out = jagged_attention(*inputs.args(), activation=activation, backend="triton")
    recomputed = torch.autograd.grad(out, inputs.tensors(), grad_out)
    assert len(calls()) == 2
    for name, a, b in zip(("dq", "dk", "dv"), stored, recomputed):
        assert _relative_error(a, b) < 1e-2, name


# --------------------------------------------------------------------------------------
# The Gluon forward (sm_90; on by default, settings.gluon)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_gluon_work_list(offsets_dtype):
    """The Gluon forward's work tiles, built on the device (the interpreter here), are those of
    a Python loop: examples in batch_order, then query blocks of 128, then heads; an empty
    example has none; more examples than one chunk of the builder."""
    from kernels.jagged_attention import gluon_common

    gen = torch.Generator().manual_seed(0)
    q_lengths = torch.randint(0, 300, (1500,), generator=gen)
    q_lengths[::5] = 0
    kv_lengths = torch.randint(0, 300, (1500,), generator=gen)
    q_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), q_lengths.cumsum(0)]).to(offsets_dtype)
    kv_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), kv_lengths.cumsum(0)]).to(offsets_dtype)
    order = torch.randperm(1500, generator=gen).to(torch.int32)
    num_heads, max_q_len = 3, 310  # max_q_len may exceed the longest example
    work, total = gluon_common.work_list(
        q_offsets.to(DEVICE), kv_offsets.to(DEVICE), order.to(DEVICE), num_heads, max_q_len
    )
    expected = [
        [int(q_offsets[b]) + m, int(q_lengths[b]) - m, h, int(kv_offsets[b]), int(kv_lengths[b])]
        for b in order.tolist()
        for m in range(0, int(q_lengths[b]), 128)
        for h in range(num_heads)
    ]
    assert work.shape[0] == 1500 * num_heads * 3
    assert int(total) == len(expected)
    assert work[: len(expected), :5].tolist() == expected


def test_gluon_forward_rejects_an_out_it_cannot_address():
    """The Gluon forward's TMA stores address ``out`` as ``[rows, H * D]``: an ``out`` whose heads
    are not adjacent, or of another shape, is refused before anything launches."""
    from kernels.jagged_attention import gluon_fwd

    inputs = make_inputs([70, 0, 5], num_heads=2, head_dim=64, dtype=torch.bfloat16)
    q, k, v = inputs.tensors()
    order = torch.arange(3, dtype=torch.int32)
    heads_apart = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=q.dtype).transpose(1, 2)
    for out in (heads_apart, q.new_empty(q.shape[0] + 1, *q.shape[1:])):
        with pytest.raises(ValueError, match="adjacent heads"):
            gluon_fwd.forward(
                q, k, v, out, inputs.q_offsets, inputs.kv_offsets, order, inputs.max_q_len, 3, 0.1, 0.1, True, num_sms=1
            )


def _gluon_calls(kernel_settings, paths, path: str, **values):
    """Set ``values`` in the settings and count the launches that took ``path`` (a function
    returning the list of them)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need sm_90")
    kernel_settings(**values)
    return lambda: [p for p in paths if p == path]


def _gluon_forward_calls(kernel_settings, paths):
    """Enable the Gluon forward at every length and count its launches."""
    return _gluon_calls(kernel_settings, paths, "gluon_fwd", gluon=True, gluon_min_q_len=0)


@gpu
@requires_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ["silu", "gelu", "fast_gelu", "relu", "identity"])
def test_gpu_gluon_forward(activation, layout, kernel_settings, paths):
    """settings.gluon: the Gluon forward (jagged and dense K/V; broadcast queries stay on the
    Triton kernel) and the Triton backward after it match the reference; without a mask only,
    a causal call stays on Triton, and so does a call with max_q_len up to gluon_min_q_len."""
    calls = _gluon_forward_calls(kernel_settings, paths)
    inputs = _gpu_layout_inputs(layout, seed=11, empty=3)
    _check_against_reference(inputs, torch.bfloat16, activation=activation)
    assert len(calls()) == (0 if layout == "broadcast_q" else 1)
    _check_against_reference(inputs, torch.bfloat16, activation=activation, causal=True)
    if layout == "broadcast_q":  # no max_q_len: its queries stay on Triton at any gluon_min_q_len
        return
    kernel_settings(gluon_min_q_len=inputs.max_q_len)
    _check_against_reference(inputs, torch.bfloat16, activation=activation)
    assert len(calls()) == 1


@gpu
@requires_cuda
@pytest.mark.parametrize(
    "dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 64), (torch.float16, 128), (torch.bfloat16, 64)]
)
def test_gpu_gluon_forward_many_tiles(dtype, head_dim, kernel_settings, paths):
    """Many work tiles per program (300 examples, about 3,000 tiles, every 7th example empty, K/V
    lengths cut short of a whole tile): each program's loop over tiles, its Q double buffer and
    K/V ring phases, and the masking of a tile that runs into the next example. Output within
    rounding of the Triton forward's."""
    calls = _gluon_forward_calls(kernel_settings, paths)
    gen = torch.Generator().manual_seed(head_dim)
    lengths = torch.randint(1, 700, (300,), generator=gen)
    lengths[::7] = 0
    inputs = make_inputs(
        lengths,
        torch.randint(0, 700, (300,), generator=gen),
        num_heads=4,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
        max_len_slack=40,
        generator=gen,
    )
    _check_against_reference(inputs, dtype, activation="fast_gelu")
    assert len(calls()) == 1
    with torch.no_grad():
        out = jagged_attention(*inputs.args(), activation="gelu", backend="triton")
        kernel_settings(gluon=False)
        expected = jagged_attention(*inputs.args(), activation="gelu", backend="triton")
    assert len(calls()) == 2
    assert _relative_error(out, expected) < 1e-2


@gpu
@requires_cuda
def test_gpu_gluon_forward_strided_inputs(kernel_settings, paths):
    """q, k, v as views of one [T, 3, H, D] projection: the descriptors take the row stride
    3 * H * D; a base that is not 16-byte aligned falls back to the Triton forward."""
    from kernels.jagged_attention import gluon_common

    calls = _gluon_forward_calls(kernel_settings, paths)
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 400, (9,), generator=gen)
    lengths[2] = 0
    inputs = make_inputs(lengths, num_heads=4, head_dim=128, dtype=torch.bfloat16, device="cuda", generator=gen)
    qkv = torch.randn(int(lengths.sum()), 3, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inputs.q, inputs.k, inputs.v = qkv.unbind(1)
    _check_against_reference(inputs, torch.bfloat16, activation="silu")
    assert len(calls()) == 1
    shifted = torch.empty(qkv.numel() + 8, device="cuda", dtype=torch.bfloat16)[1 : qkv.numel() + 1]
    assert not gluon_common.applies(shifted.view_as(qkv)[:, 0], inputs.k, inputs.v, "silu", False, -1, 0, False)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_gpu_gluon_softmax_forward(dtype, head_dim, kernel_settings, paths):
    """The Gluon softmax forward (on no Triton release yet: the kernel tests run it regardless, see
    conftest.py), many tiles a program (300 examples, every 7th empty, lengths cut short of a tile):
    output and every gradient (the Triton backward reads its LSE) against the reference; output
    and LSE within rounding of the Triton forward's, +inf where a query has no keys; a causal call
    stays on Triton."""
    calls = _gluon_forward_calls(kernel_settings, paths)
    gen = torch.Generator().manual_seed(head_dim)
    lengths = torch.randint(1, 700, (300,), generator=gen)
    lengths[::7] = 0
    inputs = make_inputs(lengths, num_heads=4, head_dim=head_dim, dtype=dtype, device="cuda", generator=gen)
    _check_against_reference(inputs, dtype, activation="softmax")
    assert len(calls()) == 1
    _check_against_reference(inputs, dtype, activation="softmax", causal=True)
    assert len(calls()) == 1

    kv_lengths = lengths.roll(1)  # queries whose example has no keys: zeros, LSE +inf
    inputs = make_inputs(lengths, kv_lengths, num_heads=4, head_dim=head_dim, dtype=dtype, device="cuda", generator=gen)
    q, k, v = (t.detach() for t in inputs.tensors())
    order = batch_order(inputs.q_offsets, inputs.kv_offsets)
    results = []
    for gluon in (True, False):
        kernel_settings(gluon=gluon)
        call = testing.AttentionCall(
            inputs.max_q_len, inputs.max_kv_len, "softmax", 0.088, settings=kernel_config.current()
        )
        results.append(testing.launch_forward(q, k, v, inputs.q_offsets, inputs.kv_offsets, order, call))
    assert len(calls()) == 2
    (out, lse), (expected, expected_lse) = results
    assert _relative_error(out, expected) < 1e-2
    assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse)) and torch.isinf(lse).any()
    seen = torch.isfinite(expected_lse)
    torch.testing.assert_close(lse[seen], expected_lse[seen], atol=1e-3, rtol=0)
    assert not out[~seen.any(0)].any()


# --------------------------------------------------------------------------------------
# The Gluon dK/dV (sm_90; on by default for GDPA, settings.gluon_bwd)
# --------------------------------------------------------------------------------------


def _gluon_dkdv_calls(kernel_settings, paths):
    """Enable the Gluon dK/dV kernel and count its launches."""
    return _gluon_calls(kernel_settings, paths, "gluon_dkdv", gluon_bwd=True, store_ds=True)


@gpu
@requires_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ["silu", "fast_gelu"])
def test_gpu_gluon_backward(activation, layout, kernel_settings, paths):
    """settings.gluon_bwd: the Gluon dK/dV (and the dS it stores, which the dQ kernel reads)
    matches the reference for bf16 silu and fast_gelu without a mask, jagged and dense K/V;
    broadcast queries, a causal mask and fp16 (no bf16x2 path) stay on the Triton kernel."""
    calls = _gluon_dkdv_calls(kernel_settings, paths)
    inputs = _gpu_layout_inputs(layout, seed=12, empty=3)
    _check_against_reference(inputs, torch.bfloat16, activation=activation)
    assert len(calls()) == (0 if layout == "broadcast_q" else 1)
    _check_against_reference(inputs, torch.bfloat16, activation=activation, causal=True)
    inputs.q, inputs.k, inputs.v = (t.detach().half().requires_grad_() for t in inputs.tensors())
    _check_against_reference(inputs, torch.float16, activation=activation)
    assert len(calls()) == (0 if layout == "broadcast_q" else 1)


@gpu
@requires_cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_gluon_kernels_under_compile(mode, kernel_settings, paths):
    """settings.gluon_compiled: the personalized FFN's call (bf16 fast_gelu, jagged queries against
    256 dense K/V rows) compiled by Inductor, and under CUDA graphs (``reduce-overhead``, three
    calls: warm-up, recording, replay), runs the Gluon forward and dK/dV through the opaque op, with
    the eager call's outputs and gradients within bf16 rounding."""
    forward_calls = _gluon_forward_calls(kernel_settings, paths)
    dkdv_calls = _gluon_dkdv_calls(kernel_settings, paths)
    kernel_settings(gluon_compiled=True)
    inputs = _gpu_layout_inputs("dense_kv", seed=13, empty=2)
    rest = inputs.args()[3:]

    def attention(q, k, v):
        return jagged_attention(q, k, v, *rest, activation="fast_gelu", backend="triton")

    eager = attention(*inputs.tensors())
    grad_out = torch.randn_like(eager)
    expected = torch.autograd.grad(eager, inputs.tensors(), grad_out)
    before = len(forward_calls()), len(dkdv_calls())
    torch._dynamo.reset()
    compiled = torch.compile(attention, mode=mode, fullgraph=True)
    for _ in range(3 if mode == "reduce-overhead" else 1):
        out = compiled(*inputs.tensors())
        grads = torch.autograd.grad(out, inputs.tensors(), grad_out)
    assert len(forward_calls()) > before[0] and len(dkdv_calls()) > before[1]  # CUDA graphs replay unseen
    assert _relative_error(out, eager) < 1e-2
    for name, actual, want in zip(("dq", "dk", "dv"), grads, expected):
        assert _relative_error(actual, want) < 1e-2, name


@gpu
@requires_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gluon_backward_many_tiles(head_dim, kernel_settings, paths):
    """Many key tiles per program (300 examples, every 7th without queries and every 11th without
    keys, K/V lengths apart from the query lengths, so that tiles end inside either half):
    each program's loop over tiles, the two K/V buffers and the Q/dO ring phases, the masked
    stores of a tile that runs into the next example, zero dK/dV for keys that no query sees.
    Gradients within rounding of the Triton dK/dV's and of the reference (fast_gelu against the
    reference, silu against Triton)."""
    calls = _gluon_dkdv_calls(kernel_settings, paths)
    gen = torch.Generator().manual_seed(head_dim)
    q_lengths = torch.randint(1, 700, (300,), generator=gen)
    q_lengths[::7] = 0
    kv_lengths = torch.randint(1, 700, (300,), generator=gen)
    kv_lengths[::11] = 0
    inputs = make_inputs(
        q_lengths,
        kv_lengths,
        num_heads=4,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device="cuda",
        max_len_slack=40,
        generator=gen,
    )
    _check_against_reference(inputs, torch.bfloat16, activation="fast_gelu")
    assert len(calls()) == 1
    out = jagged_attention(*inputs.args(), activation="silu", backend="triton")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs.tensors(), grad_out)
    kernel_settings(gluon_bwd=False)
    out = jagged_attention(*inputs.args(), activation="silu", backend="triton")
    expected = torch.autograd.grad(out, inputs.tensors(), grad_out)
    assert len(calls()) == 2
    for name, actual, want in zip(("dq", "dk", "dv"), grads, expected):
        assert _relative_error(actual, want) < 1e-2, name
    for start, end in zip(inputs.kv_offsets[:-1][::7].tolist(), inputs.kv_offsets[1:][::7].tolist()):
        assert not grads[1][start:end].any() and not grads[2][start:end].any()
