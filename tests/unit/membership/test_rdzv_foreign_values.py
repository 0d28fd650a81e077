"""A pickle (or anything else elastic-run did not write) in a job's keys, over the fake etcd.

Nothing is ever unpickled: the value is refused with one sentence or ignored, and a key the
protocol needs (leader, world, end, generation) is taken back. With real agents and a real
etcd: ``tests/integration/test_launcher_foreign_values.py``.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic.contract.records import (
    EndRecord,
    GenerationRecord,
    NodeRecord,
    RecordError,
    WorkerSlot,
)
from membership.decide import RunLimits
from membership.generation import end_run, open_run
from membership.job import RunMembership
from membership.keys import JobKeys
from tests.fakes import FakeEtcd, fake_client


class Payload:
    """Unpickling this creates ``path``: proof that someone ran the pickle."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, int]]:
        return os.open, (str(self.path), os.O_CREAT | os.O_WRONLY)


@pytest.fixture
def crafted(tmp_path: Path) -> tuple[bytes, Path]:
    marker = tmp_path / "ran"
    return pickle.dumps(Payload(marker)), marker


@pytest.fixture
def runs() -> Iterator[list[RunMembership]]:
    made: list[RunMembership] = []
    yield made
    for run in made:
        run.leave()


def record(name: str) -> NodeRecord:
    return NodeRecord(node=name, host=name, addr="127.0.0.1", agent_pid=1, store_port=5000,
                      workers=(WorkerSlot(0, 1, True, True, 0),))


def test_a_pickle_in_every_key_is_refused_or_ignored_and_the_job_keys_are_taken_back(
    crafted: tuple[bytes, Path], runs: list[RunMembership], caplog: pytest.LogCaptureFixture,
) -> None:
    pickled, marker = crafted
    etcd = FakeEtcd()
    keys = open_run(fake_client(etcd), JobKeys("/t", "job")).keys
    limits = RunLimits(min_nodes=1, max_nodes=3, last_call=0.1)
    for name in ("a", "b"):
        run = RunMembership(fake_client(etcd), keys, limits=limits, ttl=1)
        runs.append(run)
        run.join(record(name))
    a, b = runs
    assert a.wait(lambda v: (w := v.world()) is not None and len(w.members) == 2, 10)
    epoch = a.world().epoch  # type: ignore[union-attr]

    # A foreign node record: ignored (the world stays as it is).
    etcd.put(keys.node("evil"), pickled)
    # The world: refused; the leader writes a valid one over it, with a higher epoch.
    etcd.put(keys.world, pickled)
    assert a.wait(lambda v: (w := v.world()) is not None and w.epoch > epoch
                  and len(w.members) == 2, 10)
    # The leader key, on no lease: not a leader; a candidate takes the key back.
    etcd.put(keys.leader, pickled)
    deadline = time.monotonic() + 10
    while a.view.leader() not in ("a", "b"):
        assert time.monotonic() < deadline, "nobody took the leader key back"
        time.sleep(0.02)
    # The end key: refused (the run goes on); ending the run replaces it.
    etcd.put(keys.end, pickled)
    time.sleep(0.2)
    assert a.view.end() is None and b.view.end() is None
    # The generation key: a new agent refuses it in one sentence; ending the run repairs it.
    etcd.put(keys.generation_key, pickled)
    with pytest.raises(RecordError, match=r"^etcd key /t/job/generation holds a value that "
                                          r"is not JSON .*; only elastic-run may write the "
                                          r"job's keys: delete it or use another --job-id\.$"):
        open_run(fake_client(etcd), JobKeys("/t", "job"))

    assert end_run(fake_client(etcd), keys, EndRecord("finished", "done", 5))
    assert a.wait(lambda v: v.end() == EndRecord("finished", "done", 5), 10)
    kv = etcd.get(keys.generation_key)
    assert kv is not None
    assert GenerationRecord.loads(kv.value, kv.key) == GenerationRecord(1, "finished")
    assert open_run(fake_client(etcd), JobKeys("/t", "job")).keys.generation == 2

    assert not marker.exists()
    refusals = [r.getMessage() for r in caplog.records if "not JSON" in r.getMessage()]
    assert refusals and all(m.count(". ") == 0 and m.endswith("--job-id.") for m in refusals)
