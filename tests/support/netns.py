"""A test cluster of network namespaces: real hosts with their own addresses, cut silently.

On 127.0.0.1 a dead process is noticed at once: its kernel answers with a TCP reset. Real
hosts often die silently (a spot VM reclaimed, a switch port dark): no reset, no ICMP, no
answer at all. :class:`NetnsCluster` gives each node, each etcd member and an observer a
network namespace of its own on one switch, and breaks the switch on demand. Needs root,
``ip`` (iproute2) and ``nft`` (nftables); see ``tests/support/netns_pytest.py`` for the
fixtures and skips.

Topology (one cluster; nothing is added to the root namespace)::

                       ert<pid>x<tok>-sw  (the switch)
       +---------------------------------------------------------------+
       |  br0  +  nftables table "bridge ert_faults" (the fault rules)  |
       +--+--------------+--------------+----------------+-------------+
          | veth         |              |                |
       eth0 10.a.b.10  eth0 10.a.b.11  eth0 10.a.b.100  eth0 10.a.b.250
       -n0 (node 0)    -n1 (node 1)    -e0 (etcd 0)     -obs (observer)

* Names: ``ert<owner pid>x<6 hex>-<role>``, roles ``sw``, ``n<i>``, ``e<i>``, ``obs``; the
  switch port of a host is ``ert<6 hex>-<role>``, its own end ``eth0``. Every namespace has
  ``lo`` up, so processes in it also use 127.0.0.1 (each namespace has a loopback of its own).
* Addresses: a random ``/24`` of ``10.208.0.0/12`` per cluster; node ``i`` at ``.10+i``, etcd
  member ``i`` at ``.100+i`` (client port 2379, peer port 2380), the observer at ``.250``.
  They exist only inside the cluster's namespaces: the root namespace has no address, route or
  link for them, and traffic never leaves the switch.
* The observer is a host that faults never target by themselves: the test process reads etcd
  from it (:meth:`NetnsCluster.etcd_client`) while nodes are cut off.

Running code inside a host (``host`` is any of ``cluster.nodes``, ``cluster.etcd``,
``cluster.observer``):

* ``host.popen(argv, env=..., cwd=..., stdout=..., stderr=...)`` starts a process inside the
  namespace, in a new session; its PID is the program's own, the kernel kills it if the test
  process dies, and the cluster kills its tree when it closes. ``host.run(argv)`` runs a
  command to completion; ``host.exec_prefix`` is ``ip netns exec NAME`` for anything else.
* ``host.call(fn, *args, **kwargs)`` runs ``fn`` on a thread of the test process that entered
  the namespace and returns its result (``host.submit`` returns a future instead). Sockets
  created by ``fn`` live in the namespace for good and can be used from any thread
  afterwards; threads and processes ``fn`` starts are born inside. A library that opens
  sockets lazily (``requests``, hence ``EtcdClient``) must make *every* call there:
  ``host.proxy(obj)`` wraps an object so that each method call goes through ``call``. Only
  the object's own methods are wrapped: call the methods of what they return (a ``Lease``,
  a watch) through ``host.call`` as well.
* Never open a connection to a cluster address from the root namespace (a plain call on the
  test's own thread): the root namespace has no route of its own to it, so the packets would
  leave through the machine's default route instead of failing.
* Processes in a namespace share the machine's hostname, which resolves to an address of
  the root namespace: tell libraries the address or the interface explicitly. gloo needs
  ``GLOO_SOCKET_IFNAME=eth0`` (``host.process_env()`` adds it; without it gloo falls back to
  the namespace's loopback and ranks on different nodes never connect); torch's agent
  advertises ``socket.getfqdn()`` unless given the node's address. ``elastic-run`` needs
  neither: it registers the address of the interface that reaches etcd and tells its
  workers' gloo that interface (:mod:`tests.support.netns_job` runs it as a user would).

Faults (rules on the switch, so no host's kernel knows of them; ARP always passes, as in a
cloud network that answers ARP for instances that are gone, so no peer ever gets "No route
to host"):

==============================  ================================================================
``cut_link(host)``              silent host: every frame into or out of its switch port is
                                dropped. New connections to or from it time out (no RST, no
                                ICMP); established ones get no error: sends succeed (bytes wait
                                in the send queue, retransmitted with backoff), reads time out.
                                Traffic inside the host (its own loopback and address) goes on.
``restore_link(host)``          the host is back at the same address; established connections
                                resume on their next retransmission if neither side gave up.
``partition_from_etcd(host)``   frames between the host and every etcd member are dropped, both
                                ways; the host still reaches its peers and the observer.
``heal_from_etcd(host)``        undoes it.
``partition_pair(a, b)``        frames between hosts ``a`` and ``b`` are dropped, both ways.
``heal_pair(a, b)``             undoes it. ``heal_all()`` removes every fault.
==============================  ================================================================

Dropping in the host's own namespace was measured and rejected: its kernel then refuses the
packets it sends with ``EPERM`` (a UDP send fails at once; a TCP connection that times out
reports EPERM). Setting the switch-side veth down was rejected too: the host sees its carrier
drop, and its peers' ARP fails, so they get "No route to host" after about 3 s.

Processes: ``sigstop``/``sigcont`` (a hung process) and ``children``/``descendants`` (an
agent's workers, from the process tree only) are in :mod:`tests.support.proctree`; the
hang-file convention (a worker whose step stops before its collective while its threads run)
is in :mod:`tests.support.hang`, with the cluster's file at :attr:`NetnsCluster.hang_file`.

Cleanup: :meth:`NetnsCluster.close` (run by ``with`` and the pytest fixtures, also when the
body raised) stops the etcd members, SIGKILLs the tree of every process ``popen`` started
and then every process still inside one of the namespaces (found by namespace, so a
daemonised grandchild is caught too), stops the namespace threads, deletes the namespaces
(their veths and the bridge go with them) and the temporary directory.
:meth:`NetnsCluster.assert_clean` asserts that nothing is left. Creating a cluster first
removes what a SIGKILLed test run left behind (:func:`~tests.support.netns_names.sweep_stale`).

Limits: IPv4 only; no latency, loss rate or bandwidth faults (``tc netem`` is missing in this
kernel); hostnames are shared with the root namespace; a socket the test process created
inside a namespace and never closed keeps that (deleted) namespace's memory until it is closed.

Example::

    with NetnsCluster(nodes=2, etcd_members=1) as cluster:
        node = cluster.nodes[0]
        agent = node.popen([sys.executable, "-m", "launch", ...], env=node.process_env())
        etcd = cluster.etcd_client()                  # from the observer
        cluster.cut_link(cluster.nodes[0])            # node 0 goes silent
        ...
        cluster.restore_link(cluster.nodes[0])
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from elastic.errors import ConfigError
from tests.support import hang, proctree
from tests.support.netns_fabric import Fabric
from tests.support.netns_host import EtcdMember, Host
from tests.support.netns_names import (
    MAX_ETCD_MEMBERS,
    MAX_NODES,
    AddressPlan,
    ClusterNames,
    delete_netns,
    kill_netns_processes,
    list_netns,
    netns_inode,
    own_threads_in_netns,
    pids_in_netns,
    run_ip,
    sweep_stale,
)

if TYPE_CHECKING:
    from membership.etcd import EtcdClient

logger = logging.getLogger(__name__)

__all__ = ["EtcdMember", "Host", "NetnsCluster", "NetnsUnavailableError", "netns_unavailable"]


class NetnsUnavailableError(RuntimeError):
    """This machine cannot run a cluster of network namespaces (not root, no ip/nft, ...)."""


@functools.lru_cache(maxsize=1)
def netns_unavailable() -> str | None:
    """Why a cluster cannot run here (one sentence), or ``None`` when it can.

    Probes for real: creates a throwaway switch namespace with its bridge and fault rules.
    """
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})."
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH; install Debian's {package}."
    probe = ClusterNames.new().netns("sw")
    try:
        Fabric(probe, 24).create()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"network namespaces with nftables bridge rules do not work here: {exc}"
    finally:
        with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
            delete_netns([probe])
    return None


class NetnsCluster:
    """Nodes, etcd members and an observer, each in a network namespace on one switch.

    Args:
        nodes: number of nodes (``cluster.nodes[i]``, ``10.a.b.10+i``).
        etcd_members: number of etcd members (``cluster.etcd[i]``); 0 for none. They form one
            etcd cluster and are started (and healthy) when the cluster is.
        etcd_binary: etcd executable (found as ``launch.etcd_server`` finds it when ``None``).
        call_timeout_s: how long ``host.call`` waits for a result.

    Raises:
        ConfigError: for a node or member count out of range.
        EtcdBinaryNotFoundError: when members are asked for and no etcd is installed.
    """

    def __init__(
        self,
        nodes: int = 2,
        etcd_members: int = 1,
        *,
        etcd_binary: str | None = None,
        call_timeout_s: float = 30.0,
    ) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ConfigError(f"node count ({nodes}) must be in 1..{MAX_NODES}.")
        if not 0 <= etcd_members <= MAX_ETCD_MEMBERS:
            raise ConfigError(f"etcd member count ({etcd_members}) must be in "
                              f"0..{MAX_ETCD_MEMBERS}.")
        if call_timeout_s <= 0:
            raise ConfigError(f"call_timeout_s ({call_timeout_s}) must be positive.")
        self.names = ClusterNames.new()
        self.plan = AddressPlan.random()
        self._node_count = nodes
        self._etcd_count = etcd_members
        self._etcd_binary: str | None = None
        if etcd_members:
            from launch.etcd_server import find_etcd_binary

            self._etcd_binary = find_etcd_binary(etcd_binary)
        self._call_timeout_s = call_timeout_s
        self.fabric = Fabric(self.names.netns("sw"), self.plan.network.prefixlen)
        self.nodes: list[Host] = []
        self.etcd: list[EtcdMember] = []
        self._observer: Host | None = None
        self._processes: list[subprocess.Popen[Any]] = []
        self._clients: list[EtcdClient] = []
        self._inodes: set[int] = set()
        self._created: list[str] = []
        self._tmp_dir: Path | None = None
        self._closed = False

    def __repr__(self) -> str:
        return (f"NetnsCluster({self.names.prefix}, {self.plan.network}, "
                f"nodes={self._node_count}, etcd={self._etcd_count})")

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> NetnsCluster:
        """Creates every namespace and link, then starts the etcd members.

        On any failure, everything created so far is removed before the error propagates.

        Raises:
            NetnsUnavailableError: when this machine cannot run namespaces.
            EtcdStartError: when etcd does not become healthy.
        """
        reason = netns_unavailable()
        if reason is not None:
            raise NetnsUnavailableError(reason)
        removed = sweep_stale()
        if removed:
            logger.warning("removed namespaces of dead test runs: %s", removed)
        try:
            self._tmp_dir = Path(tempfile.mkdtemp(prefix=f"{self.names.prefix}-"))
            self._created.append(self.fabric.netns)  # first: a half-made one goes too
            self.fabric.create()
            self._remember_inode(self.fabric.netns)
            self.nodes = [self._add_host(Host, f"n{i}", self.plan.node(i))
                          for i in range(self._node_count)]
            initial = ",".join(f"m{i}=http://{self.plan.etcd(i)}:{EtcdMember.PEER_PORT}"
                               for i in range(self._etcd_count))
            # Data under tmp_dir: a sweep removes it even after a SIGKILLed run.
            self.etcd = [self._add_host(EtcdMember, f"e{i}", self.plan.etcd(i),
                                        binary=self._etcd_binary, member_name=f"m{i}",
                                        cluster=initial,
                                        data_dir=str(self._tmp_dir / f"etcd-m{i}"))
                         for i in range(self._etcd_count)]
            self._observer = self._add_host(Host, "obs", self.plan.observer())
            for member in self.etcd:
                member.launch()
            for member in self.etcd:
                member.wait_healthy()
        except BaseException:
            self.close()
            raise
        logger.info("started %r", self)
        return self

    def _remember_inode(self, name: str) -> None:
        inode = netns_inode(name)
        if inode is not None:
            self._inodes.add(inode)

    def _add_host(self, kind: type[Host], role: str, address: str, **extra: Any) -> Any:
        netns = self.names.netns(role)
        self._created.append(netns)
        run_ip("netns", "add", netns)
        self._remember_inode(netns)
        port = self.names.port(role)
        self.fabric.attach(netns, port, address)
        return kind(role=role, netns=netns, address=address, port=port,
                    call_timeout_s=self._call_timeout_s, track=self._processes.append,
                    **extra)

    def close(self) -> None:
        """Kills every process, removes every namespace, link and file of the cluster.

        Safe to call twice and after a failed :meth:`start`; errors are logged and the first
        one is raised once everything else was tried.
        """
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []

        def attempt(what: str, fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:  # keep cleaning up; raised below
                logger.error("netns cluster cleanup: %s failed: %s", what, exc)
                errors.append(exc)

        for client in self._clients:
            attempt("closing an etcd client", client.close)
        for member in self.etcd:
            # SIGKILL first: a member cut off from its peers can take 10 s to honour SIGTERM.
            attempt(f"killing etcd {member.role}", member.kill)
            attempt(f"stopping etcd {member.role}", member.stop)
        for proc in self._processes:
            proctree.kill_tree(proc.pid)
        # Not only the trees: a process whose parent died has left its tree.
        leftovers = kill_netns_processes(self._inodes)
        if leftovers:
            errors.append(RuntimeError(f"processes {leftovers} in {self.names.prefix} "
                                       "namespaces survived SIGKILL"))
        for proc in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for host in self.hosts:
            busy = host.close_threads()
            if busy:
                logger.error("threads %s are still in a call inside %s", busy, host.name)
        attempt("deleting namespaces", delete_netns, list(reversed(self._created)))
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
        if errors:
            raise errors[0]

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except Exception:
            if exc is None:
                raise
            logger.exception("netns cluster cleanup failed while the test body failed")

    def assert_clean(self) -> None:
        """Asserts that nothing of the cluster is left (call it after :meth:`close`).

        Checks: no namespace with the cluster's prefix (``ip netns list``); no process inside
        any of its namespaces; no process ``popen`` started; no thread of this process inside
        one; no link of the cluster in the root namespace (``ip link``); no temporary directory.

        Raises:
            AssertionError: listing everything that is left.
        """
        problems = []
        names = [n for n in list_netns() if n.startswith(f"{self.names.prefix}-")]
        if names:
            problems.append(f"namespaces {names}")
        pids = pids_in_netns(self._inodes)
        pids += [p.pid for p in self._processes if proctree.alive(p.pid) and p.pid not in pids]
        if pids:
            problems.append(f"processes {sorted(pids)}")
        threads = own_threads_in_netns(self._inodes)
        if threads:
            problems.append(f"threads {threads} of this process")
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                               timeout=10, check=True).stdout
        ours = [line for line in links.splitlines() if f"ert{self.names.token}-" in line]
        if ours:
            problems.append(f"root-namespace links {ours}")
        if self._tmp_dir is not None and self._tmp_dir.exists():
            problems.append(f"directory {self._tmp_dir}")
        assert not problems, f"{self!r} left behind: {'; '.join(problems)}"

    # ---- hosts ---------------------------------------------------------------------------

    @property
    def observer(self) -> Host:
        """The host the test process watches from (faults never target it by themselves)."""
        if self._observer is None:
            raise RuntimeError(f"{self!r} is not started; use it as a context manager.")
        return self._observer

    @property
    def hosts(self) -> list[Host]:
        """Every host: the nodes, the etcd members, then the observer."""
        return [*self.nodes, *self.etcd, *([self._observer] if self._observer else [])]

    @property
    def tmp_dir(self) -> Path:
        """A directory removed when the cluster closes (logs, hang file, data)."""
        if self._tmp_dir is None:
            raise RuntimeError(f"{self!r} is not started; use it as a context manager.")
        return self._tmp_dir

    @property
    def etcd_endpoints(self) -> str:
        """Comma-separated ``address:2379`` client endpoints of every etcd member."""
        return ",".join(m.endpoint for m in self.etcd)

    def etcd_client(self, host: Host | None = None, *, request_timeout_s: float = 2.0,
                    deadline_s: float = 5.0) -> EtcdClient:
        """An :class:`~membership.etcd.EtcdClient` of every member whose calls all run in ``host``.

        Args:
            host: where the client's connections start (the observer by default).
            request_timeout_s: timeout of one HTTP request.
            deadline_s: how long one call retries.

        Returns:
            The client seen through ``host.proxy``; the cluster closes it.
        """
        from membership.etcd import EtcdClient, EtcdConfig

        if not self.etcd:
            raise ConfigError(f"{self!r} has no etcd member; pass etcd_members=1 or more.")
        config = EtcdConfig(endpoints=tuple(m.endpoint for m in self.etcd),
                            request_timeout=timedelta(seconds=request_timeout_s),
                            deadline=timedelta(seconds=deadline_s))
        client = EtcdClient(config)
        self._clients.append(client)
        return (host or self.observer).proxy(client)

    # ---- faults --------------------------------------------------------------------------

    def cut_link(self, host: Host) -> None:
        """``host`` goes silent: every frame to or from it vanishes on the switch."""
        self.fabric.set_dark(host.port, True)

    def restore_link(self, host: Host) -> None:
        """``host`` is reachable again, at the same address."""
        self.fabric.set_dark(host.port, False)

    def partition_from_etcd(self, host: Host) -> None:
        """``host`` and every etcd member cannot reach each other; all else still flows."""
        for member in self.etcd:
            self.fabric.set_cut(host.port, member.port, True)

    def heal_from_etcd(self, host: Host) -> None:
        """Undoes :meth:`partition_from_etcd`."""
        for member in self.etcd:
            self.fabric.set_cut(host.port, member.port, False)

    def partition_pair(self, a: Host, b: Host) -> None:
        """``a`` and ``b`` cannot reach each other; each still reaches every other host."""
        if a is b:
            raise ConfigError(f"partition_pair needs two different hosts (got {a!r} twice).")
        self.fabric.set_cut(a.port, b.port, True)

    def heal_pair(self, a: Host, b: Host) -> None:
        """Undoes :meth:`partition_pair`."""
        self.fabric.set_cut(a.port, b.port, False)

    def heal_all(self) -> None:
        """Removes every fault: every link up, every partition healed."""
        self.fabric.clear()

    def dropped_packets(self) -> int:
        """Frames the faults have dropped so far (proof that traffic did run into one)."""
        return self.fabric.dropped_packets()

    # ---- processes -----------------------------------------------------------------------

    @property
    def hang_file(self) -> Path:
        """The cluster's hang file (see :mod:`tests.support.hang`)."""
        return self.tmp_dir / "hang"

    def hang_env(self) -> dict[str, str]:
        """``{ELASTIC_TEST_HANG_FILE: hang_file}``, to add to the workers' environment."""
        return {hang.HANG_FILE_ENV: str(self.hang_file)}

    def hang_worker(self, pid: int) -> None:
        """Holds worker ``pid`` at its next ``maybe_hang()`` (its threads keep running)."""
        hang.hang_worker(self.hang_file, pid)

    def release_worker(self, pid: int) -> None:
        """Lets worker ``pid`` go on."""
        hang.release_worker(self.hang_file, pid)

    def wait_hung(self, pid: int, timeout_s: float = 30.0) -> None:
        """Waits until worker ``pid`` sits in ``maybe_hang()``."""
        hang.wait_hung(self.hang_file, pid, timeout_s)

    @staticmethod
    def sigstop(pid: int, *, whole_tree: bool = False) -> list[int]:
        """SIGSTOPs ``pid`` (and its descendants) and waits until they are stopped.

        See :func:`tests.support.proctree.sigstop`; returns the PIDs for :meth:`sigcont`.
        """
        return proctree.sigstop(pid, whole_tree=whole_tree)

    @staticmethod
    def sigcont(pids: int | list[int]) -> None:
        """SIGCONTs what :meth:`sigstop` stopped."""
        proctree.sigcont(pids)
