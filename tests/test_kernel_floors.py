"""benchmarks/kernel_floors.py: the flagship's attention calls read off the model, and each call's
FLOPs and bytes per kernel (issue #71's breakdown against the kernels' floors)."""

from __future__ import annotations

import collections

import torch

from benchmarks.kernel_floors import attention_calls, kernel_costs
from gem.models.sequence import attention_flops, self_attention_pairs


def test_the_flagship_calls_are_read_off_each_block():
    lengths = torch.tensor([3, 200, 512, 1])
    kinds = {
        block: collections.Counter(c["kind"] for c in attention_calls(block, lengths))
        for block in ("interformer", "kunlun")
    }
    assert kinds["interformer"] == {"self": 4, "pffn": 4, "pool_rows": 5}
    assert kinds["kunlun"] == {"self": 4, "pffn": 2, "pool_softmax": 3}
    self_call = next(c for c in attention_calls("interformer", lengths) if c["kind"] == "self")
    assert self_call["pairs"] == self_attention_pairs(lengths) and self_call["store_ds"]
    assert self_call["rows"] == 716


def test_a_softmax_call_executes_three_and_a_half_forwards_and_moves_its_tensors_once():
    call = dict(kind="self", heads=4, head_dim=128, rows=1000, pairs=50_000, store_ds=True)
    costs = kernel_costs(call)
    forward = attention_flops(4, 128, 50_000)
    assert sum(flops for flops, _ in costs.values()) == 3.5 * forward
    rows = 1000 * 512 * 2
    assert costs["_fwd_kernel"] == (forward, 4 * rows + 1000 * 4 * 4)  # Q, K, V read, O written, LSE
    assert costs["_bwd_dq_from_ds_kernel"][1] == 4 * 50_000 * 2 + 2 * rows  # dS and K read, dQ written
    masked = kernel_costs(call | dict(store_ds=False))
    assert "_bwd_dq_from_ds_kernel" not in masked and masked["_bwd_dq_kernel"][0] == 1.5 * forward


def test_the_personalized_ffn_moves_its_generated_keys_and_values():
    call = dict(kind="pffn", heads=4, head_dim=128, rows=1000, pairs=1000 * 256, kv_rows=10 * 256)
    costs = kernel_costs(call)
    kv = 10 * 256 * 512 * 2
    assert costs["generation (Inductor)"] == (0, 2 * kv)
    assert costs["_gdpa_fwd_kernel"] == (attention_flops(4, 128, 256_000), 2 * 1000 * 512 * 2 + 2 * kv)
