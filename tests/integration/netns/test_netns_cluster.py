"""The namespace cluster and its fault primitives do what they say, on real sockets.

Every silence check has a control that shows the same probe answered before the fault: a
connection that now times out used to connect, and a closed port that now times out used to be
refused with a reset. Timeouts are short (``_SILENT_S``): a silent path never answers, so a
longer wait would prove nothing more.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import proctree
from tests.support.netns import Host, NetnsCluster
from tests.support.netns_names import list_netns, netns_inode, run_ip, sweep_stale
from tests.support.netns_pytest import new_cluster, require_netns

pytestmark = [pytest.mark.netns, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
_SILENT_S = 1.0


class Echo:
    """A TCP echo server listening on every address of one host (threads of this process)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.listener = host.call(socket.create_server, ("", 0))
        self.port = self.listener.getsockname()[1]
        self.peers: list[str] = []
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listener was closed
            while True:
                conn, peer = self.listener.accept()
                self.peers.append(peer[0])
                self._conns.append(conn)
                threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() above
        self.listener.close()
        for conn in self._conns:
            conn.close()


@pytest.fixture(scope="module")
def shared() -> Iterator[NetnsCluster]:
    require_netns()
    cluster = new_cluster(nodes=3, etcd_members=1)
    with cluster:
        yield cluster
    cluster.assert_clean()


@pytest.fixture
def cluster(shared: NetnsCluster) -> Iterator[NetnsCluster]:
    """The module's cluster, with every fault healed after each test."""
    yield shared
    shared.heal_all()


@pytest.fixture
def echo(cluster: NetnsCluster) -> Iterator[Callable[[Host], Echo]]:
    servers: list[Echo] = []

    def start(host: Host) -> Echo:
        servers.append(Echo(host))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def connect(src: Host, address: str, port: int, timeout_s: float = _SILENT_S) -> socket.socket:
    sock = src.call(socket.create_connection, (address, port), timeout_s)
    sock.settimeout(timeout_s)
    return sock


def outcome(src: Host, address: str, port: int, timeout_s: float = _SILENT_S) -> str:
    """What a new TCP connection from ``src`` gets: connected, refused, timeout, or an error."""
    try:
        connect(src, address, port, timeout_s).close()
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error: {exc}"
    return "connected"


def outcomes(*probes: tuple[Host, str, int]) -> list[str]:
    """:func:`outcome` of every probe, in parallel (each silent one costs ``_SILENT_S``)."""
    with ThreadPoolExecutor(len(probes)) as pool:
        return list(pool.map(lambda p: outcome(*p), probes))


def closed_port(host: Host) -> int:
    """A port nothing listens on inside ``host``."""
    with host.call(socket.socket) as probe:
        probe.bind((host.address, 0))
        return int(probe.getsockname()[1])


def silent_established(sock: socket.socket) -> str:
    """Sends on an established connection and reads: what happens while the path is cut."""
    started = time.monotonic()
    sock.settimeout(_SILENT_S)
    sock.sendall(b"during the cut")
    try:
        data = sock.recv(100)
    except TimeoutError:
        return "recv timed out"
    except OSError as exc:
        return f"error after {time.monotonic() - started:.2f} s: {exc!r}"
    return f"received {data!r}"


def recv_exactly(sock: socket.socket, size: int, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_nodes_talk_at_their_own_addresses_which_the_root_namespace_does_not_have(
    cluster: NetnsCluster, echo: Callable[[Host], Echo],
) -> None:
    n0, n1, _ = cluster.nodes
    server = echo(n1)
    with connect(n0, n1.address, server.port) as sock:
        sock.sendall(b"ping")
        assert recv_exactly(sock, 4, 5) == b"ping"
    assert server.peers == [n0.address]
    # Each namespace has its own loopback, and only its own address on eth0.
    with connect(n1, "127.0.0.1", server.port) as sock:
        sock.sendall(b"lo")
        assert recv_exactly(sock, 2, 5) == b"lo"
    assert outcome(n0, "127.0.0.1", server.port) == "refused"
    shown = n0.run(["ip", "-o", "-4", "addr", "show"]).stdout
    assert f"inet {n0.address}/24" in shown and n1.address not in shown
    # The kernel answers a closed port with a reset: the baseline the silence tests rely on.
    assert outcome(n0, n1.address, closed_port(n1)) == "refused"
    root_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True,
                                check=True).stdout
    root_routes = subprocess.run(["ip", "route"], capture_output=True, text=True,
                                 check=True).stdout
    root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                                check=True).stdout
    assert not [h.address for h in cluster.hosts if h.address in root_addrs]
    assert str(cluster.plan.network.network_address) not in root_routes
    assert cluster.names.token not in root_links


