"""Worker-level quorum on etcd: who trains now, agreed by compare-and-swap.

Keys of a job (``base = {key_prefix}/{run_id}/inplace/``)::

    {base}members/{host}-{agent_pid}-{pid}   JSON {host, pid, started_at, probe_port, ready},
                                             on the worker's own lease (TTL ``ttl``, kept
                                             alive by a daemon thread): the worker is alive;
                                             ``ready: false`` while a joiner is still building
                                             its model (it is not a member yet)
    {base}world                              JSON {epoch, members}: the current world; rank =
                                             index in ``members``
    {base}done                               JSON {step}: training finished (waiting spares exit)
    {key_prefix}/{run_id}/inplace-store/     the etcd Store the process groups rendezvous on,
                                             one ``e{epoch}/`` sub-prefix per world

Why these choices:

* A member key per *worker* (not per node): a killed worker's key is deleted by its agent at
  once (``launch.agent``), so survivors learn of the loss in about one agent monitor interval
  instead of one lease TTL; a lost node's keys are deleted by a survivor that finds their
  liveness ports closed (:mod:`~elastic.inplace.liveness`), or vanish when their leases expire
  (``ttl``) if the host went silent.
* The world key is written only by compare-and-swap on its mod revision (etcd's Raft log is
  the fencing token): two workers that propose different worlds for the same next epoch
  cannot both win; the loser adopts the winner's world. No worker is a coordinator.
* Member order is join order (the key's create revision), so survivors come first and the
  newest joiners are the ones left out when the world must be truncated to a size that
  divides the global batch (they wait as spares).
* One prefix watch keeps the members and the world in memory, so the check at every step
  boundary costs no etcd round trip.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from elastic.errors import ConfigError
from elastic.etcd import EtcdClient, KeyValue, Lease, PrefixWatch

__all__ = ["WorkerQuorum", "WorldView", "inplace_prefix", "member_id", "node_member_prefix"]

logger = logging.getLogger(__name__)

_MEMBERS: Final = "members/"
_WORLD: Final = "world"
_DONE: Final = "done"


def inplace_prefix(key_prefix: str, run_id: str) -> str:
    """The etcd prefix of a job's in-place keys (ends with ``/``)."""
    return f"{key_prefix.rstrip('/')}/{run_id}/inplace/"


def store_prefix(key_prefix: str, run_id: str) -> str:
    """The etcd prefix of the store the in-place process groups rendezvous on."""
    return f"{key_prefix.rstrip('/')}/{run_id}/inplace-store/"


def member_id(agent_pid: int, pid: int | None = None, host: str | None = None) -> str:
    """The member id of a worker: ``{host}-{agent_pid}-{pid}``."""
    return f"{host or socket.gethostname()}-{agent_pid}-{os.getpid() if pid is None else pid}"


def node_member_prefix(key_prefix: str, run_id: str, agent_pid: int,
                       host: str | None = None) -> str:
    """The prefix of every member key of one agent's workers (what the agent deletes)."""
    return (f"{inplace_prefix(key_prefix, run_id)}{_MEMBERS}"
            f"{host or socket.gethostname()}-{agent_pid}-")


def _is_ready(kv: KeyValue) -> bool:
    """Whether a member key's worker can be admitted (``ready`` absent means it can)."""
    try:
        return json.loads(kv.value).get("ready", True) is not False
    except (ValueError, AttributeError):
        return True  # not ours to judge: count it, as before readiness existed


@dataclass(frozen=True, slots=True)
class WorldView:
    """One agreed world.

    Attributes:
        epoch: Increases by one with every new world.
        members: Member ids; a worker's rank is its index.
        revision: Mod revision of the world key (the CAS token); 0 when there is none yet.
    """

    epoch: int
    members: tuple[str, ...]
    revision: int

    @classmethod
    def parse(cls, kv: KeyValue | None) -> WorldView | None:
        """Decodes the world key (``None`` when it does not exist)."""
        if kv is None:
            return None
        data = json.loads(kv.value)
        return cls(int(data["epoch"]), tuple(str(m) for m in data["members"]), kv.mod_revision)


