"""The next world, computed the same way by every agent (pure functions, no etcd)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.contract.records import NodeRecord, WorkerSlot, WorldRecord
from membership.proposal import (
    Change,
    classify,
    common_failure,
    failed_builds,
    laggards,
    next_world,
)


def node(name: str, rev: int, slots: int = 1, *, ready: bool = True, inplace: bool = True,
         incarnation: int = 1, port: int = 4000, **extra: object) -> NodeRecord:
    workers = tuple(WorkerSlot(i, incarnation, ready, inplace, 100 + i) for i in range(slots))
    return NodeRecord(node=name, host=name, addr=f"10.0.0.{rev}", agent_pid=rev,
                      store_port=port, workers=workers, create_revision=rev,
                      **extra)  # type: ignore[arg-type]


def propose(current: WorldRecord | None, nodes: list[NodeRecord], lo: int = 1,
            hi: int = 8) -> WorldRecord | None:
    return next_world(current, nodes, min_nodes=lo, max_nodes=hi)


def test_first_world_orders_nodes_by_join_and_ranks_workers_node_by_node() -> None:
    world = propose(None, [node("c", 3), node("a", 1, slots=2), node("b", 2)])
    assert world is not None and world.epoch == 1
    assert world.ranks() == ("a/0.1", "a/1.1", "b/0.1", "c/0.1")
    assert world.store == ("10.0.0.1", 4000)
    assert classify(None, world) is Change.FIRST


def test_survivors_keep_their_ranks_and_joiners_follow() -> None:
    first = propose(None, [node("a", 1), node("b", 2), node("c", 3)])
    assert first is not None
    # b is gone; d (joined before c in etcd's order does not matter) comes after survivors.
    second = propose(first, [node("a", 1), node("c", 3), node("d", 0)])
    assert second is not None and second.epoch == 2
    assert second.ranks() == ("a/0.1", "c/0.1", "d/0.1")
    assert classify(first, second) is Change.LOSS


def test_growth_and_no_change_are_told_apart_from_a_loss() -> None:
    first = propose(None, [node("a", 1), node("b", 2)])
    grown = propose(first, [node("a", 1), node("b", 2), node("c", 3)])
    same = propose(first, [node("a", 1), node("b", 2)])
    assert classify(first, grown) is Change.GROWTH
    assert classify(first, same) is Change.NONE


def test_departing_not_ready_and_too_few_nodes() -> None:
    nodes = [node("a", 1), node("b", 2, departing={"source": "aws"}), node("c", 3, ready=False)]
    assert propose(None, nodes, lo=2) is None
    world = propose(None, nodes, lo=1)
    assert world is not None and world.ranks() == ("a/0.1",)


def test_max_nodes_and_the_global_batch_cap_leave_spares() -> None:
    nodes = [node(n, i, slots=2, max_world=5) for i, n in enumerate("abcd", start=1)]
    world = propose(None, nodes, hi=3)
    assert world is not None
    assert world.ranks() == ("a/0.1", "a/1.1", "b/0.1", "b/1.1", "c/0.1")


def test_mode_is_inplace_only_when_every_worker_says_so() -> None:
    assert propose(None, [node("a", 1), node("b", 2)]).mode == "inplace"  # type: ignore[union-attr]
    mixed = propose(None, [node("a", 1), node("b", 2, inplace=False)])
    assert mixed is not None and mixed.mode == "restart"


def test_after_restart_modes_empty_world_only_fresh_incarnations_are_taken() -> None:
    """The empty world restarts every running worker: a record still showing one (its agent
    has not seen the empty world yet) must not make the next world, or that world would be
    replaced as soon as the agent restarts it."""
    empty = WorldRecord(5, (), ("10.0.0.1", 4000), "restart")
    stale = node("a", 1, incarnation=3)  # still running (pid 100)
    fresh = node("b", 2, incarnation=4).with_changes(
        workers=(WorkerSlot(0, 4, True, False, 0),))  # restarted, not started yet
    world = propose(empty, [stale, fresh])
    assert world is not None and world.ranks() == ("b/0.4",)
    assert propose(empty, [stale, fresh], lo=2) is None  # a's fresh incarnation is awaited
    # Elsewhere a running worker is a member like any other.
    assert propose(None, [stale, fresh]).ranks() == ("a/0.3", "b/0.4")  # type: ignore[union-attr]
    inplace_empty = WorldRecord(5, (), ("10.0.0.1", 4000), "inplace")
    assert propose(inplace_empty, [stale]).ranks() == ("a/0.3",)  # type: ignore[union-attr]


def test_a_store_is_never_handed_to_two_worlds() -> None:
    first = propose(None, [node("a", 1, port=4000), node("b", 2, port=5000)])
    assert first is not None and first.store == ("10.0.0.1", 4000)
    # a's agent has not published a new spare yet: the next world uses b's.
    second = propose(first, [node("a", 1, port=4000), node("b", 2, port=5000), node("c", 3)])
    assert second is not None and second.store == ("10.0.0.2", 5000)


def test_common_failure_needs_every_active_node_with_the_same_error_and_step() -> None:
    bad = {"step": 5, "error": "ValueError: boom", "count": 1}
    found = common_failure([node("a", 1, failure=bad), node("b", 2, failure=bad)])
    assert found is not None and (found.step, found.error) == (5, "ValueError: boom")
    assert common_failure([node("a", 1, failure=bad),
                           node("b", 2, failure={**bad, "step": 6})]) is None
    assert common_failure([node("a", 1, failure=bad), node("b", 2)]) is None
    # A departing node does not have to agree.
    assert common_failure([node("a", 1, failure=bad), node("b", 2, failure=bad),
                           node("c", 3, departing={"source": "aws"})]) is not None
    # One worker's single crash is not evidence; the same crash twice is.
    assert common_failure([node("a", 1, failure=bad)]) is None
    assert common_failure([node("a", 1, failure={**bad, "count": 2})]) is not None


def test_workers_that_all_died_of_one_dead_peer_are_no_script_bug() -> None:
    # Survivors of one killed node report the same text, naming it: not a bug in the script.
    peer = {"step": -1, "error": "RuntimeError: Connection closed by peer [127.0.0.1]:30644",
            "count": 1, "own": False}
    assert common_failure([node("a", 1, failure=peer), node("b", 2, failure=peer)]) is None
    # One node that saw the same error as its own worker's crash makes it the script's.
    own = {**peer, "own": True}
    found = common_failure([node("a", 1, failure=peer), node("b", 2, failure=own)])
    assert found is not None and found.error == peer["error"]


def test_laggards_are_the_minority_everyone_else_waits_for() -> None:
    nodes = [node("a", 1), node("b", 2), node("c", 3)]
    world = propose(None, nodes)
    assert world is not None
    wait = {"epoch": 1, "step": 7, "workers": ["0.1"]}
    waiting = [node("a", 1, waiting=wait), node("b", 2, waiting=wait), node("c", 3)]
    assert laggards(world, waiting) == ("c/0.1",)
    # Only one waits: two "laggards" would be a majority, nothing is decided.
    assert laggards(world, [node("a", 1, waiting=wait), node("b", 2), node("c", 3)]) == ()
    # Everyone waits (a partition between peers): no laggard.
    assert laggards(world, [node(n, i, waiting=wait) for i, n in enumerate("abc", 1)]) == ()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=8),
       st.integers(1, 4), st.integers(1, 8))
def test_proposals_are_deterministic_and_respect_the_limits(
    specs: list[tuple[int, bool]], lo: int, hi: int
) -> None:
    nodes = [node(f"n{i}", i + 1, slots=s, ready=r) for i, (s, r) in enumerate(specs)]
    a = propose(None, nodes, lo, hi)
    b = propose(None, list(reversed(nodes)), lo, hi)
    assert a == b  # the input order does not matter: every agent computes the same world
    if a is not None:
        assert lo <= len(a.members) <= hi
        assert len(set(a.ranks())) == a.world_size


def test_a_departed_node_whose_record_is_already_gone_is_still_a_departure() -> None:
    from membership.decide import _cause, _restart_all

    first = propose(None, [node("a", 1), node("b", 2), node("c", 3)])
    assert first is not None
    first = first.with_changes(mode="restart")
    # c announced its departure, drained, and revoked its lease before the leader wrote the
    # world its leaving breaks (CI saw the record gone first): the leader remembers it.
    survivors = [node("a", 1), node("b", 2)]
    empty = _restart_all(first, survivors, {"c"})
    assert empty.departed == ("c/0.1",) and empty.lost == ()
    assert _cause(empty, first, survivors) == "planned_departure"
    # Without that memory the same loss reads as a node lost.
    unknown = _restart_all(first, survivors)
    assert unknown.lost == ("c/0.1",) and _cause(unknown, first, survivors) == "node_lost"


def test_failed_builds_count_in_restart_mode_worlds_too() -> None:
    """A restart-mode world's workers are not restarted while its composition stands: a
    member too slow for the build timeout must get the world written again, as in place."""
    for mode in ("inplace", "restart"):
        nodes = [node("a", 1, inplace=mode == "inplace"), node("b", 2, inplace=False)]
        world = propose(None, nodes)
        assert world is not None
        world = world.with_changes(mode=mode)
        assert failed_builds(world, nodes) == (set(), False)
        one = [nodes[0].with_changes(failed_build=world.epoch), nodes[1]]
        assert failed_builds(world, one) == ({"a"}, False)
        both = [n.with_changes(failed_build=world.epoch) for n in nodes]
        assert failed_builds(world, both) == ({"a", "b"}, True)
    empty = WorldRecord(5, (), ("10.0.0.1", 4000), "restart")
    assert failed_builds(empty, [node("a", 1, failed_build=5)]) == (set(), False)