def test_cut_link_silences_the_node_both_ways_until_restored(
    cluster: NetnsCluster, echo: Callable[[Host], Echo],
) -> None:
    n0, n1, _ = cluster.nodes
    on_n0, on_n1 = echo(n0), echo(n1)
    closed_on_n0 = closed_port(n0)
    into_n0 = connect(n1, n0.address, on_n0.port)
    out_of_n0 = connect(n0, n1.address, on_n1.port)
    for sock in (into_n0, out_of_n0):
        sock.sendall(b"before")
        assert recv_exactly(sock, 6, 5) == b"before"
    dropped = cluster.dropped_packets()

    cluster.cut_link(n0)
    n1.run(["ip", "neigh", "flush", "all"])  # n1 must resolve n0's address during the cut
    probes = [
        lambda: outcome(n1, n0.address, on_n0.port),
        lambda: outcome(n0, n1.address, on_n1.port),
        lambda: outcome(n1, n0.address, closed_on_n0),  # not even a reset from a closed port
        lambda: outcome(cluster.observer, n0.address, on_n0.port),
        lambda: silent_established(into_n0),
        lambda: silent_established(out_of_n0),
    ]
    with ThreadPoolExecutor(len(probes)) as pool:  # all at once: the cut lasts _SILENT_S
        seen = list(pool.map(lambda probe: probe(), probes))
    assert seen == ["timeout"] * 4 + ["recv timed out"] * 2
    # ARP still resolves (the cut host's kernel answers it), so no peer ever gets
    # "No route to host" from its own kernel, however long the cut lasts.
    assert "lladdr" in n1.run(["ip", "neigh", "show", n0.address]).stdout
    assert outcome(n0, n0.address, on_n0.port) == "connected"  # inside the host: no switch
    assert cluster.dropped_packets() > dropped

    cluster.restore_link(n0)
    # The bytes sent during the cut arrive: the connections were never reset.
    for sock in (into_n0, out_of_n0):
        assert recv_exactly(sock, 14, 15) == b"during the cut"
        sock.close()
    assert outcomes((n1, n0.address, on_n0.port), (n0, n1.address, on_n1.port)) == \
        ["connected"] * 2


def test_partition_from_etcd_cuts_only_the_node_and_the_etcd_members(
    cluster: NetnsCluster, echo: Callable[[Host], Echo],
) -> None:
    n0, n1, _ = cluster.nodes
    member = cluster.etcd[0]
    on_n0 = echo(n0)
    port = member.CLIENT_PORT
    cluster.partition_from_etcd(n0)
    assert outcomes(
        (n0, member.address, port), (member, n0.address, on_n0.port),
        (n1, member.address, port), (n1, n0.address, on_n0.port),
        (cluster.observer, n0.address, on_n0.port),
    ) == ["timeout", "timeout", "connected", "connected", "connected"]
    cluster.heal_from_etcd(n0)
    assert outcome(n0, member.address, port) == "connected"


def test_partition_pair_cuts_only_that_pair(
    cluster: NetnsCluster, echo: Callable[[Host], Echo],
) -> None:
    n0, n1, n2 = cluster.nodes
    servers = {node.role: echo(node) for node in cluster.nodes}
    cluster.partition_pair(n0, n1)
    assert outcomes(
        (n0, n1.address, servers["n1"].port), (n1, n0.address, servers["n0"].port),
        (n0, n2.address, servers["n2"].port), (n2, n1.address, servers["n1"].port),
        (n1, cluster.etcd[0].address, cluster.etcd[0].CLIENT_PORT),
    ) == ["timeout", "timeout", "connected", "connected", "connected"]
    cluster.heal_pair(n0, n1)
    assert outcome(n0, n1.address, servers["n1"].port) == "connected"


