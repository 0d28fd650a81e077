"""The leader's decisions as tables: (world, node records, memory, clock) -> (action, memory).

No etcd and no thread: each case feeds :func:`membership.decide.decide` what the leader loop
would read, and checks what it would do. Restart-mode and in-place cases side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from elastic.contract.records import NodeRecord, WorkerSlot, WorldMember, WorldRecord
from membership.decide import (
    EndRun,
    InvalidWorld,
    LeaderMemory,
    RunLimits,
    Wait,
    WriteWorld,
    decide,
)

LIMITS = RunLimits(min_nodes=2, max_nodes=3, last_call=1.0, rebuild_after=10.0)


def node(name: str, *, incarnation: int = 1, ready: bool = True, inplace: bool = True,
         rev: int | None = None, pid: int = 100, finished: bool = False,
         **extra: Any) -> NodeRecord:
    index = ord(name) - ord("a") + 1
    return NodeRecord(node=name, host=name, addr=f"10.0.0.{index}", agent_pid=index,
                      store_port=4000 + index, probe_port=5000 + index,
                      workers=(WorkerSlot(0, incarnation, ready, inplace, pid,
                                          finished=finished),),
                      create_revision=rev if rev is not None else index, **extra)


def finished(name: str, **extra: Any) -> NodeRecord:
    """A node whose worker exited 0 (its agent publishes the slot as it was, finished)."""
    return node(name, pid=0, finished=True, done=True, **extra)


def world(epoch: int, *members: str, mode: str = "inplace", incarnations: dict[str, int]
          | None = None, revision: int = 0, **extra: Any) -> WorldRecord:
    inc = incarnations or {}
    return WorldRecord(
        epoch, tuple(WorldMember(m, f"10.0.0.{ord(m) - ord('a') + 1}", (f"0.{inc.get(m, 1)}",),
                                 5000 + ord(m) - ord("a") + 1) for m in members),
        (f"10.0.0.{ord(members[0]) - ord('a') + 1}" if members else "10.0.0.1", 4001),
        mode, revision=revision or 10 * epoch, **extra)


@dataclass
class Case:
    """One row: what the leader reads, and what it must do."""

    name: str
    current: WorldRecord | InvalidWorld | None
    nodes: Sequence[NodeRecord]
    #: ``write`` (with ``ranks``), ``end``, or ``wait``.
    expect: str
    ranks: tuple[str, ...] = ()
    memory: LeaderMemory = field(default_factory=LeaderMemory)
    now: float = 0.0
    limits: RunLimits = LIMITS
    #: Fields the written world must have (``epoch``, ``mode``, ``lost``, ``cause``, ...).
    written: dict[str, Any] = field(default_factory=dict)
    #: ``wait``: the seconds to wait; ``end``: a text the end record's reason contains.
    detail: Any = None


CASES = [
    # -- the first world -------------------------------------------------------------------
    Case("first world waits for the last call", None, [node("a"), node("b")], "wait",
         detail=1.0),
    Case("first world once the last call is over", None, [node("a"), node("b")], "write",
         ranks=("a/0.1", "b/0.1"), now=1.0,
         memory=LeaderMemory(pending=(("a/0.1", "b/0.1"), "inplace"), pending_since=0.0),
         written={"epoch": 1, "cause": "start", "mode": "inplace"}),
    Case("first world at once when nobody else can come", None,
         [node("a"), node("b"), node("c")], "write", ranks=("a/0.1", "b/0.1", "c/0.1"),
         written={"epoch": 1}),
    Case("too few nodes: no world", None, [node("a")], "wait", detail=1.0),
    Case("a script without ElasticLoop trains in restart mode", None,
         [node("a", inplace=False), node("b"), node("c")], "write",
         ranks=("a/0.1", "b/0.1", "c/0.1"), written={"mode": "restart"}),
    # -- in place --------------------------------------------------------------------------
    Case("in place: a crashed worker is written out at once",
         world(4, "a", "b", "c"), [node("a"), node("b", incarnation=2, ready=False),
                                   node("c")],
         "write", ranks=("a/0.1", "c/0.1"),
         written={"epoch": 5, "lost": ("b/0.1",), "cause": "worker_failed"}),
    Case("in place: a lost node is written out at once",
         world(4, "a", "b", "c"), [node("a"), node("c")], "write", ranks=("a/0.1", "c/0.1"),
         written={"lost": ("b/0.1",), "cause": "node_lost"}),
    Case("in place: a joiner waits for the last call", world(4, "a", "b"),
         [node("a"), node("b"), node("c", ready=False)], "wait", detail=1.0),
    Case("in place: a ready joiner, the last call over", world(4, "a", "b"),
         [node("a"), node("b"), node("c")], "write", ranks=("a/0.1", "b/0.1", "c/0.1"),
         now=5.0, memory=LeaderMemory(pending=(("a/0.1", "b/0.1", "c/0.1"), "inplace"),
                                      pending_since=3.9),
         written={"epoch": 5, "cause": "node_joined", "lost": ()}),
    Case("in place: a departing node leaves at once, as planned", world(4, "a", "b", "c"),
         [node("a"), node("b"), node("c", departing={"source": "aws"})], "write",
         ranks=("a/0.1", "b/0.1"),
         written={"departed": ("c/0.1",), "lost": (), "cause": "planned_departure"}),
    Case("in place: too few nodes left: the empty world, survivors wait with the state",
         world(4, "a", "b"), [node("a")], "write", ranks=(),
         written={"epoch": 5, "mode": "inplace", "lost": ("b/0.1",)}),
    Case("in place: a crash leaves too few ready nodes, but its node is restarting it: the "
         "survivors train on without it (never the empty world)",
         world(4, "a", "b"), [node("a"), node("b", ready=False)], "write",
         ranks=("a/0.1",), written={"epoch": 5, "lost": ("b/0.1",), "mode": "inplace"}),
    Case("in place: ... and with its next incarnation starting, the same",
         world(4, "a", "b", "c"),
         [node("a"), node("b", incarnation=2, ready=False), node("c", ready=False)],
         "write", ranks=("a/0.1",), limits=RunLimits(3, 3),
         written={"lost": ("b/0.1", "c/0.1")}),
    Case("in place: a departing node does not count (too few nodes: no world to write)",
         world(4, "a", "b"), [node("a"), node("b", ready=False, departing={"source": "x"})],
         "wait", detail=1.0),
    Case("restart: a crash that leaves too few ready nodes restarts everyone",
         world(4, "a", "b", mode="restart"), [node("a"), node("b", ready=False)], "write",
         ranks=(), written={"mode": "restart", "lost": ("b/0.1",)}),
    Case("in place: nothing changed", world(4, "a", "b"), [node("a"), node("b")], "wait",
         detail=1.0),
    Case("in place: a laggard every other worker waits for is evicted",
         world(4, "a", "b", "c"),
         [node("a", waiting={"epoch": 4, "step": 9, "workers": ["0.1"]}),
          node("b", waiting={"epoch": 4, "step": 9, "workers": ["0.1"]}), node("c")],
         "write", ranks=("a/0.1", "b/0.1"),
         written={"evicted": ("c/0.1",), "lost": (), "cause": "worker_evicted"}),
    Case("in place: every member failed to build: written again, on a fresh epoch",
         world(4, "a", "b"), [node("a", failed_build=4), node("b", failed_build=4)],
         "write", ranks=("a/0.1", "b/0.1"), written={"epoch": 5, "cause": "rebuild"}),
    Case("in place: one member failed to build: the others get rebuild_after",
         world(4, "a", "b"), [node("a", failed_build=4), node("b")], "wait", now=3.0,
         memory=LeaderMemory(rebuild_since=(4, 1.0)), detail=8.0),
    # -- restart mode ----------------------------------------------------------------------
    Case("restart: a loss restarts everyone (the empty world) at once",
         world(4, "a", "b", "c", mode="restart"), [node("a"), node("c")], "write",
         ranks=(), written={"epoch": 5, "mode": "restart", "lost": ("b/0.1",),
                            "cause": "node_lost"}),
    Case("restart: growth restarts everyone once settled",
         world(4, "a", "b", mode="restart"),
         [node("a", inplace=False), node("b", inplace=False), node("c", inplace=False)],
         "write", ranks=(), now=2.0,
         memory=LeaderMemory(pending=(("a/0.1", "b/0.1", "c/0.1"), "restart"),
                             pending_since=0.5),
         written={"epoch": 5, "lost": ()}),
    Case("restart: after the empty world, running incarnations are not taken",
         world(5, mode="restart"),
         [node("a", pid=7), node("b", incarnation=2, pid=0), node("c", incarnation=2, pid=0)],
         "wait", detail=1.0),
    Case("restart: after the empty world, the new incarnations once settled",
         world(5, mode="restart", cause="node_joined"),
         [node(n, incarnation=2, pid=0, inplace=False) for n in "abc"], "write",
         ranks=("a/0.2", "b/0.2", "c/0.2"), now=1.5,
         memory=LeaderMemory(pending=(("a/0.2", "b/0.2", "c/0.2"), "restart"),
                             pending_since=0.5),
         written={"epoch": 6, "cause": "node_joined"}),
    Case("restart: after the empty world, a complete world of new incarnations at once",
         world(5, mode="restart", cause="worker_failed"),
         [node(n, incarnation=2, pid=0, inplace=False) for n in "abc"], "write",
         ranks=("a/0.2", "b/0.2", "c/0.2"), written={"epoch": 6, "cause": "worker_failed"}),
    Case("restart: after the empty world, every live node's new incarnations at once, "
         "below max nodes too",
         world(5, mode="restart", cause="node_lost"),
         [node(n, incarnation=2, pid=0, inplace=False) for n in "ab"], "write",
         ranks=("a/0.2", "b/0.2"), written={"epoch": 6, "cause": "node_lost"}),
    Case("restart: after the empty world, a node not ready yet (backing off) keeps the last "
         "call", world(5, mode="restart"),
         [node("a", incarnation=2, pid=0, inplace=False),
          node("b", incarnation=2, pid=0, inplace=False),
          node("c", incarnation=2, pid=0, inplace=False, ready=False)], "wait", detail=1.0),
    Case("restart: every worker now in place: the same epoch upgraded",
         world(4, "a", "b", mode="restart"), [node("a"), node("b")], "write",
         ranks=("a/0.1", "b/0.1"), written={"epoch": 4, "mode": "inplace"}),
    Case("restart: a departure seen before the node's record vanished stays a departure",
         world(4, "a", "b", "c", mode="restart"), [node("a"), node("b")], "write", ranks=(),
         memory=LeaderMemory(departing=frozenset({"c"})),
         written={"departed": ("c/0.1",), "lost": ()}),
    # -- the run's end ---------------------------------------------------------------------
    Case("every worker died of the same error: the script's bug ends the run",
         world(4, "a", "b"), [node("a", failure={"step": -1, "error": "SystemExit: 2"}),
                              node("b", failure={"step": -1, "error": "SystemExit: 2"})],
         "end", detail="failed on every worker before its first step: SystemExit: 2"),
    Case("every member done", world(4, "a", "b"), [node("a", done=True), node("b", done=True)],
         "end", detail="every worker finished training"),
    Case("the end is decided once", world(4, "a", "b"),
         [node("a", done=True), node("b", done=True)], "wait",
         memory=LeaderMemory(ended=True), detail=1.0),
    # -- workers that finished: neither ready nor lost --------------------------------------
    Case("in place: a worker that finished is not lost: its absence alone writes nothing",
         world(4, "a", "b"), [node("a"), finished("b")], "wait", detail=1.0),
    Case("restart: nodes finish seconds apart: no 'everyone restart' world meanwhile",
         world(4, "a", "b", mode="restart"), [node("a", inplace=False), finished("b")],
         "wait", detail=1.0, limits=RunLimits(2, 2)),
    Case("in place: rank 0 refused to end (its final checkpoint fenced off) and the other "
         "finished: only rank 0 is lost, and nobody is left to train: the empty world",
         world(5, "a", "b"), [node("a", incarnation=2, ready=False), finished("b")],
         "write", ranks=(), limits=RunLimits(1, 2),
         written={"epoch": 6, "mode": "inplace", "lost": ("a/0.1",)}),
    Case("in place: ... then the steps left are redone by the new incarnation, alone",
         world(6, mode="inplace", lost=("a/0.1",)), [node("a", incarnation=2), finished("b")],
         "write", ranks=("a/0.2",), limits=RunLimits(1, 2), now=1.5,
         memory=LeaderMemory(pending=(("a/0.2",), "inplace"), pending_since=0.5),
         written={"epoch": 7, "mode": "inplace"}),
    Case("in place: a crash beside a finished worker: the world of those who can train",
         world(5, "a", "b", "c"), [node("a"), finished("b"), node("c", incarnation=2,
                                                                   ready=False)],
         "write", ranks=("a/0.1",), limits=RunLimits(1, 3),
         written={"epoch": 6, "lost": ("c/0.1",), "cause": "worker_failed"}),
    Case("in place: a world naming a finished worker (an older leader's) is rebuilt without "
         "it once every member that can build it failed to",
         world(7, "a", "b", "c"), [node("a", failed_build=7), finished("b"),
                                   node("c", failed_build=7)],
         "write", ranks=("a/0.1", "c/0.1"), limits=RunLimits(1, 3),
         written={"epoch": 8, "cause": "rebuild"}),
    Case("in place: a joiner beside a finished worker: the growth leaves the finished one out",
         world(4, "a", "b"), [node("a"), finished("b"), node("c")], "write",
         ranks=("a/0.1", "c/0.1"), limits=RunLimits(1, 3), now=2.0,
         memory=LeaderMemory(pending=(("a/0.1", "c/0.1"), "inplace"), pending_since=0.5),
         written={"epoch": 5, "lost": (), "cause": "node_joined"}),
    # -- a damaged world key ---------------------------------------------------------------
    Case("a world key that holds no world record is replaced, epoch = its revision",
         InvalidWorld(revision=77), [node("a"), node("b")], "write",
         ranks=("a/0.1", "b/0.1"), written={"epoch": 77}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_leader_decides(case: Case) -> None:
    action, memory = decide(case.current, case.nodes, case.memory, case.limits, now=case.now)
    if case.expect == "write":
        assert isinstance(action, WriteWorld), action
        assert action.world.ranks() == case.ranks
        for name, value in case.written.items():
            assert getattr(action.world, name) == value, name
        base = case.current.revision if case.current is not None else None
        assert action.base == base
        assert memory.pending is None
    elif case.expect == "end":
        assert isinstance(action, EndRun), action
        assert case.detail in action.record.reason
        assert memory.ended
    else:
        assert isinstance(action, Wait), action
        assert action.seconds == pytest.approx(case.detail)


def test_a_growing_proposal_is_written_once_it_stayed_the_same_for_the_last_call() -> None:
    limits = replace(LIMITS, max_nodes=5)  # room for more: no shortcut
    current = world(4, "a", "b")
    nodes = [node("a"), node("b"), node("c")]
    action, memory = decide(current, nodes, LeaderMemory(), limits, now=10.0)
    assert action == Wait(1.0) and memory.pending_since == 10.0
    action, memory = decide(current, nodes, memory, limits, now=10.6)
    assert isinstance(action, Wait) and action.seconds == pytest.approx(0.4)
    # A further join restarts the settle: several joins become one reconfiguration.
    action, memory = decide(current, [*nodes, node("d")], memory, limits, now=10.8)
    assert isinstance(action, Wait) and memory.pending_since == 10.8
    action, memory = decide(current, [*nodes, node("d")], memory, limits, now=11.9)
    assert isinstance(action, WriteWorld)
    assert action.world.ranks() == ("a/0.1", "b/0.1", "c/0.1", "d/0.1")


def test_an_evicted_worker_is_never_admitted_again_while_it_runs() -> None:
    current = world(5, "a", "b", evicted=("c/0.1",))
    nodes = [node("a"), node("b"), node("c")]  # c's record still shows it ready
    action, memory = decide(current, nodes, LeaderMemory(), LIMITS, now=0.0)
    assert isinstance(action, Wait) and memory.evicted == {"c/0.1"}
    # Its agent killed it and started a new incarnation: that one may join.
    action, memory = decide(current, [node("a"), node("b"), node("c", incarnation=2)],
                            memory, LIMITS, now=5.0)
    assert memory.evicted == frozenset()


def test_a_store_is_never_named_by_two_worlds() -> None:
    current = world(4, "a", "b", "c")
    memory = LeaderMemory().wrote(current)
    action, memory = decide(current, [node("a"), node("b")], memory, LIMITS, now=0.0)
    assert isinstance(action, WriteWorld)
    assert action.world.store != current.store and current.store[0] == "10.0.0.1"
    assert memory.wrote(action.world).used_stores == {current.store, action.world.store}


def test_every_live_node_done_ends_the_run_only_once_no_missing_node_came_back() -> None:
    # A rank 0 refused to end (its final checkpoint fenced off by an etcd stall, which also
    # expired its node's lease): the empty world lost it, and its node is joining again.
    limits = replace(LIMITS, min_nodes=1, rejoin_grace=3.0)
    current = world(6, mode="inplace", lost=("a/0.1",))
    alone = [finished("b")]
    action, memory = decide(current, alone, LeaderMemory(), limits, now=10.0)
    assert isinstance(action, Wait) and action.seconds <= 3.0 and memory.done_since == 10.0
    # Its node is back, its new worker starting: the run goes on.
    back = [node("a", incarnation=2, ready=False), finished("b")]
    action, memory = decide(current, back, memory, limits, now=11.0)
    assert not isinstance(action, EndRun) and memory.done_since is None
    # A node that does not come back within the grace is gone: whoever is here is done.
    action, memory = decide(current, alone, memory, limits, now=12.0)
    assert isinstance(action, Wait) and memory.done_since == 12.0
    action, memory = decide(current, alone, memory, limits, now=15.0)
    assert isinstance(action, EndRun) and memory.ended
    assert action.record.reason == "every worker finished training"
