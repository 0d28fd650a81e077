"""An etcd compaction under a running job: the agents' watches resync and the job trains on.

etcd compacts its history (its auto-compaction, or an operator); a live watch stream is not
affected, but a stream that is re-opened from a revision older than the compaction is refused
with the compacted revision. Every agent's watches re-open an idle stream every
``WATCH_IDLE_RECONNECT`` (10 s), from the revision of the last change they saw under their
prefix: during steady training nothing under the job's keys changes, so after a compaction past
that revision each re-open is refused, and the watch must read a fresh snapshot and go on. The
test compacts etcd under a training job of two agents and checks that the compaction had no
visible effect: no watch failed, no new rendezvous round, no restarted worker, training went
on, and the job still ends cleanly through its watches (every agent sees the end).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from membership.etcd import b64
from tests.integration.launcher_scripts.harness import cluster, wait_until
from tests.support.etcd_required import etcd_binary

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(300)]

RESYNCED = "fell behind compaction; resyncing"


@pytest.fixture
def own_etcd() -> Iterator[object]:
    """An etcd of this test alone (it gets compacted)."""
    from launch.etcd_server import EmbeddedEtcd

    with EmbeddedEtcd(binary=etcd_binary()) as server:
        yield server


def _compact_everything(endpoint: str) -> int:
    """Writes a key outside the job (etcd's revision moves on, as other users' writes move
    it) and compacts the history up to now; returns the compacted revision."""
    put = requests.post(f"http://{endpoint}/v3/kv/put",
                        json={"key": b64("/elastic-test/other"), "value": b64("x")},
                        timeout=10)
    put.raise_for_status()
    revision = int(put.json()["header"]["revision"])
    compact = requests.post(f"http://{endpoint}/v3/kv/compaction",
                            json={"revision": str(revision), "physical": True}, timeout=10)
    compact.raise_for_status()
    return revision


def test_a_compaction_under_a_training_job_has_no_visible_effect(
    tmp_path: Path, own_etcd: object
) -> None:
    endpoint = own_etcd.endpoint  # type: ignore[attr-defined]
    stop = tmp_path / "stop"
    with cluster(tmp_path, endpoint, f"compact-{uuid.uuid4().hex[:8]}") as c:
        wargs = c.worker_args("--stop-file", str(stop), steps=100_000)
        agents = [c.start_elastic("--nnodes", "2", "--max-restarts", "0", worker_args=wargs)
                  for _ in range(2)]
        c.wait_for(lambda st: sum(s.world == 2 for s in st) >= 10, 90, "steps in a world of 2")
        before = c.steps()
        rounds, pids = {s.round for s in before}, {s.pid for s in before}
        # Once per agent (the other writes move the revision past its watches' too).
        _compact_everything(endpoint)
        _compact_everything(endpoint)
        # Each agent's watches re-open their idle streams within 10 s and find the compaction.
        wait_until(lambda: all(RESYNCED in a.output() for a in agents), 40,
                   "every agent's watch to resync after the compaction",
                   give_up=c.all_exited)
        n = len(c.steps())
        c.wait_for(lambda st: len(st) >= n + 20, 60, "training to go on after the resync")
        stop.touch()
        assert [a.wait(60) for a in agents] == [0, 0], c.logs()
        after = c.steps()
        assert {s.round for s in after} == rounds, c.logs()
        assert {s.pid for s in after} == pids, c.logs()
        for agent in agents:
            assert "could not be watched" not in agent.output(), c.logs()
