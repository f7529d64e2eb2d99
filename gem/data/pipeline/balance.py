"""Token balancing: batches of equal example count are not equal work when histories are jagged.

The work of a batch grows with its total tokens (the sum of history lengths); a synchronous
step waits for the rank with the most. The reader balances inside a window of
``num_batches * batch_size`` rows: sort the rows by length, longest first, and deal them out
in laps of ``num_batches`` rows, one to each batch, the longest of a lap to the batch with the
fewest tokens so far (greedy per lap, so batch sizes stay equal). Each batch then holds about
the window's mean tokens, and since every rank's window is a large random sample of the same
data, ranks agree step by step too, without any communication.

Example, 6 rows dealt to 2 batches::

    # lengths sorted    [90, 70, 40, 30, 20, 5]
    # lap 1             b0 <- 90, b1 <- 70            totals 90 / 70
    # lap 2             b1 <- 40, b0 <- 30            totals 120 / 110
    # lap 3             b1 <- 20, b0 <- 5             totals 125 / 130
    # (in file order, first three / last three: 200 / 55)
"""

from __future__ import annotations

import numpy as np


def deal_by_length(lengths: np.ndarray, num_batches: int, order: np.ndarray | None = None) -> list[np.ndarray]:
    """Split rows ``0..len(lengths)-1`` into ``num_batches`` batches of near-equal total length.

    Args:
        lengths: ``[N]`` tokens of each row.
        num_batches: batches to fill; their sizes differ by at most one row.
        order: optional ``[N]`` permutation applied first, so that rows of equal length are
            dealt in a random (seeded) order rather than by position.

    Returns:
        ``num_batches`` arrays of row indices.
    """
    lengths = np.asarray(lengths)
    order = np.arange(len(lengths)) if order is None else np.asarray(order)
    by_length = order[np.argsort(-lengths[order], kind="stable")]
    batch_of = np.empty(len(lengths), dtype=np.int64)
    totals = np.zeros(num_batches, dtype=np.int64)
    for start in range(0, len(by_length), num_batches):
        rows = by_length[start : start + num_batches]
        lightest = np.argsort(totals, kind="stable")[: len(rows)]
        batch_of[rows] = lightest
        totals[lightest] += lengths[rows]
    order_of = np.argsort(batch_of, kind="stable")
    return np.split(order_of, np.cumsum(np.bincount(batch_of, minlength=num_batches))[:-1])


def imbalance(tokens: np.ndarray) -> dict[str, float]:
    """Imbalance of ``tokens [steps, ranks]``: per step max / mean over ranks, averaged and worst over steps."""
    tokens = np.asarray(tokens, dtype=np.float64)
    ratio = tokens.max(axis=1) / np.maximum(tokens.mean(axis=1), 1e-12)
    return {
        "max_over_mean_mean": float(ratio.mean()),
        "max_over_mean_worst": float(ratio.max()),
        "steps": int(tokens.shape[0]),
        "ranks": int(tokens.shape[1]),
    }
