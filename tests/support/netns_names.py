"""Names, addresses and leftovers of test clusters of network namespaces (see ``netns.py``).

Name scheme: every namespace of one cluster is called ``ert<pid>x<token>-<role>``, where
``<pid>`` is the PID of the process that owns the cluster, ``<token>`` six random hex digits
and ``<role>`` one of ``sw`` (the switch), ``n<i>`` (node ``i``), ``e<i>`` (etcd member ``i``)
or ``obs`` (the observer). The switch port of a host is called ``ert<token>-<role>`` (at most
15 characters, the kernel's limit). :func:`sweep_stale` removes the namespaces of clusters whose
owner is dead (a test run that was SIGKILLed) and never touches a name outside this scheme or
one whose owner still runs.

Address scheme: one random ``/24`` per cluster in ``10.208.0.0/12``; node ``i`` is ``.10+i``,
etcd member ``i`` is ``.100+i`` and the observer is ``.250``. The addresses exist only inside
the cluster's namespaces, on a bridge no other cluster shares, so even two clusters that drew
the same subnet could not disturb each other; drawing at random keeps logs unambiguous.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from elastic.errors import ConfigError
from tests.support.proctree import alive, signal_pids, wait_gone

logger = logging.getLogger(__name__)

#: Where ``ip netns`` keeps its named namespaces.
NETNS_DIR: Final = Path("/run/netns")
NAME_RE: Final = re.compile(r"^ert(?P<pid>[0-9]+)x(?P<token>[0-9a-f]{6})-(?P<role>[a-z0-9]+)$")
ROLE_RE: Final = re.compile(r"^(sw|obs|[ne][0-9]{1,4})$")
MAX_NODES: Final = 90
MAX_ETCD_MEMBERS: Final = 50
_SUBNETS: Final = ipaddress.ip_network("10.208.0.0/12")
_IP_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True)
class ClusterNames:
    """The names of one cluster's namespaces and switch ports.

    Attributes:
        owner_pid: PID of the process that creates and removes the cluster.
        token: six hex digits that tell this cluster from the owner's others.
    """

    owner_pid: int
    token: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{6}", self.token):
            raise ConfigError(f"cluster token ({self.token!r}) must be six lowercase hex digits.")

    @classmethod
    def new(cls, rng: random.Random | None = None) -> ClusterNames:
        """Names for a new cluster owned by this process."""
        return cls(os.getpid(), f"{(rng or random.SystemRandom()).getrandbits(24):06x}")

    @property
    def prefix(self) -> str:
        """``ert<pid>x<token>``: every namespace name of the cluster starts with it."""
        return f"ert{self.owner_pid}x{self.token}"

    def netns(self, role: str) -> str:
        """The namespace name of ``role`` (``sw``, ``obs``, ``n<i>`` or ``e<i>``)."""
        _check_role(role)
        return f"{self.prefix}-{role}"

    def port(self, role: str) -> str:
        """The switch-side interface name of ``role``'s link."""
        _check_role(role)
        return f"ert{self.token}-{role}"


def _check_role(role: str) -> None:
    if not ROLE_RE.fullmatch(role):
        raise ConfigError(f"namespace role ({role!r}) must be sw, obs, n<i> or e<i>.")


def parse_netns_name(name: str) -> tuple[int, str, str] | None:
    """``(owner pid, token, role)`` of a name in the scheme, or ``None`` for any other name."""
    match = NAME_RE.fullmatch(name)
    if match is None or not ROLE_RE.fullmatch(match["role"]):
        return None
    return int(match["pid"]), match["token"], match["role"]


