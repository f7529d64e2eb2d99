"""kernels.jagged_attention.persistent_fwd: the persistent softmax forward over one flat list of key
tiles, against the op's reference (output) and the log-sum-exp of the scores, and its schedule.

CPU tier: Triton's interpreter at small shapes whose lengths and head dim are not multiples of
the blocks, self-attention and different query and key lengths (examples without queries, without
keys), runs fewer and more than the items. GPU tier (``-m gpu``): the flagship's lengths in bf16,
against the op's Triton forward.
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


def _inputs(lengths, num_heads, head_dim, dtype, seed=0, kv_lengths=None, **options):
    """q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len."""
    inputs = make_inputs(
        lengths,
        kv_lengths,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=DEVICE,
        requires_grad=False,
        generator=torch.Generator().manual_seed(seed),
        **options,
    )
    return inputs.args()


def _lse2(q, k, q_offsets, kv_offsets, scale):
    """``[H, Tq]``: log2 of each query's sum of exp(scaled scores) over its example's keys
    (``+inf`` for a query without keys, as the kernels write it)."""
    out = torch.empty(q.shape[1], q.shape[0], dtype=torch.float64)
    q_bounds, kv_bounds = q_offsets.tolist(), kv_offsets.tolist()
    for q0, q1, k0, k1 in zip(q_bounds[:-1], q_bounds[1:], kv_bounds[:-1], kv_bounds[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k[k0:k1].double()) * scale
        out[:, q0:q1] = torch.logsumexp(scores, -1) / math.log(2) if k1 > k0 else math.inf
    return out


def _error(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


CROSS = ([5, 0, 40, 1, 17, 33], [7, 3, 12, 0, 40, 33])  # query lengths, key lengths


@pytest.mark.parametrize("num_runs", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(CROSS[0], None), CROSS], ids=["self", "cross"])
def test_matches_the_reference(lengths, dtype, num_runs):
    q_lengths, kv_lengths = lengths
    q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len = _inputs(q_lengths, 2, 24, dtype, kv_lengths=kv_lengths)
    args = (q_offsets, kv_offsets, max_q_len, max_kv_len)
    out, lse = persistent_softmax_forward(q, k, v, *args, num_runs=num_runs, **SMALL)
    want = jagged_attention_reference(q, k, v, *args, activation="softmax")
    assert out.shape == want.shape and out.dtype == dtype
    assert _error(out, want) < (1e-5 if dtype == torch.float32 else 2e-2)
    want_lse = _lse2(q.cpu(), k.cpu(), q_offsets.cpu(), kv_offsets.cpu(), 24**-0.5)
    assert torch.equal(lse.cpu().isinf(), want_lse.isinf())  # a query without keys: +inf
    finite = want_lse.isfinite()
    assert (lse.double().cpu()[finite] - want_lse[finite]).abs().max() < 1e-4


def test_equals_the_ops_forward_with_a_scale():
    """Also with int32 offsets and a max_len above the longest example (one query tile of none)."""
    q, k, v, *args = _inputs(
        [9, 31, 2], num_heads=3, head_dim=16, dtype=torch.float32, seed=1, offsets_dtype=torch.int32, max_len_slack=20
    )
    want = jagged_attention(q, k, v, *args, activation="softmax", scale=0.3)
    out, _ = persistent_softmax_forward(q, k, v, *args, 0.3, num_runs=2, **SMALL)
    assert _error(out, want) < 1e-5
    shared = persistent_schedule(args[0], args[1], args[2], args[3], 3, 16, 16, 2)
    again, _ = persistent_softmax_forward(q, k, v, *args, 0.3, num_runs=2, schedule=shared, **SMALL)
    assert torch.equal(again, out)


def _offsets(lengths):
    lengths = torch.tensor(lengths)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def test_the_schedule_lists_every_tile_once_in_runs_of_whole_items():
    """An item per (example, block of its item rows, head), with a tile per block of its tile
    rows and at least one (an example without keys still writes its queries' output)."""
    item_lengths, tile_lengths = CROSS
    heads, block_m, block_n, runs = 2, 16, 8, 5
    tile_item, tile_index, run_start = persistent_schedule(
        _offsets(item_lengths), _offsets(tile_lengths), 40, 40, heads, block_m, block_n, runs
    )
    m_blocks = 3
    want = {
        ((b * m_blocks + m) * heads + h, n)
        for b, (length, tiles) in enumerate(zip(item_lengths, tile_lengths))
        for m in range(m_blocks)
        if m * block_m < length
        for h in range(heads)
        for n in range(max(-(-tiles // block_n), 1))
    }
    total = int(run_start[-1])
    listed = list(zip(tile_item[:total].tolist(), tile_index[:total].tolist()))
    assert len(listed) == len(want) and set(listed) == want
    assert run_start[0] == 0 and (run_start[1:] >= run_start[:-1]).all()
    assert all(tile_index[int(s)] == 0 for s in run_start[:-1] if s < total)  # runs start at an item
    tiles = [sum(1 for i, _ in listed if i == item) for item in dict.fromkeys(i for i, _ in listed)]
    assert tiles == sorted(tiles, reverse=True)  # longest items first


def test_bad_inputs_name_the_argument():
    q, k, v, *args = _inputs([3, 4], num_heads=2, head_dim=16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"q must be \[Tq, H, D\] and k, v \[Tk, H, D\] alike"):
        persistent_softmax_forward(q, k[:3], v, *args)
    schedule = persistent_schedule(*args, 2, 16, 16, 3)
    with pytest.raises(ValueError, match="schedule has 3 runs, num_runs is 2"):
        persistent_softmax_forward(q, k, v, *args, num_runs=2, schedule=schedule, **SMALL)
    with pytest.raises(ValueError, match="v's last dimension must be contiguous"):
        persistent_softmax_forward(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), *args)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_flagship_lengths():
    """gem_base's self-attention (4 heads of 128, bf16) at the flagship's lengths, against the op's forward."""
    from benchmarks.attention import flagship_lengths

    q, k, v, *args = _inputs(flagship_lengths()[:256].tolist(), num_heads=4, head_dim=128, dtype=torch.bfloat16)
    want = jagged_attention(q, k, v, *args, activation="softmax")
    out, _ = persistent_softmax_forward(q, k, v, *args)
    assert _error(out, want) < 2e-2
