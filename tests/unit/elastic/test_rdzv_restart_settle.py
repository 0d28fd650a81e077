"""Restart mode: after its "everyone restart" world, the next world comes as soon as every node
has published fresh incarnations, not a last call later; otherwise the last call still holds.

Real :class:`~elastic.rdzv.job.RunMembership` objects (lease threads, watches, leader loops)
over the in-memory etcd of ``tests/fakes.py``; the last call is far longer than the test, so a
world written within it was written by the shortcut.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from elastic.rdzv.generation import open_run
from elastic.rdzv.job import RunMembership
from elastic.rdzv.keys import JobKeys
from elastic.rdzv.leader import RunLimits
from elastic.rdzv.records import NodeRecord, WorkerSlot
from tests.fakes import FakeEtcd, fake_client

LAST_CALL = 30.0


def _record(name: str, incarnation: int, *, ready: bool = True, pid: int = 0) -> NodeRecord:
    return NodeRecord(node=name, host=name, addr="127.0.0.1", agent_pid=1, store_port=5000,
                      workers=(WorkerSlot(0, incarnation, ready, False, pid),))


def _slots(incarnation: int, *, ready: bool = True, pid: int = 0) -> tuple[WorkerSlot, ...]:
    return (WorkerSlot(0, incarnation, ready, False, pid),)


@pytest.fixture
def nodes() -> Iterator[dict[str, RunMembership]]:
    etcd = FakeEtcd()
    keys = open_run(fake_client(etcd), JobKeys("/t", "job")).keys
    limits = RunLimits(min_nodes=1, max_nodes=3, last_call=LAST_CALL)
    made: dict[str, RunMembership] = {}
    for name in ("a", "b", "c"):
        made[name] = RunMembership(fake_client(etcd), keys, limits=limits, ttl=1)
        made[name].join(_record(name, 1))
    yield made
    for run in made.values():
        run.leave()


def _world_after(run: RunMembership, epoch: int, timeout: float) -> object:
    assert run.wait(lambda v: (w := v.world()) is not None and w.epoch > epoch, timeout), \
        f"no world after epoch {epoch} within {timeout} s"
    return run.world()


def test_the_world_after_a_restart_comes_once_every_node_restarted(
    nodes: dict[str, RunMembership],
) -> None:
    a = nodes["a"]
    first = a.wait(lambda v: (w := v.world()) is not None and len(w.members) == 3, 10)
    assert first
    world = a.world()
    assert world is not None and world.mode == "restart"
    for name, run in nodes.items():  # the workers run
        run.update(workers=_slots(1, pid=100 + ord(name)))
    # b's worker crashes: the leader writes the empty world at once (a loss).
    nodes["b"].update(workers=_slots(1, ready=False))
    empty = _world_after(a, world.epoch, 10)
    assert empty is not None and not empty.members  # type: ignore[attr-defined]
    # a and c restart theirs at once; b's comes a moment later.
    started = time.monotonic()
    nodes["a"].update(workers=_slots(2))
    nodes["c"].update(workers=_slots(2))
    time.sleep(1.0)
    assert a.world() is not None and not a.world().members  # b is not back: the call holds
    nodes["b"].update(workers=_slots(2))
    full = _world_after(a, empty.epoch, 10)  # type: ignore[attr-defined]
    assert len(full.members) == 3  # type: ignore[attr-defined]
    assert time.monotonic() - started < LAST_CALL / 2  # not the last call: the shortcut


def test_a_node_still_restarting_keeps_the_last_call(nodes: dict[str, RunMembership]) -> None:
    a = nodes["a"]
    assert a.wait(lambda v: (w := v.world()) is not None and len(w.members) == 3, 10)
    world = a.world()
    assert world is not None
    for name, run in nodes.items():
        run.update(workers=_slots(1, pid=100 + ord(name)))
    nodes["c"].update(workers=_slots(1, ready=False))
    empty = _world_after(a, world.epoch, 10)
    nodes["a"].update(workers=_slots(2))
    nodes["b"].update(workers=_slots(2))
    # c's slot stays not ready (its worker backs off): a world of a and b could train
    # (min_nodes 1), but it waits for the last call, as c may be back any moment.
    time.sleep(2.0)
    now = a.world()
    assert now is not None and now.epoch == empty.epoch  # type: ignore[attr-defined]
