"""The failure note a restart-mode node publishes when its workers die as it restarts them.

The leader ends the run as the script's own bug when every node reports the same error at the
same step and at least one note is a worker's own failure (``membership.proposal``). When a
node is killed, the survivors' workers all die of its loss ("Connection reset by peer", one
step) and are restarted for the world that names it lost: that note must not count as their
own, or the run ends as failed (two chaos campaigns ended so).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence
from types import SimpleNamespace
from typing import Any, cast

from elastic.contract.records import WorldMember, WorldRecord
from launch.failure_judge import FailureJudge
from launch.slot_state import PendingFailure, Slot
from membership.proposal import common_failure


def _world(epoch: int, *workers: str, lost: tuple[str, ...] = (),
           cause: str = "") -> WorldRecord:
    members = tuple(WorldMember(w.split("/")[0], "127.0.0.1", (w.split("/")[1],), 1)
                    for w in workers)
    return WorldRecord(epoch, members, ("127.0.0.1", 1), "restart", lost=lost, cause=cause)


class _Probes:
    """The peer evictor's probes of other nodes' liveness ports; ``dead`` nodes refuse."""

    def __init__(self, dead: Collection[str]) -> None:
        self.dead = set(dead)
        self.probed: list[str] = []

    def check(self, nodes: Sequence[str], world: WorldRecord) -> bool:
        self.probed.extend(nodes)
        return bool(self.dead & set(nodes))

    def all_answer(self, nodes: Sequence[str], world: WorldRecord) -> bool:
        return not self.dead & set(nodes)


def _judge(node: str, newest: WorldRecord, *, dead: Collection[str] = ()) -> FailureJudge:
    run = SimpleNamespace(world=lambda: newest,
                          node=SimpleNamespace(lease=SimpleNamespace(fresh=lambda margin: True)))
    config = SimpleNamespace(budget=SimpleNamespace(backoff_base=1.0), ttl=3)
    noop = lambda *_a, **_k: None  # noqa: E731
    supervisor = SimpleNamespace(restart_in_place=noop, restart_all=noop, slots=[],
                                 lock=threading.RLock())
    events = SimpleNamespace(record=noop)
    return FailureJudge(cast(Any, config), cast(Any, supervisor), cast(Any, _Probes(dead)),
                        cast(Any, events),
                        node=lambda: node, run=lambda: cast(Any, run),
                        still_connected=lambda _p: False, broadcast=noop, wake=noop,
                        publish=noop)


def _note(judge: FailureJudge) -> dict[str, Any]:
    """The judge's failure note, once its probe of the failed world's nodes (a thread) took it."""
    deadline = time.monotonic() + 10.0
    while judge.failure_note is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert judge.failure_note is not None
    return judge.failure_note


TRAINED = _world(11, "n0/0.6", "n1/0.5", "n2/0.3")
ERROR = "RuntimeError: [gloo/pair.cc:537] Read error [127.0.0.1]:15285: Connection reset by peer"


def _died_as_restarted(judge: FailureJudge, *, peer_type: bool = True) -> dict[str, Any]:
    slot = Slot(local_rank=0, incarnation=6, started_for=TRAINED,
                report={"before_stop": True, "error": ERROR, "step": 37,
                        "peer_type": peer_type})
    judge.restarted_while_dying(slot)
    return _note(judge)


def test_survivors_of_a_lost_node_note_a_failure_that_is_not_their_own() -> None:
    # Restart mode's "everyone restart" world after n2's record went (its node was killed).
    after_loss = _world(12, lost=("n2/0.3",), cause="node_lost")
    notes = [_died_as_restarted(_judge(node, after_loss)) for node in ("n0", "n1")]
    assert [n["own"] for n in notes] == [False, False]
    records = [SimpleNamespace(departing=None, workers=(1,), failure=n) for n in notes]
    assert common_failure(cast(Any, records)) is None  # the run goes on


def test_a_restart_no_peer_loss_explains_keeps_the_error_the_workers_own() -> None:
    # The newer world names only this node's own worker lost, or nobody, or peers of live
    # nodes that failed too (a script raising on every rank): the error is the script's
    # until shown otherwise, and every node dying of it ends the run.
    for newest in (_world(12, lost=("n0/0.6",), cause="node_lost"),
                   _world(12, "n0/0.6", "n1/0.5"),
                   _world(12, lost=("n1/0.5", "n2/0.3"), cause="worker_failed")):
        assert _died_as_restarted(_judge("n0", newest))["own"] is True
    notes = [_died_as_restarted(_judge(node, _world(12))) for node in ("n0", "n1")]
    records = [SimpleNamespace(departing=None, workers=(1,), failure=n) for n in notes]
    ended = common_failure(cast(Any, records))
    assert ended is not None and ended.step == 37


def test_an_error_no_peer_causes_is_the_workers_own_even_after_a_loss() -> None:
    after_loss = _world(12, lost=("n2/0.3",), cause="node_lost")
    assert _died_as_restarted(_judge("n0", after_loss), peer_type=False)["own"] is True


def test_survivors_restarted_before_the_killed_node_left_the_records_do_not_own_the_error(
) -> None:
    # CI: n2 was killed whole (agent and worker). n0's worker died of it first, and its
    # restart made the leader write restart mode's empty world naming n0's worker lost, with
    # n2's record still there (its lease TTL had not passed): cause "worker_failed", as if a
    # peer of a live node had raised too. n1 restarted its dying worker for that world. Only
    # a probe of the failed world's nodes shows that n2 is gone.
    after_first = _world(12, lost=("n0/0.6",), cause="worker_failed")
    judge = _judge("n1", after_first, dead={"n2"})
    note = _died_as_restarted(judge)
    assert note["own"] is False and set(cast(_Probes, judge._evictor).probed) == {"n0", "n2"}
    n0 = {"step": 37, "error": ERROR, "count": 1, "own": False}  # settled on its probe
    records = [SimpleNamespace(departing=None, workers=(1,), failure=n) for n in (n0, note)]
    assert common_failure(cast(Any, records)) is None  # the run goes on
    # With every node alive the same error is the script's own (it raised on every rank).
    assert _died_as_restarted(_judge("n1", after_first))["own"] is True


def _settled_as_a_peers(judge: FailureJudge, failed_in: WorldRecord) -> dict[str, Any]:
    """A worker that raised the script's RuntimeError at step 5, settled after the newest
    world named workers of its world's other nodes lost."""
    process = SimpleNamespace(stopping=False, last_error_line="")
    slot = Slot(local_rank=0, incarnation=1, inplace=True, connected=True,
                report={"before_stop": True, "peer": False, "peer_type": True, "step": 5,
                        "error": "RuntimeError: the labels of step 5 are out of range"})
    slot.pending = PendingFailure(cast(Any, process), 1, failed_in, decide_by=0.0)
    assert judge.settle(slot, now=1.0, last_world=failed_in)
    assert slot.pending is None and slot.report is not None and slot.report["peer"] is True
    assert judge.restarts == 0  # a peer's failure: never charged
    return _note(judge)


