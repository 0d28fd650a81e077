"""Push-style failure detection: every node holds a member key on a short etcd lease.

Keys: ``{key_prefix}/{run_id}/members/{round}/{group_rank}`` holding a JSON :class:`MemberInfo`,
attached to the node's own lease (TTL ``member_ttl``, refreshed by a daemon thread). When a node
dies its lease expires on etcd's clock (no wall-clock comparison between nodes) and etcd deletes
the key; every surviving agent's registry follows the job's member keys with one supervised
watch, so it learns of the loss by push and reports it from memory. The agent then starts a new
round at once instead of waiting for torch's heartbeat timeout or a collective timeout.

A node that leaves on purpose revokes its lease, so the others see it go at once. A node that
has been told it will be preempted first rewrites its member key with a ``departing`` note
(:meth:`MembershipRegistry.announce_departure`), so the others can tell a planned departure from
a failure before the lease is gone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any, Final

from elastic.errors import ConfigError
from elastic.etcd import EtcdClient, KeyValue, Lease, PrefixWatch, WatchEvent

logger = logging.getLogger(__name__)

_MIN_TTL: Final = 1  # etcd itself raises TTLs below its minimum (about 2 s)


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What a node publishes about itself for one round."""

    group_rank: int
    """The node's rank in the round (its member key's last component)."""
    world_size: int
    """Number of nodes the round was formed with."""
    host: str
    pid: int
    """PID of the node's agent."""
    started_at: float
    """Wall-clock seconds since the epoch when the node joined the round."""
    local_world_size: int = 0
    """Worker processes on the node (0 when unknown)."""
    departing: dict[str, Any] | None = None
    """Set when the node announced a planned departure (the notice's source and deadline)."""

    def age(self, now: float | None = None) -> float:
        """Seconds since the node joined the round."""
        return max(0.0, (time.time() if now is None else now) - self.started_at)


def members_prefix(key_prefix: str, run_id: str) -> str:
    """The prefix under which a job's member keys live."""
    return f"{key_prefix.rstrip('/')}/{run_id}/members/"


def finished_key(key_prefix: str, run_id: str) -> str:
    """The key a job's agents write once its workers have finished (no lease: it stays)."""
    return f"{key_prefix.rstrip('/')}/{run_id}/finished"


def _parse_key(prefix: str, key: str) -> tuple[int, int] | None:
    parts = key[len(prefix):].split("/")
    if len(parts) != 2:
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


def _is_departing(value: bytes) -> bool:
    try:
        note = json.loads(value)
    except ValueError:
        return False
    return isinstance(note, dict) and bool(note.get("departing"))


