"""The re-shard plan (elastic.sharded.plan), table by table: shard ranges, the step chosen,
who sends which rows, and where copies go."""

from __future__ import annotations

import itertools

import pytest
import torch

from elastic.sharded.plan import (
    Holding,
    Piece,
    choose_step,
    copy_holders,
    hsdp_replicas,
    plan_pieces,
    shard_range,
)


@pytest.mark.parametrize(("rows", "shards", "ranges"), [
    (16, 3, [(0, 6), (6, 12), (12, 16)]),
    (1, 3, [(0, 1), (1, 1), (1, 1)]),
    (16, 6, [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 16)]),
    (12, 4, [(0, 3), (3, 6), (6, 9), (9, 12)]),
    (0, 2, [(0, 0), (0, 0)]),
    (5, 1, [(0, 5)]),
])
def test_shard_ranges_are_torch_chunks(rows: int, shards: int,
                                       ranges: list[tuple[int, int]]) -> None:
    assert [shard_range(rows, shards, i) for i in range(shards)] == ranges
    if rows:
        chunks = torch.arange(rows).chunk(shards)
        for i, (start, stop) in enumerate(ranges):
            expected = chunks[i].tolist() if i < len(chunks) else []
            assert list(range(start, stop)) == expected


def _live(rank: int, step: int, shards: int, index: int) -> Holding:
    return Holding(rank=rank, kind="live", step=step, shards=shards, index=index)


def test_the_live_step_wins_when_every_shard_survived() -> None:
    # Shard 2 of 3 lost its live holder, but its copy (held by rank 0) is current.
    holdings = [_live(0, 9, 3, 0), _live(1, 9, 3, 1),
                Holding(rank=0, kind="copy", step=9, shards=3, index=2),
                Holding(rank=0, kind="own", step=8, shards=3, index=0)]
    assert choose_step(holdings, [16, 1]) == 9


def test_a_lost_shard_rolls_everyone_back_to_the_newest_complete_snapshot() -> None:
    holdings = [_live(0, 9, 3, 0), _live(1, 10, 3, 1),  # mixed steps after a failure
                Holding(rank=0, kind="own", step=8, shards=3, index=0),
                Holding(rank=1, kind="own", step=8, shards=3, index=1),
                Holding(rank=1, kind="copy", step=8, shards=3, index=2),
                Holding(rank=0, kind="copy", step=4, shards=3, index=1)]
    assert choose_step(holdings, [16]) == 8


def test_holdings_cut_in_different_worlds_combine() -> None:
    # Rows 0-7 from a world of 2, rows 6-16 from shards 1 and 2 of a world of 3.
    holdings = [_live(0, 5, 2, 0), Holding(rank=1, kind="copy", step=5, shards=3, index=1),
                Holding(rank=1, kind="own", step=5, shards=3, index=2)]
    assert choose_step(holdings, [16]) == 5
    assert choose_step(holdings, [16, 3]) == 5  # 3 rows: [0, 2) / [1, 2) and [2, 3)
    assert choose_step([_live(0, 5, 2, 0)], [16]) == -1


def test_no_holder_means_storage() -> None:
    assert choose_step([], [16]) == -1
    assert choose_step([_live(0, 3, 2, 1)], [16]) == -1


def test_a_model_without_sharded_tensors_needs_any_holder() -> None:
    assert choose_step([_live(1, 7, 2, 1)], []) == 7


def test_a_rank_keeps_its_own_rows_and_newcomers_get_theirs_from_holders() -> None:
    # 16 rows on 3 ranks (6, 6, 4) move to 4 ranks (4 each); rank 3 is a newcomer.
    holdings = [_live(r, 5, 3, r) for r in range(3)]
    pieces = plan_pieces(holdings, 5, [16], [8], 4, [0, 1, 2, 3])
    by_dest: dict[int, list[tuple[int, int, int]]] = {}
    for p in pieces:
        by_dest.setdefault(p.dest, []).append((p.source, p.start, p.stop))
    assert by_dest == {
        0: [(0, 0, 4)],
        1: [(0, 4, 6), (1, 6, 8)],
        2: [(1, 8, 12)],
        3: [(2, 12, 16)],
    }
    assert Piece(tensor=0, source=0, kind="live", dest=1, start=4, stop=6, source_offset=4,
                 dest_offset=0) in pieces


def test_hsdp_losses_are_served_by_the_other_replica_and_spread_over_senders() -> None:
    # 6 -> 4 ranks: replicas (2 x 3) lost ranks 2 and 3 (shards 2 and 0); the new world is
    # 2 x 2. Survivors renumbered 0, 1, 2, 3 hold shards 0, 1 (replica 0) and 1, 2 (replica 1).
    holdings = [_live(0, 7, 3, 0), _live(1, 7, 3, 1), _live(2, 7, 3, 1), _live(3, 7, 3, 2)]
    assert choose_step(holdings, [12]) == 7
    pieces = plan_pieces(holdings, 7, [12], [1], 2, [0, 1, 0, 1])
    for dest, index in enumerate([0, 1, 0, 1]):
        start, stop = shard_range(12, 2, index)
        rows = sorted((p.start, p.stop) for p in pieces if p.dest == dest)
        assert rows[0][0] == start and rows[-1][1] == stop
        assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))
    sent = {r: sum(p.rows for p in pieces if p.source == r != p.dest) for r in range(4)}
    assert max(sent.values()) - min(sent.values()) <= 4  # nobody sends everything


def test_pieces_prefer_live_state_and_carry_offsets() -> None:
    holdings = [_live(0, 3, 2, 0), Holding(rank=1, kind="own", step=3, shards=2, index=1),
                Holding(rank=0, kind="copy", step=3, shards=2, index=1)]
    pieces = plan_pieces(holdings, 3, [10], [4], 1, [0])
    assert [(p.source, p.kind, p.start, p.stop, p.source_offset) for p in pieces] == [
        (0, "live", 0, 5, 0), (0, "copy", 5, 10, 0)]


def test_an_uncovered_row_is_an_error() -> None:
    with pytest.raises(ValueError, match="row 5 of tensor 0 is held by no rank at step 3"):
        plan_pieces([_live(0, 3, 2, 0)], 3, [10], [4], 1, [0])


@pytest.mark.parametrize(("world", "replicate", "groups"), [
    (6, 2, 2), (4, 2, 2), (5, 2, 1), (6, 4, 3), (1, 2, 1), (8, 8, 8), (7, 1, 1),
])
def test_replica_groups_divide_the_world(world: int, replicate: int, groups: int) -> None:
    assert hsdp_replicas(world, replicate) == groups


@pytest.mark.parametrize(("nodes", "holders"), [
    (["a", "a", "b", "b", "c", "c"], [2, 3, 4, 5, 0, 1]),
    (["a", "b"], [1, 0]),
    (["a", "a"], [1, 0]),  # one node: a worker's loss is covered, the node's is not
    (["a"], [-1]),
    (["a", "a", "a", "b"], [1, 2, 3, 0]),  # no offset crosses for all: the most that do
])
def test_copies_go_to_another_node(nodes: list[str], holders: list[int]) -> None:
    assert copy_holders(nodes) == holders
    assert sorted(h for h in holders if h >= 0) == list(range(len(nodes))) or holders == [-1]
