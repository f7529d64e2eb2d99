"""kernels.jagged_attention.persistent_fwd: the persistent softmax forward over one flat list of key
tiles, against the op's reference (output) and the log-sum-exp of the scores, and its schedule.

CPU tier: Triton's interpreter at small shapes whose lengths and head dim are not multiples of
the blocks, with empty examples, runs fewer and more than the items. GPU tier (``-m gpu``): the
flagship's lengths in bf16, against the op's Triton forward.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.jagged_attention import jagged_attention
from kernels.jagged_attention.inputs import make_inputs
from kernels.jagged_attention.persistent_fwd import persistent_schedule, persistent_softmax_forward
from kernels.jagged_attention.reference import jagged_attention_reference

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
SMALL = dict(block_m=16, block_n=16, num_warps=1, num_stages=1)


def _inputs(lengths, num_heads, head_dim, dtype, seed=0, **options):
    inputs = make_inputs(
        lengths,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=DEVICE,
        requires_grad=False,
        generator=torch.Generator().manual_seed(seed),
        **options,
    )
    return inputs.q, inputs.k, inputs.v, inputs.q_offsets, inputs.max_q_len


def _lse2(q, k, offsets, scale):
    """``[H, T]``: log2 of each query's sum of exp(scaled scores) over its example's keys."""
    out = torch.empty(q.shape[1], q.shape[0], dtype=torch.float64)
    bounds = offsets.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), k[start:end].double()) * scale
        out[:, start:end] = torch.logsumexp(scores, -1) / math.log(2)
    return out


def _error(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("num_runs", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(dtype, num_runs):
    q, k, v, offsets, max_len = _inputs([5, 0, 40, 1, 17, 33], num_heads=2, head_dim=24, dtype=dtype)
    out, lse = persistent_softmax_forward(q, k, v, offsets, max_len, num_runs=num_runs, **SMALL)
    want = jagged_attention_reference(q, k, v, offsets, offsets, max_len, max_len, activation="softmax")
    assert out.shape == want.shape and out.dtype == dtype
    assert _error(out, want) < (1e-5 if dtype == torch.float32 else 2e-2)
    scale = 24**-0.5
    assert (lse.double().cpu() - _lse2(q.cpu(), k.cpu(), offsets.cpu(), scale)).abs().max() < 1e-4


def test_equals_the_ops_forward_with_a_scale():
    """Also with int32 offsets and a max_len above the longest example (one query tile of none)."""
    q, k, v, offsets, max_len = _inputs(
        [9, 31, 2], num_heads=3, head_dim=16, dtype=torch.float32, seed=1, offsets_dtype=torch.int32, max_len_slack=20
    )
    want = jagged_attention(q, k, v, offsets, offsets, max_len, max_len, activation="softmax", scale=0.3)
    out, _ = persistent_softmax_forward(q, k, v, offsets, max_len, 0.3, num_runs=2, **SMALL)
    assert _error(out, want) < 1e-5
    shared = persistent_schedule(offsets, max_len, 3, 16, 16, 2)
    again, _ = persistent_softmax_forward(q, k, v, offsets, max_len, 0.3, num_runs=2, schedule=shared, **SMALL)
    assert torch.equal(again, out)


def test_the_schedule_lists_every_key_tile_once_in_runs_of_whole_items():
    lengths = torch.tensor([5, 0, 40, 1, 17, 33])
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    heads, block_m, block_n, runs = 2, 16, 8, 5
    tile_item, tile_index, run_start = persistent_schedule(offsets, 40, heads, block_m, block_n, runs)
    m_blocks = 3
    want = {
        ((b * m_blocks + m) * heads + h, n)
        for b, length in enumerate(lengths.tolist())
        for m in range(m_blocks)
        if m * block_m < length
        for h in range(heads)
        for n in range(-(-length // block_n))
    }
    total = int(run_start[-1])
    listed = list(zip(tile_item[:total].tolist(), tile_index[:total].tolist()))
    assert len(listed) == len(want) and set(listed) == want
    assert run_start[0] == 0 and (run_start[1:] >= run_start[:-1]).all()
    assert all(tile_index[int(s)] == 0 for s in run_start[:-1] if s < total)  # runs start at an item
    tiles = [sum(1 for i, _ in listed if i == item) for item in dict.fromkeys(i for i, _ in listed)]
    assert tiles == sorted(tiles, reverse=True)  # longest items first


def test_bad_inputs_name_the_argument():
    q, k, v, offsets, max_len = _inputs([3, 4], num_heads=2, head_dim=16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"q, k, v must be \[T, H, D\] alike"):
        persistent_softmax_forward(q, k[:3], v, offsets, max_len)
    schedule = persistent_schedule(offsets, max_len, 2, 16, 16, 3)
    with pytest.raises(ValueError, match="schedule has 3 runs, num_runs is 2"):
        persistent_softmax_forward(q, k, v, offsets, max_len, num_runs=2, schedule=schedule, **SMALL)
    with pytest.raises(ValueError, match="v's last dimension must be contiguous"):
        persistent_softmax_forward(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), offsets, max_len)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_flagship_lengths():
    """gem_base's self-attention (4 heads of 128, bf16) at the flagship's lengths, against the op's forward."""
    from benchmarks.attention import flagship_lengths

    q, k, v, offsets, max_len = _inputs(
        flagship_lengths()[:256].tolist(), num_heads=4, head_dim=128, dtype=torch.bfloat16
    )
    want = jagged_attention(q, k, v, offsets, offsets, max_len, max_len, activation="softmax")
    out, _ = persistent_softmax_forward(q, k, v, offsets, max_len)
    assert _error(out, want) < 2e-2
