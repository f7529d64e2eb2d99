import pytest
import torch

from gem.data.jagged import (check_offsets, jagged_last, jagged_mean, jagged_to_padded, lengths_to_offsets,
                             offsets_to_lengths, padded_to_jagged, segment_ids)

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
        seq = values[offsets[i]: offsets[i + 1]]
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
