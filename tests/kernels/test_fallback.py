"""A fast path that cannot build here falls back (Gluon -> Triton -> the reference) instead of
crashing: the same result, one warning naming the kernel, the error and the setting, a record of
it, and no second attempt. Build failures are injected: on the CPU the Triton kernels run in the
interpreter and the Gluon kernels not at all; the GPU tests fail the real kernels' builds."""

from __future__ import annotations

import functools

import pytest
import torch
import triton
from torch._subclasses.fake_tensor import is_fake

from kernels import fallback, jagged_attention
from kernels.jagged_attention import call, gluon_bwd, gluon_fwd, launch, probes, testing, triton_common
from kernels.jagged_attention.inputs import make_inputs

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
BUILD_ERROR = "PassManager::run failed"
# A variant's settings that its build check shares (settings.build_flags): autotune, tune_space, packed_act, store_ds
FLAGS = (False, "default", True, True)


def _fail(*args, **kwargs):
    raise RuntimeError(f"{BUILD_ERROR}\n(the rest of the compiler's message)")


def _attention(inputs):
    """``attention(q, k, v)``: fast_gelu GDPA of ``inputs``' layout on the Triton backend."""
    rest = inputs.args()[3:]
    return lambda q, k, v: jagged_attention(q, k, v, *rest, activation="fast_gelu", backend="triton")


def _gdpa(inputs, attention=None):
    """Output and gradients of ``attention`` (default :func:`_attention`; e.g. a compiled one)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs.tensors())
    out = (attention or _attention(inputs))(q, k, v)
    out.float().square().sum().backward()
    return out.detach().clone(), q.grad, k.grad, v.grad


@pytest.fixture
def events():
    """The fallbacks a test provokes, forgotten after it (the kernel tests fail on any left)."""
    fallback.clear()
    yield fallback.events
    fallback.clear()


@pytest.fixture
def gluon_everywhere(monkeypatch):
    """The Gluon kernels 'apply' to every unmasked GDPA call its settings send them, also on the
    CPU (where they fail): the choice as ``call.py``'s, but for the tensors."""

    def choose_forward(attention, operands):
        settings = attention.settings
        gluon = settings.gluon and attention.max_q_len > settings.gluon_min_q_len and not operands.empty
        return (
            "gluon" if gluon and triton_common.unmasked_pointwise(attention.activation, *attention.mask) else "triton"
        )

    def choose_backward(attention, operands):
        plan = call.choose_backward(attention, operands)
        gluon = attention.settings.gluon_bwd and plan.store_ds and not attention.packing
        return call.Backward("gluon" if gluon else "triton", plan.store_ds)

    monkeypatch.setattr(launch, "choose_forward", choose_forward)
    monkeypatch.setattr(launch, "choose_backward", choose_backward)


