"""A leader frozen past its lease (SIGSTOP) and resumed never writes a stale world.

The leader is a real process (``stale_leader.py``) on a real etcd; it stops itself at the
worst moment: its next world write decided and about to be sent. Its lease (and with it the
leader key and its node record) expires while it is frozen, another node leads, and then the
old leader is resumed and its write goes out. Two cases:

* the new leader writes a world meanwhile: the old write's compare on the world key's
  revision fails, whatever else guards it;
* the new leader has nothing to write (the change the old one was about to write is no longer
  true: the node it wanted to add left while it was frozen): the world key still has the
  revision the old write compares against, so only the leader fence (the write also compares
  the leader key's create revision, the term the writer was elected in) stops it. Without the
  fence the old leader writes a world naming a node that is gone, and every member stops
  training to build it, then again to drop it.

The other nodes are simulated agents in the test process (``test_rdzv_protocol.Sim``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic.contract.records import WorldRecord
from membership.etcd import WatchEvent
from membership.generation import open_run
from membership.keys import JobKeys
from membership.view import JobView
from tests.integration.etcd.stale_leader import LIMITS, TTL
from tests.integration.etcd.test_rdzv_protocol import Sim, client_for
from tests.integration.launcher_scripts.harness import REPO, wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("stale_leader.py")


@pytest.fixture
def keys(etcd_server: Any, etcd_prefix: str) -> JobKeys:
    return open_run(client_for(etcd_server), JobKeys(etcd_prefix, "job")).keys


class Worlds:
    """Every world written to the run, in order (a watch of the world key from the start)."""

    def __init__(self, server: Any, keys: JobKeys) -> None:
        self.keys = keys
        self.written: list[WorldRecord] = []
        self._client = client_for(server)
        self.view = JobView(client_for(server), keys)
        self._watch = client_for(server).watch_prefix(keys.world, on_change=self._record)

    def _record(self, events: Any) -> None:
        for event in events:
            assert isinstance(event, WatchEvent)
            if event.kv is not None:
                self.written.append(WorldRecord.loads(event.kv.value, event.key,
                                                      revision=event.revision))

    def wait(self, what: str, predicate: Any, timeout: float = TTL + 15.0) -> None:
        if self.view.wait(predicate, timeout):
            return
        watch = self.view.watch
        raise AssertionError(
            f"{what}: leader {self.view.leader()}, world {self.view.world()}; the view is at "
            f"revision {watch.revision} ({watch.reconnects} reconnects, failed: "
            f"{watch.failed.is_set()}), etcd at {self._client.get_many_at([self.keys.leader])}")

    def close(self) -> None:
        self._watch.cancel()
        self.view.close()


class FrozenLeader:
    """The ``stale_leader.py`` process: started, frozen by itself, resumed by the test."""

    def __init__(self, server: Any, keys: JobKeys, out: Path, *, ready: bool) -> None:
        self.out = out
        self.pause = out / "pause"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.log = open(out / "stale_leader.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), server.endpoint, keys.prefix, keys.job,
             str(keys.generation), str(out), str(self.pause), "1" if ready else "0"],
            # A session of its own: were it in the test's process group, that group turning
            # orphaned (a process of it exiting) would make the kernel SIGCONT it early.
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_until(lambda: (out / "node").exists(), 30, "the leader process to join",
                   give_up=lambda: self.proc.poll() is not None)
        self.node = (out / "node").read_text()

    def frozen(self) -> bool:
        with open(f"/proc/{self.proc.pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"

    def wait_frozen(self) -> WorldRecord:
        """Waits until it stopped itself before a world write; returns that write."""
        wait_until(self.frozen, 30, "the leader to freeze before its world write",
                   give_up=lambda: self.proc.poll() is not None)
        return WorldRecord.loads((self.out / "proposal").read_bytes(), "proposal")

    def resume(self) -> bool:
        """Resumes it; returns whether its world write was written."""
        os.kill(self.proc.pid, signal.SIGCONT)
        assert self.proc.wait(30) == 0, self.output()
        return bool(json.loads((self.out / "outcome").read_text())["written"])

    def output(self) -> str:
        return (self.out / "stale_leader.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def parts(etcd_server: Any, keys: JobKeys) -> Iterator[dict[str, Any]]:
    made: dict[str, Any] = {"sims": []}
    made["worlds"] = Worlds(etcd_server, keys)
    yield made
    if "leader" in made:
        made["leader"].stop()
    for sim in made["sims"]:
        sim.run.leave()
    made["worlds"].close()


def _epochs_rise_by_one(worlds: list[WorldRecord]) -> bool:
    return [w.epoch for w in worlds] == list(range(worlds[0].epoch,
                                                  worlds[0].epoch + len(worlds)))


def test_a_frozen_leader_resumed_after_the_next_leader_wrote_cannot_overwrite_it(
    etcd_server: Any, keys: JobKeys, parts: dict[str, Any], tmp_path: Path
) -> None:
    worlds: Worlds = parts["worlds"]
    old = parts["leader"] = FrozenLeader(etcd_server, keys, tmp_path, ready=True)
    worlds.wait("the first world", lambda v: (w := v.world()) is not None
                and w.nodes() == (old.node,) and v.leader() == old.node)
    old.pause.touch()
    new = Sim(etcd_server, keys, LIMITS, port=4001).join()
    parts["sims"].append(new)
    stale = old.wait_frozen()
    assert set(stale.nodes()) == {old.node, new.me}  # the growth it was about to write
    # Frozen past its lease: the node is gone, the new leader writes the world without it.
    worlds.wait("the new leader's world", lambda v: v.leader() == new.me
                and (w := v.world()) is not None and w.nodes() == (new.me,))
    current = worlds.view.world()
    assert not old.resume(), old.output()
    assert worlds.view.world() == current
    assert stale not in worlds.written and _epochs_rise_by_one(worlds.written), worlds.written


def test_a_frozen_leader_resumed_while_the_next_leader_had_nothing_to_write_writes_nothing(
    etcd_server: Any, keys: JobKeys, parts: dict[str, Any], tmp_path: Path
) -> None:
    worlds: Worlds = parts["worlds"]
    # The old leader's node has no ready worker: never a member, so its lease expiring
    # changes no world, and the next leader has nothing to write.
    old = parts["leader"] = FrozenLeader(etcd_server, keys, tmp_path, ready=False)
    worlds.wait("the first leader", lambda v: v.leader() == old.node)
    stays = Sim(etcd_server, keys, LIMITS, port=4001).join()
    parts["sims"].append(stays)
    worlds.wait("the first world", lambda v: (w := v.world()) is not None
                and w.nodes() == (stays.me,))
    first = worlds.view.world()
    old.pause.touch()
    leaves = Sim(etcd_server, keys, LIMITS, port=4002).join()
    stale = old.wait_frozen()
    assert set(stale.nodes()) == {stays.me, leaves.me}  # the growth it was about to write
    leaves.run.leave()  # gone before anyone wrote it in
    worlds.wait("the next leader", lambda v: v.leader() == stays.me)
    assert worlds.view.world() == first  # nothing changed for the new leader to write
    written = old.resume()
    assert not written, f"the deposed leader wrote {stale}; worlds {worlds.written}"
    assert all(leaves.me not in w.nodes() for w in worlds.written), worlds.written
    assert worlds.view.world() == first
