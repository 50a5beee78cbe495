"""The grid of Rényi orders every curve in this package is evaluated on.

A curve is only meaningful together with its grid, so the ledger stores the grid it
was created with and refuses to mix curves from different grids. The default is
Google dp_accounting's grid, so our epsilons can equal the oracle's exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _dp_accounting_grid() -> np.ndarray:
    # Built exactly as dp_accounting builds DEFAULT_RDP_ORDERS, float for float.
    grid = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
    orders = np.array(grid, dtype=np.float64)
    orders.setflags(write=False)
    return orders


DEFAULT_ORDERS: np.ndarray = _dp_accounting_grid()


def validate_orders(orders: Sequence[float] | np.ndarray) -> np.ndarray:
    """Return a read-only float64 copy of ``orders`` after checking it is a usable grid.

    Orders must be finite, strictly above 1 (order 1 is KL divergence, where the
    conversions used here are undefined) and distinct.
    """
    try:
        grid = np.array(orders, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"orders must be a sequence of numbers, got {orders!r}") from exc
    if grid.ndim != 1 or grid.size == 0:
        raise ValueError(f"orders must be a non-empty 1-D sequence, got shape {grid.shape}")
    if not np.all(np.isfinite(grid)):
        raise ValueError("orders must be finite")
    if np.any(grid <= 1.0):
        raise ValueError(f"orders must all be > 1, got minimum {grid.min()!r}")
    if np.unique(grid).size != grid.size:
        raise ValueError("orders must be distinct")
    grid.setflags(write=False)
    return grid