def test_gluon_forward_that_fails_to_build_falls_back_to_triton_once(events, gluon_everywhere, monkeypatch):
    inputs = make_inputs([9, 0, 4], [5, 3, 8], dtype=torch.float32, device=DEVICE)
    with testing.override(gluon=False, gluon_bwd=False):
        expected = _gdpa(inputs)
    calls = []
    monkeypatch.setattr(gluon_fwd, "forward", lambda *args, **kwargs: calls.append(1) or _fail())
    monkeypatch.setattr(gluon_bwd, "dkdv", _fail)
    with testing.override(gluon_min_q_len=0), testing.record_paths() as paths:
        with pytest.warns(RuntimeWarning) as warned:
            got = _gdpa(inputs)
        again = _gdpa(inputs)
    for a, b, c in zip(expected, got, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert len(calls) == 1, "a variant that failed is not tried again"
    messages = [str(w.message) for w in warned if "falls back" in str(w.message)]
    assert len(messages) == 2, messages  # the forward, then the backward's dK/dV, once each
    assert "gluon_fwd (fast_gelu float32 D=32)" in messages[0] and BUILD_ERROR in messages[0]
    assert "kernels.gluon=false" in messages[0] and "(the rest" not in messages[0]
    assert "gluon_dkdv" in messages[1] and "kernels.gluon_bwd=false" in messages[1]
    assert [(e.kernel, e.to) for e in events()] == [("gluon_fwd", "triton"), ("gluon_dkdv", "triton")]
    assert paths.count("gluon_fwd") == paths.count("gluon_dkdv") == 1  # tried once each (record_paths: attempts)
    assert paths.count("triton_fwd") == 2 and paths.count("triton_dkdv") == 2


def test_an_error_that_is_not_the_environments_propagates(events, gluon_everywhere, monkeypatch):
    def bug(*args, **kwargs):
        raise ValueError("a bug in the launcher")

    monkeypatch.setattr(gluon_fwd, "forward", bug)
    with testing.override(gluon_min_q_len=0), pytest.raises(ValueError, match="a bug in the launcher"):
        _gdpa(make_inputs([9, 4], dtype=torch.float32, device=DEVICE))
    assert not events()


@pytest.mark.parametrize(
    "error, environment",
    [
        (triton.runtime.errors.OutOfResources(300000, 232448, "shared memory"), True),
        (triton.compiler.errors.CompilationError("src", None, "unsupported"), True),
        (RuntimeError(BUILD_ERROR), True),
        (ImportError("cannot import name 'warp_specialize'"), True),
        (torch.OutOfMemoryError("CUDA out of memory"), False),
        (RuntimeError("Triton Error [CUDA]: out of memory"), False),
        (ValueError("bad input"), False),
        (triton.runtime.errors.InterpreterError("interpreter"), False),
    ],
)
def test_what_counts_as_the_environments_failure(error, environment):
    assert fallback.environment_error(error) == environment


def test_gluon_runs_only_on_a_verified_triton_release(monkeypatch, caplog):
    release = ".".join(triton.__version__.split(".")[:2])
    monkeypatch.setitem(call.GLUON_VERIFIED, "gluon_fwd", ("0.1",))
    call._release_verified.cache_clear()
    with testing.unverified_gluon():
        assert call.gluon_verified("gluon_fwd")
    monkeypatch.setattr(call, "_allow_unverified", False)
    with caplog.at_level("INFO", logger=call.__name__):
        assert not call.gluon_verified("gluon_fwd") and not call.gluon_verified("gluon_fwd")
    lines = [r.getMessage() for r in caplog.records if "gluon_fwd" in r.getMessage()]
    assert len(lines) == 1 and f"Triton {release}" in lines[0] and "0.1" in lines[0]
    call._release_verified.cache_clear()


def _triton_fails_to_build(monkeypatch):
    """The Triton kernels' check runs (as on a GPU, not in the interpreter) and fails to build."""
    monkeypatch.setattr(triton_common, "INTERPRET", False)
    monkeypatch.setitem(fallback.PROBES, "jagged_attention", _fail)


def test_triton_kernels_that_fail_to_build_fall_back_to_the_reference(events, monkeypatch):
    inputs = make_inputs([6, 2, 0], [4, 5, 3], dtype=torch.float32, device=DEVICE)
    expected = _gdpa_reference(inputs)
    _triton_fails_to_build(monkeypatch)
    with pytest.warns(RuntimeWarning, match=f"jagged_attention .*falls back to reference: RuntimeError: {BUILD_ERROR}"):
        got = _gdpa(inputs)
    again = _gdpa(inputs)
    for a, b, c in zip(expected, got, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    [event] = events()
    assert event.to == "reference" and event.setting == "kernels.attention_backend=reference"
    assert event.variant.startswith("fast_gelu float32 32 False False False jagged")


def test_the_build_check_builds_with_the_calls_settings(monkeypatch):
    """The check of a call's Triton kernels launches them with the call's settings that their builds
    depend on (launch configs, activation path, dQ kernel), whatever the process default."""
    from kernels.jagged_attention.settings import KernelSettings

    inputs = make_inputs([6, 2, 0], [4, 5, 3], dtype=torch.float32, device=DEVICE)
    monkeypatch.setattr(triton_common, "INTERPRET", False)
    seen = []
    monkeypatch.setitem(fallback.PROBES, "jagged_attention", lambda *variant: seen.append(variant))
    mine = KernelSettings(autotune=True, tune_space="wide", packed_act=False, store_ds=False)
    with testing.override(autotune=False, store_ds=True):
        jagged_attention(*inputs.args(), activation="fast_gelu", backend="triton", settings=mine)
    assert seen == [("fast_gelu", "float32", 32, False, False, False, "jagged", True, "wide", False, False, 0)]


def test_a_build_check_leaves_the_random_streams_as_they_were(monkeypatch):
    """The check's random inputs draw from no stream of the run's: a run's data order and sampled
    negatives do not depend on whether a check ran before them in its process."""
    monkeypatch.setattr(triton_common, "INTERPRET", False)  # the check runs, as on a GPU
    inputs = make_inputs([6, 2, 0], [4, 5, 3], dtype=torch.float32, device=DEVICE)
    before = torch.get_rng_state()
    jagged_attention(*inputs.args(), activation="fast_gelu", backend="triton")
    assert fallback.events() == [] and len(fallback._probed) == 1, "the check ran and passed"
    assert torch.equal(torch.get_rng_state(), before)


def test_a_build_checks_launches_are_not_the_calls(monkeypatch):
    """testing.record_paths records the call's own launches, not those of its build check."""
    monkeypatch.setattr(triton_common, "INTERPRET", False)  # the check runs, as on a GPU
    inputs = make_inputs([6, 2, 0], [4, 5, 3], dtype=torch.float32, device=DEVICE)
    with testing.record_paths() as paths:
        jagged_attention(*inputs.args(), activation="fast_gelu", backend="triton")
    assert paths == ["triton_fwd"]


def test_triton_fallback_under_torch_compile_keeps_one_graph(events, monkeypatch):
    """Dynamo takes the check's answer as a constant: the reference is traced into the graph."""
    inputs = make_inputs([6, 2, 0], [4, 5, 3], dtype=torch.float32, device=DEVICE)
    _triton_fails_to_build(monkeypatch)
    q, k, v = inputs.tensors()

    def gdpa(q, k, v):
        return jagged_attention(q, k, v, *inputs.args()[3:], activation="fast_gelu", backend="triton")

    with pytest.warns(RuntimeWarning, match="falls back to reference"):
        got = torch.compile(gdpa, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, _gdpa_reference(inputs)[0])
    assert [e.kernel for e in events()] == ["jagged_attention"]


def test_triton_fallback_under_torch_compile_with_dynamic_sizes(events, monkeypatch):
    """Sizes traced as symbols (here the head dim) are specialized for the check, not a graph break."""
    inputs = make_inputs([6, 2, 0], [4, 5, 3], dtype=torch.float32, device=DEVICE)
    _triton_fails_to_build(monkeypatch)
    q, k, v = inputs.tensors()
    for t in (q, k, v):
        torch._dynamo.mark_dynamic(t, 2)

    def gdpa(q, k, v):
        return jagged_attention(q, k, v, *inputs.args()[3:], activation="fast_gelu", backend="triton")

    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="falls back to reference"):
        got = torch.compile(gdpa, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, _gdpa_reference(inputs)[0])


def test_a_build_check_runs_the_triton_kernels(gluon_everywhere, events, monkeypatch):
    """The check's tiny calls run with the Gluon kernels off (their own settings) where the
    settings in force send the same call to them."""
    inputs = make_inputs([9, 4], dtype=torch.float32, device=DEVICE)
    monkeypatch.setattr(gluon_fwd, "forward", _fail)
    monkeypatch.setattr(gluon_bwd, "dkdv", _fail)
    with testing.override(gluon=True, gluon_bwd=True, gluon_min_q_len=0), testing.record_paths() as paths:
        probes.jagged_attention("fast_gelu", "float32", 32, False, False, False, "jagged", *FLAGS, 0)
        assert paths == ["triton_fwd", "triton_dkdv", "dq_from_ds"] and not events()
        with pytest.warns(RuntimeWarning, match="falls back to triton"):  # (their build fails)
            _gdpa(inputs)
    assert paths[3:5] == ["gluon_fwd", "triton_fwd"]


def test_the_gluon_check_runs_once_a_variant_on_real_tensors_while_dynamo_traces(events, monkeypatch):
    """Dynamo calls the check as it traces; its probe runs eagerly, once a variant, and the graph
    gets no break (the GPU test below has it fail a real Gluon build under CUDA graphs)."""
    seen = []
    monkeypatch.setitem(fallback.PROBES, "gluon_gdpa", lambda *variant: seen.append((variant, is_fake(torch.ones(1)))))

    def step(x):
        for head_dim in (128, 128, 64):
            fallback.gluon_checked("gluon_gdpa", ("fast_gelu", "bfloat16", head_dim, 0))
        return x + 1

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="aot_eager")(torch.zeros(3))
    assert seen == [(("fast_gelu", "bfloat16", 128, 0), False), (("fast_gelu", "bfloat16", 64, 0), False)]


