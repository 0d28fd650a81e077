"""Push-style failure detection: every node holds a member key on a short etcd lease.

Keys: ``{key_prefix}/{run_id}/members/{round}/{group_rank}`` holding a JSON :class:`MemberInfo`,
attached to the node's own lease (TTL ``member_ttl``, refreshed by a daemon thread). When a node
dies its lease expires on etcd's clock and the key disappears; every surviving agent's
registry notices within one poll and reports the member as lost, so the agent starts a new
round at once instead of waiting for torch's heartbeat timeout or a collective timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Final

from elastic.etcd import EtcdClient, Lease

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.25


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What a node publishes about itself for one round."""

    group_rank: int
    world_size: int
    host: str
    pid: int
    started_at: float
    """Wall-clock seconds since the epoch when the node joined the round."""


def members_prefix(key_prefix: str, run_id: str) -> str:
    """The prefix under which a job's member keys live."""
    return f"{key_prefix.rstrip('/')}/{run_id}/members/"


class MembershipRegistry:
    """Registers this node for a round and tracks which members of the round are gone.

    Args:
        client: the etcd client.
        run_id: the job id.
        key_prefix: prefix of every key of elastic-run.
        member_ttl: seconds of silence after which etcd drops a member.
    """

    def __init__(
        self, client: EtcdClient, run_id: str, *, key_prefix: str = "/elastic",
        member_ttl: int = 3,
    ) -> None:
        self._client = client
        self._prefix = members_prefix(key_prefix, run_id)
        self._ttl = member_ttl
        self._lease: Lease | None = None
        self._lock = threading.Lock()
        self._round = -1
        self._world = 0
        self._seen: set[int] = set()
        self._lost: frozenset[int] = frozenset()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._key: str | None = None

    @property
    def round(self) -> int:
        """The round this node last registered for (-1 before the first)."""
        return self._round

    def register(self, round_: int, group_rank: int, world_size: int) -> None:
        """Publishes this node as a member of ``round_`` and starts watching the round."""
        if self._lease is None or self._lease.lost.is_set():
            self._lease = Lease(self._client, self._ttl)
        info = MemberInfo(group_rank, world_size, socket.gethostname(), os.getpid(), time.time())
        key = f"{self._prefix}{round_}/{group_rank}"
        self._client.put(key, json.dumps(asdict(info)).encode(), lease=self._lease.id)
        if self._key is not None and self._key != key:
            self._client.delete(self._key)  # the old round is over; keep one key per node
        self._key = key
        with self._lock:
            self._round, self._world = round_, world_size
            self._seen, self._lost = {group_rank}, frozenset()
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="elastic-membership",
                                            daemon=True)
            self._thread.start()

    def lost_members(self) -> frozenset[int]:
        """Group ranks of the current round whose member key has vanished (from memory)."""
        with self._lock:
            return self._lost

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_S):
            with self._lock:
                round_, world = self._round, self._world
            try:
                present = {
                    int(kv.key.rsplit("/", 1)[1])
                    for kv in self._client.get_prefix(f"{self._prefix}{round_}/")
                }
            except Exception:  # etcd unreachable: the rendezvous itself will report it
                logger.debug("membership poll failed", exc_info=True)
                continue
            with self._lock:
                if round_ != self._round:
                    continue
                self._seen |= present
                lost = frozenset(r for r in self._seen if r not in present and r < world)
                if lost and lost != self._lost:
                    logger.warning("members %s of round %d lost their etcd lease",
                                   sorted(lost), round_)
                self._lost = lost

    def close(self) -> None:
        """Leaves explicitly: revokes the lease so the others see this node go at once."""
        self._stop.set()
        if self._lease is not None:
            self._lease.revoke()


@dataclass(frozen=True, slots=True)
class JobStatus:
    """A job's membership as an operator sees it."""

    round: int
    world_size: int
    members: list[MemberInfo]


def read_job_status(
    client: EtcdClient, run_id: str, *, key_prefix: str = "/elastic"
) -> JobStatus | None:
    """Reads the newest round's live members of job ``run_id`` (``None``: no live member)."""
    by_round: dict[int, list[MemberInfo]] = {}
    for kv in client.get_prefix(members_prefix(key_prefix, run_id)):
        round_text = kv.key.rsplit("/", 2)[1]
        by_round.setdefault(int(round_text), []).append(MemberInfo(**json.loads(kv.value)))
    if not by_round:
        return None
    newest = max(by_round)
    members = sorted(by_round[newest], key=lambda m: m.group_rank)
    return JobStatus(round=newest, world_size=len(members), members=members)
