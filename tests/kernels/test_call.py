"""The kernels' choice (kernels/jagged_attention/call.py) as plain functions: one call and its
operands on which every fast path applies, then each condition that turns the Gluon kernels or
the stored dS off, one at a time. No tensors, no GPU: the operands are described, not measured."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.jagged_attention.call import (
    AttentionCall,
    Operands,
    choose_backward,
    choose_forward,
    store_ds_bytes,
    store_ds_row,
)
from kernels.jagged_attention.settings import KernelSettings

# bf16 silu GDPA without a mask, 300 queries over 256 dense K/V rows, on an sm_90 GPU
CALL = AttentionCall(300, 256, "silu", 0.088, 1 / 256, settings=KernelSettings())
OPERANDS = Operands(
    dtype=torch.bfloat16,
    element_size=2,
    cuda=True,
    arch=(9, 0),
    num_heads=4,
    head_dim=128,
    kv_rows=1024,
    num_rows=1200,
    num_batches=4,
    real=True,
    addressable=True,
    grads_addressable=True,
    interpret=False,
    gluon_fwd_verified=True,
    gluon_dkdv_verified=True,
)


def _settings(**values) -> KernelSettings:
    return KernelSettings().replace(**values)


def test_every_fast_path_applies_to_the_base_call():
    assert choose_forward(CALL, OPERANDS) == "gluon"
    plan = choose_backward(CALL, OPERANDS)
    assert (plan.dkdv, plan.store_ds) == ("gluon", True)


# Each turns off the Gluon forward and the Gluon dK/dV (the stored dS stays on).
GLUON_OFF = {
    "no CUDA": dict(operands=dict(cuda=False)),
    "the interpreter": dict(operands=dict(interpret=True)),
    "not sm_90": dict(operands=dict(arch=(10, 0))),
    "fp32": dict(operands=dict(dtype=torch.float32, element_size=4)),
    "head dim 96": dict(operands=dict(head_dim=96)),
    "traced or fake tensors": dict(operands=dict(real=False)),
    "tensors a descriptor cannot address": dict(operands=dict(addressable=False)),
    "softmax": dict(call=dict(activation="softmax", post_scale=1.0)),
}
FORWARD_ONLY_OFF = {
    "settings.gluon off": dict(call=dict(settings=_settings(gluon=False))),
    "max_q_len at gluon_min_q_len": dict(call=dict(max_q_len=128)),
    "an unverified Triton release": dict(operands=dict(gluon_fwd_verified=False)),
    "no rows": dict(operands=dict(num_rows=0)),
}
BACKWARD_ONLY_OFF = {  # the Gluon dK/dV off, the stored dS on
    "settings.gluon_bwd off": dict(call=dict(settings=_settings(gluon_bwd=False))),
    "settings.packed_act off": dict(call=dict(settings=_settings(packed_act=False))),
    "fp16 (no bf16x2 path)": dict(operands=dict(dtype=torch.float16)),
    "gelu (no bf16x2 path)": dict(call=dict(activation="gelu")),
    "rotated Q and K": dict(call=dict(rotary=True)),
    "a packed gradient": dict(call=dict(packing="kv")),
    "an unverified Triton release": dict(operands=dict(gluon_dkdv_verified=False)),
    "dO, dK or dV a descriptor cannot address": dict(operands=dict(grads_addressable=False)),
}
STORE_DS_OFF = {  # and with it the Gluon dK/dV, which stores dS
    "settings.store_ds off": dict(call=dict(settings=_settings(store_ds=False))),
    "causal": dict(call=dict(causal=True)),
    "a window": dict(call=dict(window=8)),
    "blocks": dict(call=dict(block_size=16)),
    "broadcast queries": dict(call=dict(q_broadcast=True)),
    "over store_ds_max_mib": dict(call=dict(settings=_settings(store_ds_max_mib=1))),
    "no K/V rows": dict(operands=dict(kv_rows=0)),
}


def _case(change: dict) -> tuple[AttentionCall, Operands]:
    return (
        dataclasses.replace(CALL, **change.get("call", {})),
        dataclasses.replace(OPERANDS, **change.get("operands", {})),
    )


@pytest.mark.parametrize("condition", sorted(GLUON_OFF))
def test_a_condition_turns_both_gluon_kernels_off(condition):
    call, operands = _case(GLUON_OFF[condition])
    assert choose_forward(call, operands) == "triton"
    assert choose_backward(call, operands).dkdv == "triton"


@pytest.mark.parametrize("condition", sorted(FORWARD_ONLY_OFF))
def test_a_condition_turns_the_gluon_forward_off(condition):
    call, operands = _case(FORWARD_ONLY_OFF[condition])
    assert choose_forward(call, operands) == "triton"


@pytest.mark.parametrize("condition", sorted(BACKWARD_ONLY_OFF))
def test_a_condition_turns_the_gluon_dkdv_off(condition):
    call, operands = _case(BACKWARD_ONLY_OFF[condition])
    plan = choose_backward(call, operands)
    assert (plan.dkdv, plan.store_ds) == ("triton", True)


@pytest.mark.parametrize("condition", sorted(STORE_DS_OFF))
def test_a_condition_turns_the_stored_ds_off(condition):
    call, operands = _case(STORE_DS_OFF[condition])
    plan = choose_backward(call, operands)
    assert (plan.dkdv, plan.store_ds) == ("triton", False)


def test_the_stored_ds_buffer_is_heads_by_key_rows_by_padded_queries():
    assert store_ds_row(300) == 384 and store_ds_row(0) == 128
    assert store_ds_bytes(CALL, OPERANDS) == 4 * 1024 * 384 * 2
    assert store_ds_bytes(dataclasses.replace(CALL, causal=True), OPERANDS) == 0


def test_an_op_carries_the_call_in_its_sizes_activation_and_scales():
    """op_args / of_op round trip: the registered ops keep their schemas (list[int], str,
    list[float]), the launchers' settings ride in ``sizes`` as ints."""
    settings = _settings(store_ds=False, gluon_min_q_len=256, tune_space="wide", autotune=False)
    call = AttentionCall(7, 9, "fast_gelu", 0.5, 0.25, True, 3, 0, False, settings=settings)
    sizes, activation, scales = call.op_args()
    assert sizes[:6] == [7, 9, 1, 3, 0, 0] and all(type(x) is int for x in sizes)
    assert (activation, scales) == ("fast_gelu", [0.5, 0.25])
    back = AttentionCall.of_op(sizes, activation, scales)
    assert back == call
    assert AttentionCall.of_op(sizes, activation, scales, packing="kv").packing == "kv"


