"""The randomness that drives every noise sampler: the operating system's CSPRNG.

Why not numpy's generators: PCG64 (numpy's default) is a statistical generator, not a
cryptographic one; its state can be recovered from its outputs, and a recovered state
would predict -- and so subtract -- the noise of every later release. Production noise
therefore reads ``os.urandom`` (the same source as ``secrets``) and turns its bytes into
exact uniform integers with integer operations only.

``SeededTestRandom`` exists so that statistical tests are repeatable. Its bytes come from
a seeded PCG64: reproducible, predictable, and therefore NOT private. Only the ``seed=``
arguments of the samplers create it, and those are documented as test-only.

Layering: standard library and numpy only.
"""

from __future__ import annotations

import numbers
import os

import numpy as np
from numpy.typing import NDArray

__all__ = ["SecureRandom", "SeededTestRandom", "random_source"]


class SecureRandom:
    """Uniform bits and integers from ``os.urandom``; a fresh object per release is cheap."""

    def bytes(self, count: int) -> bytes:
        """``count`` bytes from the OS's cryptographically secure generator."""
        return os.urandom(count)

    def words32(self, count: int) -> NDArray[np.uint32]:
        """``count`` independent uniform 32-bit words."""
        return np.frombuffer(self.bytes(4 * count), dtype="<u4").astype(np.uint32)

    def words64(self, count: int) -> NDArray[np.uint64]:
        """``count`` independent uniform 64-bit words."""
        return np.frombuffer(self.bytes(8 * count), dtype="<u8").astype(np.uint64)

    def below(self, bound: int, count: int) -> NDArray[np.int64]:
        """``count`` exact uniform integers in ``[0, bound)``, for ``1 <= bound <= 2**63``.

        Masked rejection: draw ``bit_length(bound - 1)`` bits, keep values below ``bound``
        (at least half are kept), redraw the rest. No modulo, so no bias.
        """
        if bound == 1:
            return np.zeros(count, dtype=np.int64)
        mask = np.uint64((1 << (bound - 1).bit_length()) - 1)
        limit = np.uint64(bound)
        out = np.empty(count, dtype=np.int64)
        todo = np.arange(count)
        while todo.size:
            draw = self.words64(todo.size) & mask
            keep = draw < limit
            out[todo[keep]] = draw[keep].astype(np.int64)
            todo = todo[~keep]
        return out

    def integers(
        self, low: int, high: int, size: int | None = None, dtype: type = np.int64
    ) -> NDArray[np.int64] | int:
        """The subset of ``numpy.random.Generator.integers`` the exact samplers use."""
        if dtype is not np.int64 or high - low > 2**63 or high <= low:
            raise ValueError(f"integers takes int64 ranges of at most 2**63, got [{low}, {high})")
        draws = self.below(int(high - low), 1 if size is None else int(size)) + np.int64(low)
        return int(draws[0]) if size is None else draws


class SeededTestRandom(SecureRandom):
    """Reproducible bytes for tests. Predictable, so the noise it drives is NOT private."""

    def __init__(self, seed: int) -> None:
        self._generator = np.random.default_rng(seed)

    def bytes(self, count: int) -> bytes:
        return self._generator.bytes(count)


def random_source(seed: int | None) -> SecureRandom:
    """The OS's CSPRNG when ``seed`` is None (every production call); a test source otherwise."""
    if seed is None:
        return SecureRandom()
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    return SeededTestRandom(int(seed))
