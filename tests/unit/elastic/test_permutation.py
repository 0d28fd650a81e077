"""The constant-memory epoch order: a bijection on [0, N) for any N, deterministic, O(1) lookups.

Acceptance 1 of the data-at-scale issue: a permutation for any N up to 2**40 (checked exactly
for sampled small N, in both regimes; for large N by construction: every Feistel round is
invertible, which the round trip through the inverse checks on sampled positions);
deterministic per (seed, epoch); position -> index agrees with iteration.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.permutation import (
    ROUNDS,
    TABLE_LIMIT,
    FeistelPermutation,
    IdentityPermutation,
    TablePermutation,
    epoch_permutation,
    round_keys,
)

seeds = st.integers(-(2**63), 2**63)
epochs = st.integers(0, 10**6)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 3000), seed=seeds, epoch=epochs)
def test_small_orders_are_exact_permutations_and_lookups_agree_with_iteration(
    size: int, seed: int, epoch: int
) -> None:
    order = epoch_permutation(size, seed, epoch)
    listed = list(order)
    assert sorted(listed) == list(range(size))
    assert [order[p] for p in range(size)] == listed
    assert order.take(np.arange(size)).tolist() == listed
    assert [order.position_of(i) for i in listed] == list(range(size))


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 5000), seed=seeds, rounds=st.integers(2, 8))
def test_the_feistel_network_is_a_permutation_on_any_small_domain(
    size: int, seed: int, rounds: int
) -> None:
    # Below TABLE_LIMIT the sampler uses a table; the network itself must hold for any size.
    order = FeistelPermutation(size, round_keys(rounds, seed))
    listed = order.take(np.arange(size)).tolist()
    assert sorted(listed) == list(range(size))
    assert [order[p] for p in range(size)] == listed
    assert [order.position_of(i) for i in listed] == list(range(size))


@settings(max_examples=8, deadline=None)
@given(size=st.integers(TABLE_LIMIT + 1, 4 * TABLE_LIMIT), seed=seeds, epoch=epochs)
def test_orders_above_the_table_limit_are_exact_permutations(
    size: int, seed: int, epoch: int
) -> None:
    order = epoch_permutation(size, seed, epoch)
    assert isinstance(order, FeistelPermutation)
    listed = order.take(np.arange(size))
    assert np.array_equal(np.sort(listed), np.arange(size))
    assert list(itertools.islice(order, 5000)) == listed[:5000].tolist()


@settings(max_examples=100, deadline=None)
@given(size=st.integers(1, 2**40), seed=seeds, epoch=epochs, data=st.data())
def test_any_order_up_to_2_to_the_40_round_trips_on_sampled_positions(
    size: int, seed: int, epoch: int, data: st.DataObject
) -> None:
    order = epoch_permutation(size, seed, epoch)
    positions = data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=20))
    indices = [order[p] for p in positions]
    assert all(0 <= i < size for i in indices)
    # The inverse undoes every lookup, so no two positions share an index: injective on a
    # finite set, hence a permutation (each Feistel round is invertible by construction).
    assert [order.position_of(i) for i in indices] == positions
    assert order.take(np.array(positions, dtype=np.int64)).tolist() == indices
    assert len(set(indices)) == len(set(positions))
    if isinstance(order, FeistelPermutation):
        assert size <= order.domain < size + 2 * int(size**0.5) + 3  # rarely walks


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 2**40), seed=seeds, epoch=epochs)
def test_position_to_index_agrees_with_iteration_from_any_start(
    size: int, seed: int, epoch: int
) -> None:
    order = epoch_permutation(size, seed, epoch)
    head = list(itertools.islice(order, 300))
    assert head == [order[p] for p in range(min(size, 300))]
    start = size - min(size, 300)
    assert order.take(np.arange(start, size)).tolist() == [order[p] for p in range(start, size)]


@settings(max_examples=100, deadline=None)
@given(size=st.integers(20, 2**40), seed=seeds, epoch=epochs)
def test_the_order_is_a_function_of_seed_and_epoch_only(size: int, seed: int, epoch: int) -> None:
    positions = np.arange(min(size, 64))
    first = epoch_permutation(size, seed, epoch).take(positions).tolist()
    assert epoch_permutation(size, seed, epoch).take(positions).tolist() == first
    assert epoch_permutation(size, seed, epoch + 1).take(positions).tolist() != first
    assert epoch_permutation(size, seed + 1, epoch).take(positions).tolist() != first
    assert epoch_permutation(size, seed, epoch, "shards").take(positions).tolist() != first


def test_the_order_is_pinned_across_platforms_and_versions() -> None:
    # A checkpoint's cursor counts positions of this exact order: it must never change
    # without a new ORDER name (the sampler refuses a cursor of another order).
    assert list(epoch_permutation(10, 1234, 0)) == [6, 0, 9, 2, 4, 7, 3, 5, 8, 1]
    big = epoch_permutation(10**9, 1234, 3)
    assert [big[p] for p in range(3)] == [289465293, 895307671, 76133937]


def test_small_orders_are_uniform_over_seeds() -> None:
    # Every permutation of 4 elements about equally often over 4800 seeds (chi-square with
    # 23 degrees of freedom; 60 is far in the tail, 0.9999 quantile is about 56).
    counts = Counter(tuple(epoch_permutation(4, seed, 0)) for seed in range(4800))
    assert len(counts) == 24
    chi2 = sum((c - 200) ** 2 / 200 for c in counts.values())
    assert chi2 < 60, counts


def test_feistel_orders_are_uniform_where_the_first_position_lands() -> None:
    size = TABLE_LIMIT + 12345
    buckets = Counter(epoch_permutation(size, seed, 0)[0] * 16 // size for seed in range(3200))
    chi2 = sum((buckets.get(b, 0) - 200) ** 2 / 200 for b in range(16))
    assert chi2 < 45, buckets  # 15 degrees of freedom: 0.9999 quantile about 42


def test_out_of_range_lookups_and_empty_orders_are_refused() -> None:
    order = epoch_permutation(5, 0, 0)
    with pytest.raises(IndexError, match=r"^position \(5\) is outside \[0, 5\)\.$"):
        order[5]
    with pytest.raises(IndexError, match=r"^index \(-1\) is outside \[0, 5\)\.$"):
        order.position_of(-1)
    with pytest.raises(ValueError, match=r"at least one element \(got size 0\)"):
        epoch_permutation(0, 0, 0)
    with pytest.raises(ValueError, match=r"at most 2\*\*62"):
        FeistelPermutation(2**62 + 1, round_keys(ROUNDS, 0))


def test_regimes_and_the_identity() -> None:
    assert isinstance(epoch_permutation(TABLE_LIMIT, 0, 0), TablePermutation)
    assert isinstance(epoch_permutation(TABLE_LIMIT + 1, 0, 0), FeistelPermutation)
    identity = IdentityPermutation(7)
    assert list(identity) == list(range(7)) and identity.position_of(3) == 3