class MembershipRegistry:
    """Registers this node for a round and tracks which members of the round are gone.

    Thread-safe; :meth:`lost_members` answers from memory (no etcd round trip), so the agent
    may call it in every monitor interval.

    Args:
        client: the etcd client.
        run_id: the job id.
        key_prefix: prefix of every key of elastic-run.
        member_ttl: seconds of silence after which etcd drops a member.
        on_change: called (from a watch thread, must not block) with the lost group ranks
            whenever that set changes.

    Raises:
        ConfigError: for a ``member_ttl`` below 2.
    """

    def __init__(
        self, client: EtcdClient, run_id: str, *, key_prefix: str = "/elastic",
        member_ttl: int = 3, on_change: Callable[[frozenset[int]], None] | None = None,
    ) -> None:
        if member_ttl < _MIN_TTL:
            raise ConfigError(
                f"--rdzv-conf member_ttl ({member_ttl}) must be at least {_MIN_TTL} seconds."
            )
        self._client = client
        self._prefix = members_prefix(key_prefix, run_id)
        self._finished_key = finished_key(key_prefix, run_id)
        self._ttl = member_ttl
        self._on_change = on_change
        self._lease: Lease | None = None
        self._watch: PrefixWatch | None = None
        self._lock = threading.Lock()
        self._round = -1
        self._rank = -1
        self._world = 0
        self._seen: set[int] = set()
        self._lost: frozenset[int] = frozenset()
        self._departing: frozenset[int] = frozenset()
        self._key: str | None = None
        self._info: MemberInfo | None = None
        self._closed = False
        self.changed = threading.Event()
        """Set whenever the lost set changes or this node's own lease is lost."""

    def __repr__(self) -> str:
        return f"MembershipRegistry(prefix={self._prefix!r}, round={self._round})"

    @property
    def client(self) -> EtcdClient:
        """The etcd client (the agent also uses it for in-place member keys)."""
        return self._client

    @property
    def round(self) -> int:
        """The round this node last registered for (-1 before the first)."""
        return self._round

    @property
    def member_ttl(self) -> int:
        """TTL in seconds of this node's member lease."""
        return self._ttl

    def register(
        self, round_: int, group_rank: int, world_size: int, *, local_world_size: int = 0
    ) -> None:
        """Publishes this node as a member of ``round_`` and follows the round's members.

        Raises:
            EtcdUnavailableError: when etcd cannot be reached within the deadline.
        """
        with self._lock:
            self._closed = False
            if self._lease is None or self._lease.lost.is_set():
                self._lease = self._client.lease(self._ttl, on_lost=self._on_lease_lost)
            lease = self._lease
        info = MemberInfo(group_rank, world_size, socket.gethostname(), os.getpid(),
                          time.time(), local_world_size)
        key = f"{self._prefix}{round_}/{group_rank}"
        self._client.put(key, json.dumps(asdict(info)).encode(), lease=lease.id)
        old_key, self._key, self._info = self._key, key, info
        if old_key is not None and old_key != key:
            self._client.delete(old_key)  # the old round is over; keep one key per node
        with self._lock:
            self._round, self._rank, self._world = round_, group_rank, world_size
            self._seen, self._lost, self._departing = {group_rank}, frozenset(), frozenset()
            if self._watch is None or self._watch.failed.is_set():
                if self._watch is not None:
                    self._watch.cancel()
                self._watch = self._client.watch_prefix(self._prefix, on_change=self._on_events)
            watch = self._watch
        self._recompute(watch.items())
        logger.info("registered as member %d of round %d (%d nodes, lease %x, ttl %d s)",
                    group_rank, round_, world_size, lease.id, self._ttl)

    def _on_lease_lost(self, lease: Lease) -> None:
        logger.warning("this node's member lease %x was lost; it must rejoin", lease.id)
        self.changed.set()

    def _on_events(self, events: Sequence[WatchEvent]) -> None:
        watch = self._watch
        if watch is not None:
            self._recompute(watch.items())

    def _recompute(self, items: Mapping[str, KeyValue]) -> None:
        parsed = [(p, kv) for p, kv in ((_parse_key(self._prefix, k), kv)
                                        for k, kv in items.items()) if p is not None]
        with self._lock:
            if self._closed:
                return
            present = {rank for (round_, rank), _ in parsed if round_ == self._round}
            self._seen |= present
            # Sticky like _seen: the note stays known after the departed node's key is gone.
            departing = self._departing | {
                rank for (round_, rank), kv in parsed
                if round_ == self._round and rank != self._rank and _is_departing(kv.value)
            }
            # This node's own key counts through its lease (own_lease_lost), never the mirror,
            # which may not have caught up with the key it just wrote.
            lost = frozenset(r for r in self._seen
                             if r not in present and r < self._world and r != self._rank)
            if lost == self._lost and departing == self._departing:
                return
            newly_lost = lost - self._lost
            self._departing = frozenset(departing)
            self._lost = lost
            round_ = self._round
        if newly_lost - departing:
            logger.warning("member(s) %s of round %d lost their etcd lease",
                           sorted(newly_lost - departing), round_)
        if newly_lost & departing:
            logger.info("member(s) %s of round %d left as announced",
                        sorted(newly_lost & departing), round_)
        self.changed.set()
        if self._on_change is not None:
            try:
                self._on_change(lost)
            except Exception:
                logger.exception("membership change callback failed")

    def lost_members(self) -> frozenset[int]:
        """Group ranks of the current round whose member key has vanished (from memory)."""
        with self._lock:
            return self._lost

    def departing_members(self) -> frozenset[int]:
        """Group ranks of the current round that announced a planned departure (from memory).

        A rank stays in this set after its key is gone (it is then in :meth:`lost_members` too).
        """
        with self._lock:
            return self._departing

    def announce_departure(self, note: Mapping[str, Any]) -> bool:
        """Marks this node's member key as departing (same key, same lease), for the others.

        Call it before the node stops its workers, so the peers whose workers fail next know
        the cause. Returns False when the node holds no member key (nothing to announce).

        Raises:
            EtcdUnavailableError: when etcd cannot be reached within the deadline.
        """
        with self._lock:
            key, info, lease = self._key, self._info, self._lease
        if key is None or info is None or lease is None or lease.lost.is_set():
            return False
        marked = replace(info, departing=dict(note))
        self._client.put(key, json.dumps(asdict(marked)).encode(), lease=lease.id)
        logger.info("announced a planned departure from round %d (%s)", self._round, dict(note))
        return True

    def own_lease_lost(self) -> bool:
        """Whether etcd dropped this node's own member lease (the others count it as lost)."""
        lease = self._lease
        return lease is not None and lease.lost.is_set()

    def membership_changed(self) -> bool:
        """Whether the current round lost a member, this node included (from memory)."""
        return bool(self.lost_members()) or self.own_lease_lost()

    def wait_for_change(self, timeout: timedelta) -> bool:
        """Waits until the lost set changes; returns whether it did within ``timeout``."""
        changed = self.changed.wait(timeout.total_seconds())
        self.changed.clear()
        return changed

    def mark_finished(self, note: Mapping[str, Any]) -> None:
        """Records in etcd that the job's workers finished (a late node then exits cleanly)."""
        self._client.put(self._finished_key, json.dumps(dict(note)).encode())

    def finished(self) -> dict[str, Any] | None:
        """What :meth:`mark_finished` recorded, or ``None`` if the job has not finished."""
        kv = self._client.get(self._finished_key)
        return None if kv is None else dict(json.loads(kv.value))

    def close(self) -> None:
        """Leaves explicitly: revokes the lease so the others see this node go at once."""
        with self._lock:
            self._closed = True
            watch, self._watch = self._watch, None
            lease, self._lease = self._lease, None
            self._key = self._info = None
        if watch is not None:
            watch.cancel()
        if lease is not None:
            lease.revoke()


