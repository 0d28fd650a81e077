"""Seeded permutations of ``[0, N)`` in constant memory: position -> index in O(1).

An epoch's order of ``N`` samples is a bijection ``position -> index`` on ``[0, N)``, drawn
from a key derived from ``(seed, epoch)`` (and a label, so that several independent orders can
come from one seed). Nothing of size ``N`` is ever built: any position is mapped on its own, so
a sampler can start anywhere in an epoch of a billion samples at once, and its memory does not
grow with the dataset.

Two regimes, one interface (:class:`Permutation`):

* ``N > TABLE_LIMIT`` (65,536): a **Feistel network with cycle-walking**
  (:class:`FeistelPermutation`). Write ``N <= a * b`` with ``a = ceil(sqrt(N))`` and
  ``b = ceil(N / a)`` and a position ``x < a * b`` as the pair ``(x // b, x % b)``; each of the
  ``ROUNDS`` rounds maps ``(A, B)`` to ``(B, (A + F_i(B)) mod |A|)``, which is invertible
  whatever ``F_i`` is, so the whole network is a bijection on ``[0, a * b)``. Its round
  function ``F_i`` is the SplitMix64 finaliser of ``B`` XOR a 64-bit round key, scaled to
  ``[0, |A|)`` by its top 32 bits (so ``N`` may be up to ``2**64``). A position whose
  image falls in ``[N, a * b)`` is mapped again until the image is below ``N``
  (cycle-walking): the walk stays on the position's cycle of a permutation of a finite set,
  so it ends, and the induced map on ``[0, N)`` is again a bijection. Since
  ``a * b - N < a``, fewer than one position in ``sqrt(N)`` walks at all. Cost: a few dozen
  integer operations per position (vectorised with numpy for runs of positions), and ``O(1)``
  memory.
* ``N <= TABLE_LIMIT``: the **sort of hashed keys** (:class:`TablePermutation`): index ``i``
  goes to the rank of ``mix(i XOR key)`` among all of them; ``mix`` is a bijection of 64-bit
  words, so the keys are distinct and the order is uniform for practical purposes. It costs a
  table of ``8 * N`` bytes (at most 512 KiB), built on first use. A Feistel network on so
  small a domain would be visibly non-uniform (its halves are a handful of values).

Both are deterministic in ``(N, seed, epoch, label)`` on every platform and Python version (the
round keys are BLAKE2b digests, not Python's salted ``hash``), and the name :data:`ORDER` is
what a checkpoint records so that a change of the construction is refused on resume rather
than silently reinterpreted.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "MAX_SIZE",
    "ORDER",
    "ROUNDS",
    "TABLE_LIMIT",
    "FeistelPermutation",
    "IdentityPermutation",
    "Permutation",
    "TablePermutation",
    "epoch_permutation",
]

ORDER: Final = "feistel-v1"
"""The name of this construction, saved with every cursor that indexes an order of it."""

ROUNDS: Final = 6
"""Feistel rounds: more than the 4 of a strong pseudo-random permutation, for margin."""

TABLE_LIMIT: Final = 1 << 16
"""Up to this size an order is a table (the sort of hashed keys), above it a Feistel network."""

MAX_SIZE: Final = 1 << 62
"""The largest order (its uint64 arithmetic must not overflow)."""

_CHUNK = 8192  # positions mapped per numpy call when iterating
_M64 = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's finaliser
_NC1, _NC2 = np.uint64(_C1), np.uint64(_C2)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)

Positions = npt.NDArray[np.integer]
Indices = npt.NDArray[np.int64]


def _mix(z: int) -> int:
    """SplitMix64's finaliser on one 64-bit word (a bijection with full avalanche)."""
    z ^= z >> 30
    z = (z * _C1) & _M64
    z ^= z >> 27
    z = (z * _C2) & _M64
    return z ^ (z >> 31)