@dataclass(frozen=True)
class AddressPlan:
    """The IPv4 addresses of one cluster: a ``/24`` in ``10.208.0.0/12``.

    Attributes:
        subnet_index: which ``/24`` (0 to 4095).
    """

    subnet_index: int

    def __post_init__(self) -> None:
        if not 0 <= self.subnet_index < 4096:
            raise ConfigError(f"subnet index ({self.subnet_index}) must be in 0..4095.")

    @classmethod
    def random(cls, rng: random.Random | None = None) -> AddressPlan:
        """A plan on a random ``/24``."""
        return cls((rng or random.SystemRandom()).randrange(4096))

    @property
    def network(self) -> ipaddress.IPv4Network:
        """The cluster's ``/24``."""
        base = int(_SUBNETS.network_address) + (self.subnet_index << 8)
        return ipaddress.IPv4Network((base, 24))

    def _host(self, offset: int) -> str:
        return str(self.network.network_address + offset)

    def node(self, index: int) -> str:
        """Address of node ``index`` (``.10`` upwards)."""
        if not 0 <= index < MAX_NODES:
            raise ConfigError(f"node index ({index}) must be in 0..{MAX_NODES - 1}.")
        return self._host(10 + index)

    def etcd(self, index: int) -> str:
        """Address of etcd member ``index`` (``.100`` upwards)."""
        if not 0 <= index < MAX_ETCD_MEMBERS:
            raise ConfigError(f"etcd member index ({index}) must be in 0..{MAX_ETCD_MEMBERS - 1}.")
        return self._host(100 + index)

    def observer(self) -> str:
        """Address of the observer (``.250``)."""
        return self._host(250)


def list_netns() -> list[str]:
    """The names of every named network namespace (``ip netns list``), sorted."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def netns_inode(name: str) -> int | None:
    """The inode that identifies namespace ``name`` (as in ``/proc/<pid>/ns/net``), or None."""
    try:
        return os.stat(NETNS_DIR / name).st_ino
    except OSError:
        return None


def pids_in_netns(inodes: set[int]) -> list[int]:
    """Every process (other than this one) whose network namespace is one of ``inodes``.

    Processes are found whatever their parent: this is how a daemonised grandchild that left
    its process tree is still found and killed.
    """
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            with contextlib.suppress(OSError):  # gone, or a zombie (no namespaces any more)
                if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                    found.append(int(entry))
    return found


def own_threads_in_netns(inodes: set[int]) -> list[int]:
    """Thread ids of this process that are inside one of ``inodes``."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/self/task/{tid}/ns/net").st_ino in inodes:
                found.append(int(tid))
    return found


def kill_netns_processes(inodes: set[int], timeout_s: float = 10.0) -> list[int]:
    """SIGKILLs every process inside ``inodes`` until none is left; returns the survivors."""
    pids = pids_in_netns(inodes)
    for _ in range(5):  # a process may fork while we kill its parent: look again
        if not pids:
            return []
        signal_pids(pids, signal.SIGKILL)
        wait_gone(pids, timeout_s / 5)
        pids = pids_in_netns(inodes)
    return pids


def run_ip(*args: str, stdin: str | None = None) -> None:
    """Runs ``ip ARGS`` and raises ``RuntimeError`` with its message if it fails."""
    done = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True,
                          timeout=_IP_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def delete_netns(names: list[str]) -> None:
    """Deletes named namespaces, ignoring those that are already gone."""
    present = set(list_netns())
    for name in names:
        if name in present:
            try:
                run_ip("netns", "delete", name)
            except RuntimeError:
                if name in list_netns():
                    raise


def sweep_stale() -> list[str]:
    """Removes every cluster left behind by an owner that is no longer alive.

    A cluster counts as left behind when its namespaces follow the name scheme and its owner
    PID is not a live process. Its processes are SIGKILLed (found by namespace, not by tree),
    its namespaces deleted (their links go with them) and its temporary directory removed.

    Returns:
        The namespace names removed.
    """
    stale = []
    for name in list_netns():
        parsed = parse_netns_name(name)
        if parsed is not None and parsed[0] != os.getpid() and not alive(parsed[0]):
            stale.append(name)
    if not stale:
        return []
    inodes = {i for i in map(netns_inode, stale) if i is not None}
    survivors = kill_netns_processes(inodes)
    if survivors:
        logger.warning("processes %s in stale test namespaces did not die", survivors)
    delete_netns(stale)
    prefixes = {name.rsplit("-", 1)[0] for name in stale}
    for prefix in prefixes:
        for leftover in Path(tempfile.gettempdir()).glob(f"{prefix}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    logger.info("removed stale test namespaces %s", stale)
    return stale
