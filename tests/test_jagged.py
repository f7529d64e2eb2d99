import pytest
import torch

from kernels.jagged import (
    check_offsets,
    jagged_first,
    jagged_last,
    jagged_mean,
    jagged_positions,
    jagged_prepend,
    jagged_to_padded,
    lengths_to_offsets,
    offsets_to_lengths,
    padded_to_jagged,
    segment_ids,
)

LENGTHS = [[3, 0, 1, 5], [0], [0, 0], [2], [1, 4, 0, 0, 7]]


@pytest.mark.parametrize("lengths", LENGTHS)
def test_offsets_round_trip(lengths):
    lengths = torch.tensor(lengths)
    offsets = lengths_to_offsets(lengths)
    assert offsets.dtype == torch.int64 and offsets[0] == 0 and offsets[-1] == lengths.sum()
    assert torch.equal(offsets_to_lengths(offsets), lengths)
    check_offsets(offsets, int(lengths.sum()), "x")


@pytest.mark.parametrize("lengths", LENGTHS)
def test_mean_and_padding_match_a_loop(lengths):
    torch.manual_seed(0)
    offsets = lengths_to_offsets(torch.tensor(lengths))
    values = torch.randn(int(offsets[-1]), 3)
    mean = jagged_mean(values, offsets)
    padded = jagged_to_padded(values, offsets, max_len=8)
    for i, n in enumerate(lengths):
        seq = values[offsets[i] : offsets[i + 1]]
        expected = seq.mean(0) if n else torch.zeros(3)
        torch.testing.assert_close(mean[i], expected)
        torch.testing.assert_close(padded[i, :n], seq)
        assert not padded[i, n:].any()
    assert torch.equal(padded_to_jagged(padded, offsets), values)
    assert torch.equal(segment_ids(offsets), torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))


def test_jagged_last_takes_most_recent_right_aligned():
    offsets = torch.tensor([0, 3, 3, 4])
    values = torch.arange(4.0).unsqueeze(1)  # seq0 = [0, 1, 2], seq1 = [], seq2 = [3]
    rows, mask = jagged_last(values, offsets, k=2)
    assert rows.squeeze(-1).tolist() == [[1.0, 2.0], [0.0, 0.0], [0.0, 3.0]]
    assert mask.tolist() == [[True, True], [False, False], [False, True]]
    rows, mask = jagged_last(values[:0], torch.zeros(3, dtype=torch.int64), k=2)
    assert rows.shape == (2, 2, 1) and not mask.any()


def test_check_offsets_names_the_tensor():
    with pytest.raises(ValueError, match="q_offsets.*nondecreasing"):
        check_offsets(torch.tensor([0, 3, 2, 4]), 4, "q_offsets")
    with pytest.raises(ValueError, match="end at T=5"):
        check_offsets(torch.tensor([0, 4]), 5, "kv_offsets")


def test_lengths_to_offsets_keeps_device_and_takes_int32():
    offsets = lengths_to_offsets(torch.tensor([2, 0, 3]), dtype=torch.int32)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 2, 2, 5]


@pytest.mark.parametrize("lengths", LENGTHS)
def test_padding_is_differentiable_both_ways_on_head_layouts(lengths):
    """The attention reference's layout ``[T, H, D]`` with int32 offsets: gradients through
    jagged -> padded -> jagged reach every row once, also with no rows at all."""
    offsets = lengths_to_offsets(torch.tensor(lengths), dtype=torch.int32)
    total = int(offsets[-1])
    values = torch.randn(total, 2, 3, requires_grad=True)
    padded = jagged_to_padded(values, offsets, max_len=8)
    assert padded.shape == (len(lengths), 8, 2, 3)
    back = padded_to_jagged(padded * 2, offsets, total)
    torch.testing.assert_close(back, values * 2)
    back.sum().backward()
    torch.testing.assert_close(values.grad, torch.full_like(values, 2.0))


def test_padding_cuts_long_sequences_and_fills_with_pad():
    offsets = torch.tensor([0, 3, 4])
    values = torch.arange(1.0, 5.0).view(4, 1).requires_grad_()
    padded = jagged_to_padded(values, offsets, max_len=2, pad=-1.0)
    assert padded.squeeze(-1).tolist() == [[1.0, 2.0], [4.0, -1.0]]
    padded.sum().backward()
    assert values.grad.view(-1).tolist() == [1.0, 1.0, 0.0, 1.0]  # the cut row gets no gradient


def test_positions_first_and_prepend():
    offsets = torch.tensor([0, 2, 2, 5])  # lengths 2, 0, 3
    values = torch.arange(5.0).view(5, 1)
    assert jagged_positions(offsets, 5).tolist() == [0, 1, 0, 1, 2]
    out, new_offsets = jagged_prepend(-torch.ones(3, 1, 1), values, offsets)
    assert new_offsets.tolist() == [0, 3, 4, 8]
    assert jagged_first(out, new_offsets, 1).view(-1).tolist() == [-1.0, -1.0, -1.0]