def test_every_rank_raising_at_once_ends_the_run_though_each_node_sees_the_others_lost_first(
) -> None:
    failed_in = _world(3, "n0/0.1", "n1/0.1", "n2/0.1")
    notes = []
    for node in ("n0", "n1", "n2"):
        others = tuple(f"{n}/0.1" for n in ("n0", "n1", "n2") if n != node)
        newest = _world(4, f"{node}/0.1", lost=others, cause="worker_failed")
        notes.append(_settled_as_a_peers(_judge(node, newest), failed_in))
    assert [n["own"] for n in notes] == [True, True, True]
    records = [SimpleNamespace(departing=None, workers=(1,), failure=n) for n in notes]
    ended = common_failure(cast(Any, records))
    assert ended is not None and ended.step == 5


def test_a_peer_failure_settled_after_a_node_was_lost_is_not_the_workers_own() -> None:
    failed_in = _world(3, "n0/0.1", "n1/0.1", "n2/0.1")
    newest = _world(4, "n0/0.1", "n1/0.1", lost=("n2/0.1",), cause="node_lost")
    notes = [_settled_as_a_peers(_judge(node, newest), failed_in) for node in ("n0", "n1")]
    assert [n["own"] for n in notes] == [False, False]
    records = [SimpleNamespace(departing=None, workers=(1,), failure=n) for n in notes]
    assert common_failure(cast(Any, records)) is None


def test_one_restart_answers_a_failure_another_slot_was_still_being_judged_for() -> None:
    # Restart mode, two workers on this node: worker 0 is SIGKILLed, worker 1 dies of it
    # ("Connection reset by peer") and its failure waits for evidence of its cause. Worker
    # 0's kill restarts both slots. Worker 1's failure, judged later, must not be taken for a
    # crash of the fresh incarnation and restart them again (a benchmark's single kill
    # cost three restarts and 20 s so).
    from launch.budget import CrashBudget

    world = _world(3, "n0/0.1", "n0/1.1", "n1/0.1")
    dead = SimpleNamespace(stopping=False, last_error_line="", incarnation=1)
    reset = SimpleNamespace(stopping=False, last_error_line=ERROR, incarnation=1)
    slots = [Slot(local_rank=0, incarnation=1, started_for=world),
             Slot(local_rank=1, incarnation=1, started_for=world,
                  report={"error": ERROR, "step": 12, "peer": False, "peer_type": True,
                          "before_stop": True})]
    slots[0].pending = PendingFailure(cast(Any, dead), -9, world, decide_by=10.0)
    slots[1].pending = PendingFailure(cast(Any, reset), 1, world, decide_by=10.0,
                                      probed=True)
    restarted: list[str] = []

    def restart_all(except_for: Slot, delay: float) -> None:  # as the Supervisor's
        restarted.append(except_for.local_id)
        for slot in slots:
            slot.process = None
            slot.next_incarnation()

    judge = _judge("n0", world)
    judge.budget = CrashBudget(max_restarts=3, window=60.0, backoff_base=1.0)
    judge._supervisor = cast(Any, SimpleNamespace(slots=slots, restart_all=restart_all,
                                                  lock=threading.RLock()))
    assert judge.settle(slots[1], now=1.0, last_world=world)  # its cause is not known yet
    assert judge.settle(slots[0], now=1.0, last_world=world)  # a SIGKILL: its own
    for now in (2.0, 11.0):  # the agent's later ticks
        for slot in slots:
            if slot.pending is not None:
                assert judge.settle(slot, now=now, last_world=world)
    assert restarted == ["0.1"] and judge.restarts == 1
    assert [slot.incarnation for slot in slots] == [2, 2]
    # Worker 1's error still counts for the "script bug" rule (no node was lost).
    note = _note(judge)
    assert note["error"] == ERROR and note["own"] is True