class WorkerQuorum:
    """This worker's membership and its view of the job's world.

    Args:
        client: The etcd client.
        key_prefix: elastic-run's key prefix (``--rdzv-conf key_prefix``, default ``/elastic``).
        run_id: The job id.
        me: This worker's member id (:func:`member_id`).
        ttl: Seconds a dead worker's key outlives it when nobody deletes it (node loss).

    Raises:
        ConfigError: If ``ttl`` is below 1.
    """

    def __init__(self, client: EtcdClient, *, key_prefix: str, run_id: str, me: str,
                 ttl: int) -> None:
        if ttl < 1:
            raise ConfigError(f"in-place member ttl ({ttl}) must be at least 1 second.")
        self.client = client
        self.me = me
        self.ttl = ttl
        self.base = inplace_prefix(key_prefix, run_id)
        self.store_prefix = store_prefix(key_prefix, run_id)
        self._lease: Lease | None = None
        self._watch: PrefixWatch | None = None
        self._info: dict[str, Any] = {}
        self._leaving = False
        #: (watch revision, live members at it): the step-boundary check parses the member
        #: keys only when the mirror changed, not at every step.
        self._live_cache: tuple[int, tuple[str, ...]] | None = None

    # -- membership -------------------------------------------------------------------------

    def join(self, info: Mapping[str, Any]) -> None:
        """Publishes this worker's member key on its own lease and starts the watch."""
        self._info = dict(info)
        self._register()
        self._watch = self.client.watch_prefix(self.base)

    def _register(self) -> None:
        self._lease = self.client.lease(self.ttl, on_lost=self._on_lease_lost)
        self.client.put(self.base + _MEMBERS + self.me, json.dumps(self._info).encode(),
                        lease=self._lease.id)

    def _on_lease_lost(self, lease: Lease) -> None:
        # Our lease expired while this process was alive (a stall longer than the TTL): the
        # others have dropped us from the world. Register again: we rejoin as a newcomer at
        # the next step boundary and are healed like one.
        if self._leaving or lease is not self._lease:
            return
        logger.warning("this worker's member lease expired; registering again")
        try:
            self._register()
        except Exception:
            logger.exception("registering again after losing the member lease failed")

    def member_info(self, member: str) -> dict[str, Any] | None:
        """The JSON a live member published when it joined (from the watch mirror)."""
        kv = self.watch.items().get(self.base + _MEMBERS + member)
        return None if kv is None else dict(json.loads(kv.value))

    def remove(self, member: str) -> None:
        """Deletes another member's key: for a worker known to be dead (its lease still runs)."""
        self.client.delete(self.base + _MEMBERS + member)

    def registered(self) -> bool:
        """Whether this worker's member key exists (from the watch mirror)."""
        return self.base + _MEMBERS + self.me in self.watch.items()

    def leave(self) -> None:
        """Revokes the lease (the member key goes at once) and stops the watch."""
        self._leaving = True
        if self._lease is not None:
            self._lease.revoke()
            self._lease = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    @property
    def watch(self) -> PrefixWatch:
        """The prefix watch (after :meth:`join`)."""
        if self._watch is None:
            raise RuntimeError("WorkerQuorum.join() must be called first")
        return self._watch

    def set_ready(self) -> None:
        """Marks this worker ready to be admitted (a joiner that reached its training loop)."""
        if self._info.get("ready") is not False:
            return
        self._info["ready"] = True
        assert self._lease is not None
        self.client.put(self.base + _MEMBERS + self.me, json.dumps(self._info).encode(),
                        lease=self._lease.id)

    def _members_of(self, items: Mapping[str, KeyValue]) -> tuple[str, ...]:
        prefix = self.base + _MEMBERS
        found = [kv for key, kv in items.items()
                 if key.startswith(prefix) and _is_ready(kv)]
        found.sort(key=lambda kv: kv.create_revision)
        return tuple(kv.key[len(prefix):] for kv in found)

    def live_members(self, *, fresh: bool = False) -> tuple[str, ...]:
        """Live, ready member ids in join order; ``fresh`` reads etcd, not the watch mirror."""
        if fresh:
            return self._members_of({kv.key: kv for kv in self.client.get_prefix(self.base)})
        watch = self.watch
        revision = watch.revision  # before the items: a cached answer is never staler
        cached = self._live_cache
        if cached is not None and cached[0] == revision:
            return cached[1]
        members = self._members_of(watch.items())
        self._live_cache = (revision, members)
        return members

    def world(self, *, fresh: bool = False) -> WorldView | None:
        """The current world (from the watch mirror unless ``fresh``)."""
        if fresh:
            return WorldView.parse(self.client.get(self.base + _WORLD))
        return WorldView.parse(self.watch.items().get(self.base + _WORLD))

    def done(self) -> int | None:
        """The final step when the job has finished, else ``None`` (from the mirror)."""
        kv = self.watch.items().get(self.base + _DONE)
        return None if kv is None else int(json.loads(kv.value)["step"])

    def mark_done(self, step: int) -> None:
        """Records that training finished at ``step`` (waiting spares then exit)."""
        self.client.put(self.base + _DONE, json.dumps({"step": step}).encode())

    # -- agreement --------------------------------------------------------------------------

    def propose(self, current: WorldView | None, members: tuple[str, ...]) -> WorldView:
        """Writes world ``current.epoch + 1`` with ``members`` unless someone else was first.

        Returns:
            The world that won: ours, or the one written since ``current`` was read.
        """
        epoch = (current.epoch if current else 0) + 1
        value = json.dumps({"epoch": epoch, "members": list(members)}).encode()
        written, after = self.client.cas(self.base + _WORLD, value,
                                         current.revision if current else None)
        won = WorldView.parse(after)
        assert won is not None  # the key exists after a CAS, whoever wrote it
        logger.info("in-place world epoch %d %s: %s", won.epoch,
                    "proposed" if written else "adopted", ",".join(won.members))
        return won

    def wait_until(self, predicate: Any, timeout: float) -> bool:
        """Waits until ``predicate(self)`` holds, woken by the watch; returns whether it did."""
        deadline = time.monotonic() + timeout
        watch = self.watch
        while True:
            if predicate(self):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            seen = watch.revision
            watch.wait_for(lambda _m, seen=seen: watch.revision != seen,  # type: ignore[misc]
                           timedelta(seconds=min(left, 1.0)))
