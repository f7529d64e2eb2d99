"""Token balancing: batches of equal example count are not equal work when histories are jagged.

The work of a batch grows with its total tokens (the sum of history lengths); a synchronous
step waits for the rank with the most. The reader balances inside a window of
``num_batches * batch_size`` rows: sort the rows by length (longest first), then deal them
to the batches in snake order (0, 1, .., n-1, n-1, .., 1, 0, 0, 1, ..), so every batch gets one
row of each length tier. Each batch then holds about the window's mean tokens, and since every
rank's window is a large random sample of the same data, ranks agree step by step too,
without any communication.

Example, 6 rows dealt to 2 batches::

    # lengths sorted    [90, 70, 40, 30, 20, 5]
    # snake             b0  b1  b1  b0  b0  b1
    # tokens            b0 = 90+30+20 = 140, b1 = 70+40+5 = 115  (first three / last three: 200 / 55)
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
    n = len(lengths)
    order = np.arange(n) if order is None else np.asarray(order)
    by_length = order[np.argsort(-np.asarray(lengths)[order], kind="stable")]
    position = np.arange(n)
    lap, seat = np.divmod(position, num_batches)
    batch = np.where(lap % 2 == 0, seat, num_batches - 1 - seat)
    return [by_length[batch == b] for b in range(num_batches)]


def imbalance(tokens: np.ndarray) -> dict[str, float]:
    """Imbalance of ``tokens [steps, ranks]``: per step max / mean over ranks, averaged and worst over steps."""
    tokens = np.asarray(tokens, dtype=np.float64)
    ratio = tokens.max(axis=1) / np.maximum(tokens.mean(axis=1), 1e-12)
    return {"max_over_mean_mean": float(ratio.mean()), "max_over_mean_worst": float(ratio.max()),
            "steps": int(tokens.shape[0]), "ranks": int(tokens.shape[1])}