@pytest.mark.parametrize(
    "kernel, variant",
    [
        ("jagged_attention", ("fast_gelu", "float32", 32, False, False, False, "jagged", *FLAGS, 0)),
        ("jagged_attention", ("silu", "float32", 32, False, False, False, "dense_kv", *FLAGS, 0)),
        ("jagged_attention", ("softmax", "float32", 32, False, False, False, "broadcast_q", *FLAGS, 0)),
        ("jagged_attention", ("softmax", "float32", None, True, True, True, "jagged", *FLAGS, 0)),
        ("rotary_self_attention", ("float32", 32, False, False, *FLAGS, 0)),
        ("rotary_self_attention", ("float32", None, True, True, *FLAGS, 0)),
        ("packed_kv_attention", ("float32", 32, *FLAGS, 0)),
        ("rotary_qkv", ("float32", 32, 0)),
        ("attention_pooling", ("float32", 64, 16, 0)),
        ("generated_weights", ("float32", "float32", "float32", 0)),
    ],
)
def test_every_build_check_launches_its_kernels(kernel, variant):
    """Each op's check (kernels.fallback.PROBES) runs its launchers through, here in Triton's
    interpreter (on a GPU: compiled and launched), unrecorded and with the Gluon kernels off."""
    import kernels.attention_pooling  # noqa: F401  (registers their checks)
    import kernels.generated_weights  # noqa: F401

    with testing.override(gluon=True, gluon_bwd=True), testing.record_paths() as paths:
        fallback.PROBES[kernel](*variant)
    assert not [path for path in paths if path.startswith("gluon")]


