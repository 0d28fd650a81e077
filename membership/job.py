"""One agent's part in the membership protocol: its node, its view of the run, the leader loop.

:class:`RunMembership` is what the node agent (and the torchrun plugin handler) use; it
hides how the pieces are wired. See the package docstring for the protocol.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import logging
import secrets
import socket
import struct
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any, Final

from elastic.contract.records import EndRecord, NodeRecord, WorldRecord
from elastic_errors import ConfigError
from membership.decide import RunLimits
from membership.etcd import EtcdClient
from membership.generation import DEFAULT_LINGER_S, end_run
from membership.keys import JobKeys
from membership.leader import LeaderLoop
from membership.node import NodeMembership
from membership.view import JobView

__all__ = ["RunMembership", "interface_of", "new_node_id", "registered_address"]

logger = logging.getLogger(__name__)

#: How often a node checks that its record still holds what it wrote.
RECORD_CHECK_S: Final = 5.0


def new_node_id(host: str | None = None) -> str:
    """A node id unique per agent incarnation: ``{host}-{8 random hex}``.

    Unique even when pods share a host name and a PID layout, and different after a restart
    of the same agent, so an old incarnation's record can never be mistaken for the new one.
    """
    name = (host or socket.gethostname()).replace("/", "_") or "node"
    return f"{name}-{secrets.token_hex(4)}"


def registered_address(local_addr: str | None, endpoint: str) -> str:
    """The address peers dial to reach this node.

    ``--local-addr`` when given; otherwise the address of the interface this host uses to
    reach etcd (a UDP ``connect`` sends nothing, it only picks the route), which is the
    address the other nodes can reach too. ``gethostname()`` is never used: from another
    pod or host that name usually does not resolve.

    Raises:
        ConfigError: If neither gives an address.
    """
    if local_addr:
        return local_addr
    first = endpoint.split(",")[0].strip()
    parsed = urllib.parse.urlsplit(first if "://" in first else f"http://{first}")
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 2379
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ConfigError(
            f"could not find the address that reaches etcd ({first}: {exc}); pass "
            "--local-addr with this node's address."
        ) from exc


_SIOCGIFCONF = 0x8912
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: a 16-byte name and a 24-byte union
_MAX_IPV4_ADDRESSES = 1024


def _ipv4_interfaces() -> dict[str, str]:
    """Every IPv4 address of this host's network namespace -> its interface name (Linux).

    ``SIOCGIFCONF`` lists every configured address, secondary ones too (under their label,
    e.g. ``eth0:1``, which is what gloo's and NCCL's interface lookups match).
    """
    buffer = array.array("B", bytes(_IFREQ_SIZE * _MAX_IPV4_ADDRESSES))
    address, _ = buffer.buffer_info()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("iL", len(buffer), address)
        used = struct.unpack("iL", fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, request))[0]
    raw = buffer.tobytes()[:used]
    found = {}
    for offset in range(0, used, _IFREQ_SIZE):
        name = raw[offset:offset + 16].split(b"\0", 1)[0].decode(errors="replace")
        found[socket.inet_ntoa(raw[offset + 20:offset + 24])] = name
    return found


def _ipv6_interfaces() -> dict[str, str]:
    """Every IPv6 address of this host's network namespace -> its interface name (Linux)."""
    found = {}
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6:
                    found[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    except (OSError, ValueError):
        return {}
    return found


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (``None``: none
    does, e.g. an address behind NAT, or a system without the Linux interfaces).

    Libraries that pick their own interface (gloo from the hostname, NCCL by its own rules)
    are told this one, so that every connection a peer dials goes to the registered address.
    """
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return None
    try:
        table = _ipv6_interfaces() if parsed.version == 6 else _ipv4_interfaces()
    except OSError:
        return None
    return table.get(str(parsed))


class RunMembership:
    """Joins one run as one node and follows its worlds.

    Args:
        client: The etcd client.
        keys: The run's keys (from :func:`~membership.generation.open_run`).
        limits: Node counts and settle time.
        ttl: The node lease TTL (how long a silent node stays a member).
        linger: Seconds the run's end record stays for nodes that come late (0: a short
            while, for ``elastic-run status``).
        on_change: Called (from a watch thread, must not block) whenever the control keys
            change: a new world, a new leader, the run's end.
        on_lease_lost: Called once when etcd dropped this node (see :class:`NodeMembership`).
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, *, limits: RunLimits, ttl: int,
                 linger: int = DEFAULT_LINGER_S, on_change: Callable[[], None] | None = None,
                 on_lease_lost: Callable[[], None] | None = None) -> None:
        self.client = client
        self.keys = keys
        self.limits = limits
        self.linger = linger
        self.node = NodeMembership(client, keys, ttl=ttl, on_lost=on_lease_lost)
        self.view = JobView(client, keys, on_change=on_change)
        self.leader = LeaderLoop(client, keys, self.node, self.view, limits, self.end)
        self._stopped = threading.Event()
        self._ending = threading.Lock()  # held while this node records the run's end
        self._repairs = threading.Thread(target=self._repair_records, daemon=True,
                                         name="elastic-record-repair")

    def join(self, record: NodeRecord) -> None:
        """Publishes this node and starts campaigning for leadership."""
        self.node.join(record)
        self.leader.start()
        self._repairs.start()

    def _repair_records(self) -> None:
        """Every :data:`RECORD_CHECK_S`, puts this node's record back if someone overwrote
        it (see :meth:`NodeMembership.repair`)."""
        while not self._stopped.wait(RECORD_CHECK_S):
            if not self.view.watch.failed.is_set() and self.node.repair():
                self.leader.poke()

    def rejoin(self, record: NodeRecord) -> None:
        """Joins again under a new node id after the lease was lost (a new incarnation)."""
        self.node.join(record)
        self.leader.poke()

    def update(self, **changes: Any) -> NodeRecord:
        """Rewrites this node's record with ``changes`` and lets the leader decide again."""
        record = self.node.update(**changes)
        self.leader.poke()
        return record

    @property
    def me(self) -> str:
        """This node's id."""
        return self.node.record.node

    def world(self) -> WorldRecord | None:
        """The current world (from memory)."""
        return self.view.world()

    def wait(self, predicate: Callable[[JobView], bool], timeout: float) -> bool:
        """Waits until ``predicate(view)`` holds (woken by the watch)."""
        return self.view.wait(predicate, timeout)

    def end(self, end: EndRecord) -> bool:
        """Ends the run (once, whoever calls first); returns whether this call did."""
        with self._ending:
            return end_run(self.client, self.keys, end, linger=self.linger)

    def leave(self) -> None:
        """Stops leading, revokes the lease (the node record goes at once), stops watching.

        An end in progress on another thread (the leader's, when every member is done)
        completes first: the others see its end record as soon as its first write lands
        and leave, and the process must not exit before the job generation is marked ended
        (nodes that come late read it). Each of its etcd calls is bounded by the deadline.
        """
        if self._ending.acquire(timeout=self.client.config.deadline.total_seconds()):
            self._ending.release()
        self._stopped.set()
        self.leader.stop()
        self.node.leave()
        self.view.close()