def _mix_array(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """:func:`_mix` on every element, in place (uint64 arithmetic wraps modulo 2**64)."""
    z ^= z >> _S30
    z *= _NC1
    z ^= z >> _S27
    z *= _NC2
    z ^= z >> _S31
    return z


def _below(h: int, m: int) -> int:
    """A 64-bit hash scaled to ``[0, m)`` by its top 32 bits (``m <= 2**32``): a multiply and
    a shift instead of a division, and a bias of at most ``m / 2**32``."""
    return ((h >> 32) * m) >> 32


def _below_array(h: npt.NDArray[np.uint64], m: np.uint64) -> npt.NDArray[np.uint64]:
    """:func:`_below` on every element, in place."""
    h >>= _S32
    h *= m
    h >>= _S32
    return h


def round_keys(count: int, *parts: object) -> tuple[int, ...]:
    """``count`` 64-bit keys derived from ``parts`` (ints and strings), the same everywhere."""
    material = "\x1f".join(["elastic-order", *(str(p) for p in parts)]).encode()
    digest = hashlib.blake2b(material, digest_size=8 * count).digest()
    return tuple(int.from_bytes(digest[8 * i: 8 * i + 8], "little") for i in range(count))


class Permutation(ABC):
    """A bijection ``position -> index`` on ``[0, size)``; a read-only sequence of indices.

    ``perm[p]`` is the index at position ``p``; :meth:`take` maps many positions at once;
    :meth:`position_of` is the inverse; iteration yields the whole order lazily.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a permutation needs at least one element (got size {size}).")
        self.size = size

    def __len__(self) -> int:
        return self.size

    def _check(self, position: int, what: str = "position") -> int:
        position = int(position)
        if not 0 <= position < self.size:
            raise IndexError(f"{what} ({position}) is outside [0, {self.size}).")
        return position

    def __getitem__(self, position: int) -> int:
        return self._index(self._check(position))

    @abstractmethod
    def _index(self, position: int) -> int:
        """The index at ``position`` (in range)."""

    @abstractmethod
    def take(self, positions: Positions) -> Indices:
        """The indices at ``positions`` (an integer array, every value in range), as int64."""

    @abstractmethod
    def position_of(self, index: int) -> int:
        """The position of ``index`` (the inverse permutation)."""

    def __iter__(self) -> Iterator[int]:
        for start in range(0, self.size, _CHUNK):
            stop = min(self.size, start + _CHUNK)
            yield from self.take(np.arange(start, stop, dtype=np.int64)).tolist()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size})"


class IdentityPermutation(Permutation):
    """``position -> position`` (the order without shuffling)."""

    def _index(self, position: int) -> int:
        return position

    def take(self, positions: Positions) -> Indices:
        return np.asarray(positions, dtype=np.int64)

    def position_of(self, index: int) -> int:
        return self._check(index, "index")


class FeistelPermutation(Permutation):
    """The Feistel network with cycle-walking of the module docstring, in ``O(1)`` memory.

    Args:
        size: ``N``, the number of elements.
        keys: One 64-bit round key per round (see :func:`round_keys`); their number is the
            number of rounds, at least 2.
    """

    def __init__(self, size: int, keys: tuple[int, ...]) -> None:
        super().__init__(size)
        if size > MAX_SIZE:
            raise ValueError(f"a Feistel permutation holds at most 2**62 elements (got {size}).")
        if len(keys) < 2:
            raise ValueError(f"a Feistel network needs at least 2 rounds (got {len(keys)}).")
        self._a = max(2, math.isqrt(size - 1) + 1)  # ceil(sqrt(size)), at least 2
        self._b = max(2, -(-size // self._a))
        self._keys = tuple(k & _M64 for k in keys)
        self._np_keys = tuple(np.uint64(k) for k in self._keys)

    @property
    def domain(self) -> int:
        """``a * b``: the size of the network's own domain (at least ``size``)."""
        return self._a * self._b

    # One round maps (A mod m_a, B mod m_b) to (B, (A + F(B)) mod m_a), and the moduli swap.

    def _encrypt(self, x: int) -> int:
        ma, mb = self._a, self._b
        a, b = divmod(x, mb)
        for key in self._keys:
            t = a + _below(_mix(b ^ key), ma)
            a, b = b, t - ma if t >= ma else t
            ma, mb = mb, ma
        return a * mb + b

    def _decrypt(self, y: int) -> int:
        # After an even number of rounds the moduli are (a, b) again; after an odd one,
        # swapped. Undo the rounds last to first.
        rounds = len(self._keys)
        ma, mb = (self._a, self._b) if rounds % 2 == 0 else (self._b, self._a)
        a, b = divmod(y, mb)
        for key in reversed(self._keys):
            ma, mb = mb, ma  # the moduli this round started with
            t = b - _below(_mix(a ^ key), ma)
            a, b = t + ma if t < 0 else t, a
        return a * mb + b

    def _encrypt_array(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        ma, mb = np.uint64(self._a), np.uint64(self._b)
        a = x // mb
        b = x - a * mb
        for key in self._np_keys:
            t = a + _below_array(_mix_array(b ^ key), ma)
            a, b = b, np.where(t >= ma, t - ma, t)
            ma, mb = mb, ma
        result: npt.NDArray[np.uint64] = a * mb + b
        return result

    def _index(self, position: int) -> int:
        y = self._encrypt(position)
        while y >= self.size:  # cycle-walking
            y = self._encrypt(y)
        return y

    def position_of(self, index: int) -> int:
        x = self._decrypt(self._check(index, "index"))
        while x >= self.size:
            x = self._decrypt(x)
        return x

    def take(self, positions: Positions) -> Indices:
        out = self._encrypt_array(np.asarray(positions).astype(np.uint64))
        size = np.uint64(self.size)
        walking = np.flatnonzero(out >= size)
        while walking.size:
            out[walking] = self._encrypt_array(out[walking])
            walking = walking[out[walking] >= size]
        return out.astype(np.int64)

    def __repr__(self) -> str:
        return f"FeistelPermutation(size={self.size}, domain={self._a}x{self._b})"


class TablePermutation(Permutation):
    """The sort of hashed keys of the module docstring: a table of ``size`` int64, built lazily.

    Args:
        size: ``N``, the number of elements.
        key: The 64-bit key.
    """

    def __init__(self, size: int, key: int) -> None:
        super().__init__(size)
        self._key = np.uint64(key & _M64)
        self._table: Indices | None = None
        self._inverse: Indices | None = None

    def _order(self) -> Indices:
        if self._table is None:
            hashed = _mix_array(np.arange(self.size, dtype=np.uint64) ^ self._key)
            self._table = np.argsort(hashed, kind="stable").astype(np.int64)
        return self._table

    def _index(self, position: int) -> int:
        return int(self._order()[position])

    def take(self, positions: Positions) -> Indices:
        return self._order()[np.asarray(positions, dtype=np.int64)]

    def position_of(self, index: int) -> int:
        index = self._check(index, "index")
        if self._inverse is None:
            inverse = np.empty(self.size, dtype=np.int64)
            inverse[self._order()] = np.arange(self.size, dtype=np.int64)
            self._inverse = inverse
        return int(self._inverse[index])


def epoch_permutation(size: int, seed: int, epoch: int, label: str = "samples") -> Permutation:
    """The order of ``size`` elements for ``(seed, epoch)``: a table up to
    :data:`TABLE_LIMIT`, a Feistel network above (see the module docstring).

    Args:
        size: The number of elements (at least 1).
        seed: The run's seed.
        epoch: The epoch (any integer).
        label: Keeps orders drawn from the same ``(seed, epoch)`` for different purposes
            independent (``"samples"``, ``"shards"``, ``"window 7"``...).

    Raises:
        ValueError: If ``size`` is below 1.
    """
    if size <= TABLE_LIMIT:
        if size < 1:
            raise ValueError(f"a permutation needs at least one element (got size {size}).")
        return TablePermutation(size, round_keys(1, ORDER, seed, epoch, label)[0])
    return FeistelPermutation(size, round_keys(ROUNDS, ORDER, seed, epoch, label))