def _gdpa_reference(inputs):
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs.tensors())
    out = jagged_attention(q, k, v, *inputs.args()[3:], activation="fast_gelu", backend="reference")
    out.float().square().sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


# ---------------------------------------------------------------------------------------------
# GPU: the real kernels' builds fail
# ---------------------------------------------------------------------------------------------


def _compiled(mode: str, attention):
    """``attention`` as is (``eager``), under torch.compile (``default``) or with CUDA graphs
    (``reduce-overhead``, called three times by the tests: warm-up, recording, replay)."""
    if mode == "eager":
        return attention
    torch._dynamo.reset()
    return torch.compile(attention, mode=mode, fullgraph=True)


def _gpu_gdpa_inputs():
    """Long enough for the Gluon kernels (queries past 128 rows), bf16 at head dim 128."""
    gen = torch.Generator().manual_seed(5)
    return make_inputs([300, 0, 200], [250, 3, 400], num_heads=2, head_dim=128, dtype=torch.bfloat16,
                       device="cuda", generator=gen)  # fmt: skip


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["eager", "default", "reduce-overhead"])
def test_gpu_gluon_kernels_that_fail_to_build_fall_back_to_triton(mode, events, monkeypatch):
    """The Gluon kernels built with 16 pipeline stages need more shared memory than the GPU has
    (OutOfResources at launch); the calls run the Triton kernels instead (under compile through the
    opaque op, which launches them eagerly before the CUDA graph's capture) with the Triton path's
    results, bit for bit."""
    inputs = _gpu_gdpa_inputs()
    with testing.override(gluon=False, gluon_bwd=False):
        expected = _gdpa(inputs)
    monkeypatch.setattr(gluon_fwd, "STAGES", 16)
    monkeypatch.setattr(gluon_bwd, "dkdv", functools.partial(gluon_bwd.dkdv, stages=16))
    attention = _compiled(mode, _attention(inputs))
    with testing.override(gluon_compiled=True), pytest.warns(RuntimeWarning, match="gluon_fwd .*falls back to triton"):
        for _ in range(3 if mode == "reduce-overhead" else 1):
            got = _gdpa(inputs, attention)
    for name, a, b in zip(("out", "dq", "dk", "dv"), expected, got):
        assert torch.equal(a, b), name
    assert [(e.kernel, e.to) for e in events()] == [("gluon_fwd", "triton"), ("gluon_dkdv", "triton")]


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["eager", "default", "reduce-overhead"])
def test_gpu_triton_kernels_that_fail_to_build_fall_back_to_the_reference(mode, events):
    """A forward launch config that needs more shared memory than the GPU has (OutOfResources):
    the variant's check fails before its first call and the calls run the reference, compiled
    into the graph (and its CUDA graph) under torch.compile."""
    inputs = _gpu_gdpa_inputs()
    expected = _gdpa_reference(inputs)
    attention = _compiled(mode, _attention(inputs))
    with testing.forced_config("fwd", BLOCK_M=256, BLOCK_N=256, num_stages=4):
        with pytest.warns(RuntimeWarning, match="jagged_attention .*falls back to reference: OutOfResources"):
            for _ in range(3 if mode == "reduce-overhead" else 1):
                got = _gdpa(inputs, attention)
    for name, a, b in zip(("out", "dq", "dk", "dv"), expected, got):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2, msg=name)
    assert [(e.kernel, e.to) for e in events()] == [("jagged_attention", "reference")]