def test_etcd_in_its_own_namespace_serves_nodes_and_the_test_process(
    cluster: NetnsCluster, etcd_prefix: str,
) -> None:
    member = cluster.etcd[0]
    assert member.pid in member.pids()  # etcd runs inside its namespace
    assert member.endpoint == f"{member.address}:2379"
    from_n0 = cluster.etcd_client(cluster.nodes[0])
    from_n0.put(f"{etcd_prefix}/k", b"from n0")
    kv = cluster.etcd_client().get(f"{etcd_prefix}/k")  # from the observer
    assert kv is not None and kv.value == b"from n0"
    # A thread started inside a call is born in the namespace too (watch/lease threads are):
    # this client is only ever used from such a thread.
    from membership.etcd import EtcdClient, EtcdConfig

    plain = EtcdClient(EtcdConfig(endpoints=(member.endpoint,)))
    result: list[bytes] = []

    def in_a_new_thread() -> None:
        def get() -> None:
            kv = plain.get(f"{etcd_prefix}/k")
            result.append(kv.value if kv else b"")

        thread = threading.Thread(target=get)
        thread.start()
        thread.join(10)

    try:
        cluster.nodes[1].call(in_a_new_thread)
    finally:
        plain.close()
    assert result == [b"from n0"]


def test_popen_starts_the_real_program_in_the_namespace_in_a_session_of_its_own(
    cluster: NetnsCluster,
) -> None:
    node = cluster.nodes[2]
    script = ("import os, socket, subprocess, sys, time\n"
              "socket.create_server((sys.argv[1], 0)).close()\n"  # the node's address is here
              "kids = [subprocess.Popen(['sleep', '60']) for _ in range(2)]\n"
              "print(os.getpid(), os.getsid(0), *[k.pid for k in kids], flush=True)\n"
              "time.sleep(60)\n")
    agent = node.popen([sys.executable, "-c", script, node.address], stdout=subprocess.PIPE,
                       text=True)
    pid, sid, *kids = map(int, agent.stdout.readline().split())  # type: ignore[union-attr]
    assert pid == sid == agent.pid
    assert os.stat(f"/proc/{pid}/ns/net").st_ino == netns_inode(node.name)
    assert sorted(node.pids()) == sorted([pid, *kids])
    assert node.workers(agent.pid) == kids

    stopped = cluster.sigstop(agent.pid, whole_tree=True)
    assert stopped == [agent.pid, *kids]
    assert [proctree.state(p) for p in stopped] == ["T"] * 3
    cluster.sigcont(stopped)
    assert "T" not in [proctree.state(p) for p in stopped]
    proctree.kill_tree(agent.pid)
    agent.wait(10)
    assert proctree.wait_gone(kids, 10) == []


def test_a_hung_worker_stops_stepping_while_its_heartbeat_runs(cluster: NetnsCluster) -> None:
    out = cluster.tmp_dir / "hang-test"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), **cluster.hang_env()}
    worker = cluster.nodes[0].popen([sys.executable, str(HERE / "heartbeat_worker.py"),
                                     str(out)], env=env)

    def count(name: str) -> int:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return int((out / name).read_text())
        return 0

    deadline = time.monotonic() + 20
    while count("steps") < 5:
        assert time.monotonic() < deadline and worker.poll() is None, "the worker never stepped"
        time.sleep(0.05)
    cluster.hang_worker(worker.pid)
    cluster.wait_hung(worker.pid, timeout_s=10)
    steps, beats = count("steps"), count("beats")
    # While its other thread lives on (five more beats, however long they take) ...
    deadline = time.monotonic() + 30
    while count("beats") < beats + 5:
        assert time.monotonic() < deadline, "the hung worker's other thread stopped beating"
        time.sleep(0.05)
    assert count("steps") == steps  # ... it stays held before its "collective"
    cluster.release_worker(worker.pid)
    deadline = time.monotonic() + 10
    while count("steps") <= steps:
        assert time.monotonic() < deadline, "the released worker did not step again"
        time.sleep(0.05)