def test_settings_is_a_required_keyword():
    """No default (torch 2.11's Dynamo cannot wrap a KernelSettings default of a constructor it
    traces), and only by name."""
    with pytest.raises(TypeError):
        AttentionCall(7, 9, "silu", 0.5)  # type: ignore[call-arg]
    field = {f.name: f for f in dataclasses.fields(AttentionCall)}["settings"]
    assert field.kw_only and field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    for f in dataclasses.fields(AttentionCall) + dataclasses.fields(Operands):
        assert not dataclasses.is_dataclass(f.default), f.name


# softmax without a mask, on a Triton release on which the Gluon softmax forward passed the gate
SOFTMAX = dict(call=dict(activation="softmax", post_scale=1.0), operands=dict(gluon_softmax_fwd_verified=True))


def test_the_softmax_forward_takes_gluon_only_on_a_release_verified_for_it():
    call, operands = _case(SOFTMAX)
    assert choose_forward(call, operands) == "gluon"
    assert choose_forward(call, dataclasses.replace(operands, gluon_fwd_verified=False)) == "gluon"  # (GDPA's)
    assert choose_backward(call, operands).dkdv == "triton"  # the softmax dK/dV is Triton's
    for change in (dict(gluon_softmax_fwd_verified=False), dict(real=False), dict(head_dim=96), dict(num_rows=0)):
        assert choose_forward(call, dataclasses.replace(operands, **change)) == "triton", change
    for change in (
        dict(causal=True),
        dict(window=8),
        dict(block_size=16),
        dict(q_broadcast=True),
        dict(max_q_len=128),
        dict(settings=_settings(gluon=False)),
    ):
        assert choose_forward(dataclasses.replace(call, **change), operands) == "triton", change