@dataclass(frozen=True, slots=True)
class JobStatus:
    """A job's membership as an operator sees it."""

    round: int
    """The newest round that has a live member."""
    world_size: int
    """Live members of that round."""
    members: list[MemberInfo]
    """The live members, by group rank."""
    expected_size: int = 0
    """Nodes the round was formed with (more than ``world_size`` while a loss is pending)."""
    read_at: float = field(default_factory=time.time)
    """Wall-clock time of the read (for member ages)."""


def read_job_status(
    client: EtcdClient, run_id: str, *, key_prefix: str = "/elastic"
) -> JobStatus | None:
    """Reads the newest round's live members of job ``run_id``.

    Args:
        client: the etcd client.
        run_id: the job id.
        key_prefix: prefix of every key of elastic-run.

    Returns:
        The status, or ``None`` when the job has no live member.

    Raises:
        EtcdUnavailableError: when etcd cannot be reached within the deadline.
    """
    prefix = members_prefix(key_prefix, run_id)
    by_round: dict[int, list[MemberInfo]] = {}
    for kv in client.get_prefix(prefix):
        parsed = _parse_key(prefix, kv.key)
        if parsed is None:
            continue
        try:
            info = MemberInfo(**json.loads(kv.value))
        except (ValueError, TypeError):
            logger.warning("ignoring the unreadable member key %s", kv.key)
            continue
        by_round.setdefault(parsed[0], []).append(info)
    if not by_round:
        return None
    newest = max(by_round)
    members = sorted(by_round[newest], key=lambda m: m.group_rank)
    return JobStatus(round=newest, world_size=len(members), members=members,
                     expected_size=max(m.world_size for m in members))