def test_close_removes_everything_even_when_the_body_raises() -> None:
    require_netns()
    cluster = new_cluster(nodes=2, etcd_members=0)
    with pytest.raises(RuntimeError, match="the test body failed"), cluster:
        shell = cluster.nodes[0].popen(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
                                       stdout=subprocess.PIPE, text=True)
        orphan = int(shell.communicate(timeout=10)[0])  # its parent is gone: not in a tree
        tree = cluster.nodes[1].popen(["sh", "-c", "sleep 60 & sleep 60"])
        time.sleep(0.2)
        pids = [orphan, *proctree.tree(tree.pid)]
        assert len(pids) == 4 and all(map(proctree.alive, pids))
        names = [h.name for h in cluster.hosts] + [cluster.fabric.netns]
        assert set(names) <= set(list_netns())
        tmp_dir = cluster.tmp_dir
        raise RuntimeError("the test body failed")
    cluster.assert_clean()
    assert not set(names) & set(list_netns())
    assert not [p for p in pids if proctree.alive(p)]
    assert not tmp_dir.exists()


def test_a_cluster_that_fails_to_start_removes_what_it_had_created() -> None:
    require_netns()
    from launch.etcd_server import EtcdStartError

    cluster = NetnsCluster(nodes=2, etcd_members=1, etcd_binary="false")
    with pytest.raises(EtcdStartError, match="exited with code 1"):
        cluster.start()  # the namespaces exist by the time etcd fails
    cluster.assert_clean()
    assert not [n for n in list_netns() if n.startswith(cluster.names.prefix)]


def test_sweep_removes_a_dead_owners_cluster_and_leaves_the_others() -> None:
    require_netns()
    owner = subprocess.Popen([sys.executable, str(HERE / "orphan_cluster.py")],
                             stdout=subprocess.PIPE, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    live_owner = subprocess.Popen(["sleep", "60"])
    others = [f"ert{live_owner.pid}x{os.getpid() % 0xFFFFFF:06x}-n0",  # its owner lives
              f"ert-unrelated-{os.getpid()}"]  # not in the scheme
    try:
        prefix, sleeper = owner.stdout.readline().split()  # type: ignore[union-attr]
        owner.kill()
        owner.wait(10)
        for name in others:
            run_ip("netns", "add", name)
        left = [n for n in list_netns() if n.startswith(f"{prefix}-")]
        assert sorted(left) == sorted(f"{prefix}-{r}" for r in ("sw", "n0", "obs"))
        assert proctree.alive(int(sleeper))

        assert sorted(sweep_stale()) == sorted(left)
        assert not [n for n in list_netns() if n.startswith(f"{prefix}-")]
        assert proctree.wait_gone([int(sleeper)], 5) == []
        assert set(others) <= set(list_netns())
    finally:
        owner.kill()
        live_owner.kill()
        live_owner.wait(10)
        for name in others:
            with contextlib.suppress(RuntimeError):
                run_ip("netns", "delete", name)
        sweep_stale()


def test_three_etcd_members_in_three_namespaces_keep_serving_without_a_silent_one(
    netns_cluster_factory: Callable[..., NetnsCluster], etcd_prefix: str,
) -> None:
    cluster = netns_cluster_factory(nodes=1, etcd_members=3)
    client = cluster.etcd_client(cluster.nodes[0], request_timeout_s=1, deadline_s=20)
    client.put(f"{etcd_prefix}/before", b"1")
    cluster.cut_link(cluster.etcd[0])  # the client's first endpoint
    client.put(f"{etcd_prefix}/during", b"2")
    kv = cluster.etcd_client(request_timeout_s=1, deadline_s=20).get(f"{etcd_prefix}/during")
    assert kv is not None and kv.value == b"2"
