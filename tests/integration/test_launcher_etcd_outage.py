"""Acceptance 4 (launcher side): etcd restarts are ridden out; a long outage stops the job."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.launcher_scripts.harness import FAST_RDZV_CONF, cluster, wait_until
from tests.support.etcd_required import etcd_binary

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[object]:
    """An etcd of this test alone (it gets killed), with a data dir that survives restarts."""
    from launch.etcd_server import EmbeddedEtcd

    server = EmbeddedEtcd(binary=etcd_binary(), data_dir=str(tmp_path / "etcd-data"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_training_goes_on_when_etcd_is_killed_and_restarted(
    tmp_path: Path, own_etcd: object
) -> None:
    server = own_etcd
    stop = tmp_path / "stop"
    with cluster(tmp_path, server.endpoint, f"outage-{uuid.uuid4().hex[:8]}") as c:  # type: ignore[attr-defined]
        wargs = c.worker_args("--stop-file", str(stop), steps=100_000)
        agents = [c.start_elastic("--nnodes", "2", "--max-restarts", "0", worker_args=wargs)
                  for _ in range(2)]
        c.wait_for(lambda st: any(s.world == 2 for s in st), 90, "a world of 2")
        server.kill()  # type: ignore[attr-defined]
        time.sleep(2)
        server.restart()  # type: ignore[attr-defined]
        n = len(c.steps())
        c.wait_for(lambda st: len(st) >= n + 20, 60, "training to go on after the restart")
        stop.touch()
        assert [a.wait(60) for a in agents] == [0, 0], c.logs()


def test_etcd_down_past_the_deadline_stops_the_job_naming_the_endpoints(
    tmp_path: Path, own_etcd: object
) -> None:
    server = own_etcd
    endpoint = server.endpoint  # type: ignore[attr-defined]
    with cluster(tmp_path, endpoint, f"outage-{uuid.uuid4().hex[:8]}") as c:
        wargs = c.worker_args(steps=100_000)
        # A 10 s etcd deadline (30 s by default) keeps the test short: what it proves holds
        # for any deadline.
        agents = [c.start_elastic("--nnodes", "1:2", "--max-restarts", "0", "--rdzv-conf",
                                  f"{FAST_RDZV_CONF},deadline=10", worker_args=wargs)
                  for _ in range(2)]
        c.wait_for(lambda st: any(s.world == 2 for s in st), 90, "a world of 2")
        server.kill()  # type: ignore[attr-defined]
        codes = [a.wait(60) for a in agents]
        assert all(code == 3 for code in codes), c.logs()
        for agent in agents:
            assert endpoint in agent.output().split("elastic-run: error:")[-1], c.logs()


def test_an_inplace_job_whose_workers_train_on_stops_too_past_the_deadline(
    tmp_path: Path, own_etcd: object
) -> None:
    # A node that loses etcd for the deadline tells an outage from a cut by its workers: these
    # trained on through the outage (their collectives need no etcd), so etcd is gone for the
    # whole job (exit 3), not this node cut off from it (it would keep trying to rejoin).
    from tests.integration.training.inplace_audit import read_audit
    from tests.support.netns_job import inplace_worker_args

    server = own_etcd
    endpoint = server.endpoint  # type: ignore[attr-defined]
    root = tmp_path / "job"
    with cluster(tmp_path, endpoint, f"outage-{uuid.uuid4().hex[:8]}") as c:
        wargs = inplace_worker_args(root, steps=100_000, step_time=0.05)
        # A 10 s etcd deadline (30 s by default) keeps the test short; what it proves holds
        # for any deadline longer than two lease TTLs.
        agents = [c.start_elastic("--nnodes", "1:2", "--rdzv-conf",
                                  f"{FAST_RDZV_CONF},deadline=10", worker_args=wargs)
                  for _ in range(2)]

        def trained_in_a_world_of_2() -> bool:
            audit = read_audit(root / "audit")
            sizes = {int(g["gen"]): int(g["world"]) for g in audit.gens}
            return sum(sizes.get(int(d["gen"])) == 2 for d in audit.done) >= 10

        wait_until(trained_in_a_world_of_2, 90, "steps in a world of 2",
                   give_up=c.all_exited)
        server.kill()  # type: ignore[attr-defined]
        killed_at = time.time()
        codes = [a.wait(90) for a in agents]
        assert all(code == 3 for code in codes), c.logs()
        for agent in agents:
            assert endpoint in agent.output().split("elastic-run: error:")[-1], c.logs()
            assert "cut off from the job" not in agent.output(), c.logs()
        late = [d for d in read_audit(root / "audit").done if float(d["t"]) > killed_at + 8]
        assert late, "the workers did not train on through the outage"


def test_a_three_member_etcd_cluster_loses_a_member_with_no_visible_effect(
    tmp_path: Path,
) -> None:
    from launch.etcd_server import EmbeddedEtcdCluster

    binary = etcd_binary()
    stop = tmp_path / "stop"
    with EmbeddedEtcdCluster(3, binary=binary) as etcd, \
            cluster(tmp_path, etcd.endpoints, f"quorum-{uuid.uuid4().hex[:8]}") as c:
        wargs = c.worker_args("--stop-file", str(stop), steps=100_000)
        agents = [c.start_elastic("--nnodes", "2", "--max-restarts", "0", worker_args=wargs)
                  for _ in range(2)]
        c.wait_for(lambda st: any(s.world == 2 for s in st), 90, "a world of 2")
        before = c.steps()
        rounds, pids = {s.round for s in before}, {s.pid for s in before}
        # The first endpoint is where every client starts: losing it forces the rotation.
        etcd.members[0].kill()
        n = len(before)
        c.wait_for(lambda st: len(st) >= n + 30, 60, "training to go on without member m0")
        stop.touch()
        assert [a.wait(60) for a in agents] == [0, 0], c.logs()
        after = c.steps()
        # No visible effect: no new rendezvous round, no restarted worker, nothing logged as lost.
        assert {s.round for s in after} == rounds, c.logs()
        assert {s.pid for s in after} == pids, c.logs()
        assert all(s.world == 2 for s in after), c.logs()
