"""Rendezvous at scale: N simulated nodes completing one round, elastic-run versus torch's c10d.

**elastic-run**: each simulated node is what a node agent runs, minus its workers: its own
etcd client, :func:`~membership.generation.open_run` (which run of the job id to join),
then :class:`~membership.job.RunMembership` (its own lease carrying its JSON node record,
its watch of the run's control keys, and the leader loop that campaigns for leadership and,
once elected, mirrors the node records and writes the world by compare-and-swap). Each node
record carries ``--workers`` worker slots (8 by default, as on an 8-GPU node), all ready, so
the world names ``N x workers`` ranks. A node has completed the round when its own view shows
the world with all ``N`` nodes. ``min_nodes = max_nodes = N``, so the world is written the
moment the last node's record is in (no last-call wait is measured).

**c10d**: torch's ``DynamicRendezvousHandler`` over its ``C10dRendezvousBackend`` (a TCPStore
served by this process), one handler per simulated node calling ``next_rendezvous()``, also
``min_nodes = max_nodes = N``. It runs in the same invocation, so the ratio between the two
is meaningful even though absolute times drift on a shared machine. Once c10d does not
complete a round within ``--round-timeout`` it is not run at larger N.

Nodes are threads spread over ``--processes`` processes (4 by default) against one etcd
(``launch.etcd_server.EmbeddedEtcd``). A round that does not complete within
``--round-timeout`` is reported as incomplete (with how many nodes completed), never as a crash.

Per N it reports:

- **round time**: from the common start to the last node seeing the world;
- **CAS attempts** in the round (compare-and-swap transactions sent to etcd), split for
  elastic-run into the job generation (``open_run``: one create attempt per node while the job
  id has no run yet), the leader election (one create attempt per node while nobody leads) and
  the world (the leader's writes): O(N) in all, and O(1) for the world itself;
- **steady load** (elastic-run, ``--steady`` seconds after the round): lease keep-alive requests
  per second, live watches and watch streams opened per second, and every other request per
  second, all counted at the client (its requests and its watch streams are instrumented),
  next to what the protocol predicts (:func:`predicted_load`);
- **a loss round** (elastic-run): one node leaves (its lease is revoked, as a clean exit does);
  the time until every other node sees the next world, and its CAS attempts.

Last, the load of a 1024-node x 8-worker job computed from the protocol's defaults.

Keep-alives: the real agent keeps its one lease alive from a thread of its own, one
``POST /v3/lease/keepalive`` every ``keep_alive_period(ttl)``. With ``--keepalive pooled`` (the
default) every node still has its own lease, refreshed by its own request at that period and
at its own phase, so etcd receives exactly the requests the real agents send; but the
requests are sent from a helper process per node process, on plain sockets. Four Python
processes stand in for a thousand machines here: hundreds of keep-alive threads competing
for each process's GIL with the nodes under measurement would be late, and a lease refreshed
late is a node lost, which no real agent suffers. ``--keepalive per-lease`` runs the real
:class:`~membership.etcd.Lease` thread per node instead. Likewise etcd keeps its data in
``/dev/shm`` (``--etcd-dir``): a production etcd has an SSD; this machine's disk swings 3x.

``--via plugin`` makes each simulated node what torchrun runs with ``--rdzv-backend etcd-v3``
instead: the plugin's handler (:mod:`membership.torch_handler`) and its
``next_rendezvous()``; with ``--keepalive per-lease`` each keeps its own lease alive from its
own thread, as a real torchrun agent does. A node whose lease expires while the machine is
saturated (the keep-alive thread late) takes a new one and joins again ("leases retaken").

Usage::

    python benchmarks/rendezvous_scale.py [--nodes 8,32,128,256,512,1024] [--processes 4]
        [--workers 8] [--round-timeout 60] [--steady 10] [--json out.json]
    python benchmarks/rendezvous_scale.py --via plugin --keepalive per-lease --nodes 512 \
        --backends elastic-run --steady 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import queue
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OURS = "elastic-run"
MIN_STEADY_WINDOW_S = 1.0  # a shorter steady window (--steady 0) gives no rates
C10D = "c10d"
KEEPALIVE_PATH = "/v3/lease/keepalive"
LARGE_JOB = (1024, 8)  # nodes x workers of the computed figure


@dataclass
class RoundResult:
    """One rendezvous round of N nodes on one backend.

    Attributes:
        backend: ``elastic-run`` or ``c10d``.
        nodes: N.
        round_s: Common start to the last node having the world; ``None`` if incomplete.
        completed: Nodes that had the world within the cap.
        cap_s: The cap (``--round-timeout``).
        cas_attempts: Compare-and-swap transactions sent during the round.
        cas_lost: Those that lost (a conflict).
        errors: Nodes that failed with an exception.
        detail: elastic-run: CAS attempts by key (``generation``, ``leader``, ``world``) and
            the world record's size.
    """

    backend: str
    nodes: int
    round_s: float | None
    completed: int
    cap_s: float
    cas_attempts: int
    cas_lost: int
    errors: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadResult:
    """elastic-run's steady etcd load after a round, measured and predicted, and a loss round."""

    nodes: int
    workers: int
    window_s: float
    keepalives_per_s: float
    watches: int
    watch_streams_per_s: float
    other_requests_per_s: float
    predicted: dict[str, float]
    loss_round_s: float | None = None
    loss_round_cas: int = 0
    loss_completed: int = 0


def predicted_load(nodes: int, *, ttl: int | None = None,
                   idle_reconnect: timedelta | None = None) -> dict[str, float]:
    """What the protocol costs etcd in steady state for ``nodes`` nodes (any workers each).

    One lease per node (workers hold none), refreshed every ``keep_alive_period(ttl)``; one
    watch per node on the run's control keys, plus the leader's watch of the node records;
    an idle watch stream is re-opened every ``idle_reconnect``; each node reads its own record
    every ``RECORD_CHECK_S`` (to put it back if someone overwrote it). Nothing is written while
    membership does not change. Defaults: the node lease TTL of ``--inplace-ttl`` and the
    client's idle reconnect.
    """
    from membership.config import DEFAULTS
    from membership.etcd import WATCH_IDLE_RECONNECT, keep_alive_period
    from membership.job import RECORD_CHECK_S

    ttl = int(DEFAULTS["member_ttl"]) if ttl is None else ttl
    idle = (idle_reconnect or WATCH_IDLE_RECONNECT).total_seconds()
    watches = nodes + 1
    return {"ttl_s": float(ttl), "keepalive_period_s": keep_alive_period(ttl),
            "leases": float(nodes), "keepalives_per_s": nodes / keep_alive_period(ttl),
            "watches": float(watches), "watch_streams_per_s": watches / idle,
            "reads_per_s": nodes / RECORD_CHECK_S, "writes_per_s": 0.0}


# --------------------------------------------------------------------------------------------
# Inside each elastic-run process


class _Counters:
    """Counts the requests, CAS transactions and watch streams of every client in a process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.cas: Counter[str] = Counter()
        self.cas_lost: Counter[str] = Counter()
        self.streams = 0
        self.world_writes: list[float] = []
        self.watches: list[weakref.ref[Any]] = []

    def install(self) -> None:
        from membership import _etcd_watch
        from membership.etcd import EtcdClient

        counters = self
        call, cas = EtcdClient.call, EtcdClient.cas
        stream_init, watch_init = _etcd_watch._Stream.__init__, _etcd_watch.PrefixWatch.__init__

        def counted_call(client: Any, path: str, payload: dict[str, Any], **kw: Any) -> Any:
            with counters.lock:
                counters.calls[path] += 1
            return call(client, path, payload, **kw)

        def counted_cas(client: Any, key: str, *args: Any, **kw: Any) -> Any:
            kind = key.rstrip("/").rsplit("/", 1)[-1]
            with counters.lock:  # before the call: its effect may be seen before it returns
                counters.cas[kind] += 1
                if kind == "world":
                    counters.world_writes.append(time.time())
            written, current = cas(client, key, *args, **kw)
            with counters.lock:
                counters.cas_lost[kind] += not written
            return written, current

        def counted_stream(stream: Any, *args: Any, **kw: Any) -> None:
            with counters.lock:
                counters.streams += 1
            stream_init(stream, *args, **kw)

        def tracked_watch(watch: Any, *args: Any, **kw: Any) -> None:
            watch_init(watch, *args, **kw)
            with counters.lock:
                counters.watches.append(weakref.ref(watch))

        EtcdClient.call = counted_call  # type: ignore[method-assign,assignment]
        EtcdClient.cas = counted_cas  # type: ignore[method-assign,assignment]
        _etcd_watch._Stream.__init__ = counted_stream  # type: ignore[method-assign,assignment]
        _etcd_watch.PrefixWatch.__init__ = tracked_watch  # type: ignore[method-assign,assignment]

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            live = sum(1 for ref in self.watches
                       if (w := ref()) is not None and not w._stop.is_set())
            return {"calls": dict(self.calls), "cas": dict(self.cas),
                    "world_writes": list(self.world_writes),
                    "cas_lost": dict(self.cas_lost), "streams": self.streams, "watches": live}


def _keepalive_process(endpoint: str, leases: Any, conn: Any, threads: int) -> None:
    """Refreshes the leases of one node process's simulated nodes, in a process of its own.

    Each lease is refreshed by its own keep-alive request every ``keep_alive_period(ttl)``,
    at its own phase (its grant time), as independent agents refresh theirs: etcd receives
    exactly the requests that one :class:`~membership.etcd.Lease` thread per node would send.
    The client side is cheaper: requests are written and their chunked replies read on plain
    sockets, and, in a process of its own, the refreshes do not wait for the GIL behind the
    hundreds of simulated nodes of their process (on this machine all of them share two
    cores; each real agent refreshes its one lease on its own machine). ``leases`` brings
    ``("add", id, ttl)`` and ``("drop", id)``; ``conn`` answers ``"count"`` with
    ``(refreshes, lost)`` so far.
    """
    import heapq

    from membership.etcd import keep_alive_period

    lock = threading.Condition()
    heap: list[tuple[float, int, float]] = []  # (next refresh, lease id, period)
    live: set[int] = set()
    work: queue.SimpleQueue[tuple[int, float]] = queue.SimpleQueue()
    counts = {"refreshes": 0, "lost": 0}

    def follow() -> None:
        while True:
            message = leases.get()
            with lock:
                if message[0] == "add":
                    period = keep_alive_period(message[2])
                    live.add(message[1])
                    # First refresh at once: the node's process may have held the grant's
                    # reply for a while (hundreds of threads share its GIL), which no real
                    # agent, alone on its machine, does.
                    heapq.heappush(heap, (time.monotonic(), message[1], period))
                    lock.notify()
                else:
                    live.discard(message[1])

    def schedule() -> None:  # hands each lease to a refresher when it is due
        while True:
            with lock:
                while not heap or heap[0][0] > time.monotonic():
                    lock.wait(heap[0][0] - time.monotonic() if heap else None)
                due, lid, period = heapq.heappop(heap)
                if lid not in live:
                    continue
                heapq.heappush(heap, (due + period, lid, period))
            work.put((lid, period))

    def refresh() -> None:
        host, port = endpoint.rsplit(":", 1)
        sock: socket.socket | None = None
        while True:
            lid, period = work.get()
            try:
                if sock is None:
                    sock = socket.create_connection((host, int(port)), timeout=period)
                alive = _keep_alive_once(sock, lid)
            except (OSError, ValueError):
                if sock is not None:  # etcd busy: the next period tries again, as Lease does
                    sock.close()
                sock = None
                continue
            with lock:
                counts["refreshes"] += 1
                if not alive:
                    counts["lost"] += 1
                    live.discard(lid)

    threading.Thread(target=schedule, daemon=True).start()
    threading.Thread(target=follow, daemon=True).start()
    for _ in range(threads):
        threading.Thread(target=refresh, daemon=True).start()
    while True:
        try:
            if conn.recv() != "count":
                break
            with lock:
                conn.send((counts["refreshes"], counts["lost"]))
        except (EOFError, OSError):
            break
    os._exit(0)


def _keep_alive_once(sock: socket.socket, lease_id: int) -> bool:
    """``POST /v3/lease/keepalive`` for one lease; whether etcd still holds it."""
    body = json.dumps({"ID": str(lease_id)}).encode()
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (KEEPALIVE_PATH.encode(), len(body), body))
    reply = b""
    while not reply.endswith(b"\r\n0\r\n\r\n"):  # the end of a chunked reply
        data = sock.recv(65536)
        if not data:
            raise ValueError("etcd closed the connection")
        reply += data
    if not reply.startswith(b"HTTP/1.1 200"):
        raise ValueError(reply[:80].decode(errors="replace"))
    ttl = re.search(rb'"TTL":"(-?\d+)"', reply)
    return ttl is not None and int(ttl.group(1)) > 0  # etcd omits a TTL of 0: lease gone


def _share_world_parses() -> None:
    """Parses each world record once per process, not once per simulated node.

    Every agent parses the world after each change; a real agent does it once, on its own
    machine (about 5 ms for 1024 nodes x 8 workers here). The 256 simulated nodes of one
    process would do it 256 times on the same two cores, which measures the simulation, not
    the protocol. Each node still receives the record on its own watch stream and decodes the
    stream's message; only the parsed record (immutable) is shared.
    """
    from elastic.contract.records import WorldRecord

    parse = WorldRecord.loads.__func__  # type: ignore[attr-defined]
    cache: dict[tuple[str, int, bytes], WorldRecord] = {}
    lock = threading.Lock()

    def loads(cls: type[WorldRecord], raw: bytes, key: str, *, revision: int = 0
              ) -> WorldRecord:
        with lock:
            hit = cache.get((key, revision, raw))
        if hit is None:
            hit = parse(cls, raw, key, revision=revision)
            with lock:
                if len(cache) > 64:
                    cache.clear()
                cache[(key, revision, raw)] = hit
        return hit

    WorldRecord.loads = classmethod(loads)  # type: ignore[method-assign,assignment]


def _client_class(leases: Any) -> Any:
    """The real client, or one whose leases the keep-alive process refreshes."""
    from membership.etcd import EtcdClient, Lease

    if leases is None:
        return EtcdClient

    class PooledLease(Lease):
        def _run(self) -> None:  # refreshed by the keep-alive process, not by this thread
            pass

        def stop(self) -> None:
            super().stop()
            leases.put(("drop", self.id))

        def revoke(self) -> None:
            leases.put(("drop", self.id))
            super().revoke()

    class PooledClient(EtcdClient):
        def lease(self, ttl: int, *, on_lost: Any = None) -> Lease:
            lease = PooledLease(self, ttl, on_lost=on_lost)
            leases.put(("add", lease.id, lease.ttl))  # at once, no thread to wait for
            return lease

    return PooledClient


class _SimNode:
    """One simulated node: a node agent's membership, no workers."""

    def __init__(self, client: Any, prefix: str, job: str, nodes: int, workers: int,
                 ttl: int, index: int, via: str = "membership") -> None:
        from elastic.contract.records import NodeRecord, WorkerSlot
        from membership.job import new_node_id

        self.client = client
        self.prefix, self.job, self.nodes, self.ttl = prefix, job, nodes, ttl
        self.via = via
        self.record = NodeRecord(
            node=new_node_id(f"sim{index}"), host=f"sim{index}", addr="127.0.0.1",
            agent_pid=os.getpid(), store_port=20000 + index, probe_port=40000 + index,
            workers=tuple(WorkerSlot(i, 1, True, True, 0) for i in range(workers)))
        self.run: Any = None
        self.done: float | None = None
        self.phases: dict[str, float] = {}
        self.error = ""

    def join(self, timeout: float) -> None:
        """What an agent does at start: choose the run, publish itself, follow the world."""
        from membership.decide import RunLimits
        from membership.generation import open_run
        from membership.job import RunMembership
        from membership.keys import JobKeys

        if self.via == "plugin":
            self._join_through_the_plugin(timeout)
            return
        try:
            opened = open_run(self.client, JobKeys(self.prefix, self.job))
            self.phases["open_run"] = time.time()
            self.run = RunMembership(self.client, opened.keys,
                                     limits=RunLimits(self.nodes, self.nodes, 1.0),
                                     ttl=self.ttl)
            self.phases["watching"] = time.time()
            self.run.join(self.record)
            self.phases["joined"] = time.time()
            if self.run.wait(lambda v: (w := v.world()) is not None
                             and len(w.members) == self.nodes, timeout):
                self.done = time.time()
        except Exception as exc:  # reported, not raised: the parent counts errors
            self.error = repr(exc)

    def _join_through_the_plugin(self, timeout: float) -> None:
        """What torchrun's agent does with ``--rdzv-backend etcd-v3``: the plugin's handler
        (its own lease, kept alive by its own thread), then ``next_rendezvous()``."""
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from membership.config import RdzvConf
        from membership.torch_handler import EtcdV3RendezvousHandler

        try:
            conf = RdzvConf.parse({"key_prefix": self.prefix, "member_ttl": self.ttl,
                                   "last_call_timeout": 1.0, "join_timeout": timeout})
            params = RendezvousParameters("etcd-v3", ",".join(self.client.config.endpoints),
                                          self.job, self.nodes, self.nodes,
                                          local_addr="127.0.0.1")
            handler = EtcdV3RendezvousHandler(params, self.client, conf)
            self.run = handler._run
            self.phases["open_run"] = self.phases["watching"] = time.time()
            handler.next_rendezvous()
            self.phases["joined"] = self.done = time.time()
        except Exception as exc:  # reported, not raised: the parent counts errors
            self.error = repr(exc)

    def epoch(self) -> int:
        world = self.run.world() if self.run is not None else None
        return world.epoch if world is not None else 0


def _ours_process(conn: Any, endpoint: str, prefix: str, job: str, first: int, count: int,
                  nodes: int, workers: int, ttl: int, leases: Any, via: str) -> None:
    """Runs ``count`` simulated nodes as threads, driven by the parent over ``conn``."""
    logging.basicConfig(level=logging.ERROR)
    # A node leaving looks like a loss to the others; not news here.
    logging.getLogger("elastic").setLevel(logging.CRITICAL)
    from membership.etcd import EtcdConfig

    counters = _Counters()
    counters.install()
    _share_world_parses()
    client_cls = _client_class(leases)
    config = EtcdConfig(endpoints=(endpoint,), request_timeout=timedelta(seconds=20),
                        deadline=timedelta(seconds=120))
    sims = [_SimNode(client_cls(config), prefix, job, nodes, workers, ttl, first + i, via)
            for i in range(count)]
    conn.send(("ready",))
    try:
        while True:
            command, *args = conn.recv()
            if command == "go":
                go, timeout = args
                time.sleep(max(0.0, go - time.time()))
                before = counters.snapshot()
                threads = [threading.Thread(target=s.join, args=(timeout,), daemon=True)
                           for s in sims]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(max(0.0, go + timeout + 1.0 - time.time()))
                world = next((s.run.world() for s in sims if s.done is not None), None)
                conn.send(("round", [s.done for s in sims], [s.error for s in sims if s.error],
                           before, counters.snapshot(),
                           len(world.dumps()) if world is not None else 0,
                           max(s.epoch() for s in sims), [s.phases for s in sims],
                           sum(s.run.node.rejoins for s in sims if s.run is not None)))
            elif command == "counters":
                conn.send(("counters", counters.snapshot()))
            elif command == "loss":
                leave, epoch, timeout = args
                stay = sims
                left_at = None
                if leave:
                    victim = next(s for s in sims if s.run is not None
                                  and not s.run.leader.leading)
                    stay = [s for s in sims if s is not victim]
                    left_at = time.time()
                    victim.run.leave()
                done: list[float | None] = [None] * len(stay)

                def wait(i: int, sim: _SimNode, epoch: int = epoch, timeout: float = timeout,
                         done: list[float | None] = done) -> None:
                    if sim.run is not None and sim.run.wait(
                            lambda v: (w := v.world()) is not None and w.epoch > epoch,
                            timeout):
                        done[i] = time.time()

                waiters = [threading.Thread(target=wait, args=(i, s), daemon=True)
                           for i, s in enumerate(stay)]
                for t in waiters:
                    t.start()
                until = time.time() + timeout + 1.0
                for t in waiters:
                    t.join(max(0.0, until - time.time()))
                conn.send(("loss", left_at, done))
            elif command == "halt":
                for s in sims:
                    if s.run is not None:
                        s.run.leader.stop()
                conn.send(("halted",))
            elif command == "stop":
                for s in sims:
                    if s.run is not None:
                        with contextlib.suppress(Exception):
                            s.run.leave()
                conn.send(("stopped",))
                return
    finally:
        conn.close()
        os._exit(0)  # daemon threads (watches, pools) need no joining


# --------------------------------------------------------------------------------------------
# The parent: elastic-run


def _recv(conn: Any, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} from a node process within {timeout:.0f} s")
    return conn.recv()


def _sum(snapshots: list[dict[str, Any]], field: str) -> Counter[str]:
    total: Counter[str] = Counter()
    for snap in snapshots:
        total.update(snap[field])
    return total


def _delta(after: list[dict[str, Any]], before: list[dict[str, Any]], field: str
           ) -> Counter[str]:
    diff = _sum(after, field)
    diff.subtract(_sum(before, field))
    return diff


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes used so far; 0 for one that is gone."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue
    return total


def ours_round(nodes: int, processes: int, endpoint: str, *, workers: int, ttl: int,
               cap: float, steady: float, keepalive: str, etcd_pid: int = 0,
               prefix: str = "/bench", via: str = "membership"
               ) -> tuple[RoundResult, LoadResult | None]:
    """One round of ``nodes`` simulated nodes, then the steady load and a loss round."""
    ctx = mp.get_context("spawn")
    job = f"scale-{nodes}-{uuid.uuid4().hex[:6]}"
    procs_n = min(processes, nodes)
    per = [nodes // procs_n + (1 if i < nodes % procs_n else 0) for i in range(procs_n)]
    pipes = [ctx.Pipe() for _ in per]
    procs, helpers, kconns = [], [], []
    queues = []  # referenced until the end: a started Process drops its arguments
    first = 0
    for (_parent_end, child_end), count in zip(pipes, per, strict=True):
        leases = None
        if keepalive == "pooled":
            leases, (kparent, kchild) = ctx.SimpleQueue(), ctx.Pipe()
            queues.append(leases)
            helpers.append(ctx.Process(target=_keepalive_process, daemon=True, args=(
                endpoint, leases, kchild, max(1, count // 16))))
            kconns.append(kparent)
        procs.append(ctx.Process(target=_ours_process, daemon=True, args=(
            child_end, endpoint, prefix, job, first, count, nodes, workers, ttl, leases,
            via)))
        first += count
    conns = [p for p, _ in pipes]
    for p in [*helpers, *procs]:
        p.start()
    load: LoadResult | None = None
    result: RoundResult | None = None
    try:
        for c in conns:
            _recv(c, 120, "ready")
        go = time.time() + 1.0
        for c in conns:
            c.send(("go", go, cap))
        pids = [p.pid for p in procs if p.pid], [p.pid for p in helpers if p.pid]
        cpu0 = [_cpu_seconds(x) for x in ([etcd_pid], *pids)]
        replies = [_recv(c, cap + 60, "round result") for c in conns]
        cpu1 = [_cpu_seconds(x) for x in ([etcd_pid], *pids)]
        for c in kconns:
            c.send("count")
        leases_lost = sum(_recv(c, 60, "keep-alive count")[1] for c in kconns)
        done = [t for r in replies for t in r[1]]
        errors = [e for r in replies for e in r[2]]
        before, after = [r[3] for r in replies], [r[4] for r in replies]
        finished = [t for t in done if t is not None]
        cas, lost = _delta(after, before, "cas"), _delta(after, before, "cas_lost")
        result = RoundResult(
            OURS, nodes, max(finished) - go if len(finished) == nodes else None,
            len(finished), cap, sum(cas.values()), sum(lost.values()), len(errors),
            detail={"cas_by_key": dict(cas), "world_bytes": max(r[5] for r in replies),
                    "first_error": errors[0] if errors else "",
                    "phases_s": _phases(go, [p for r in replies for p in r[7]],
                                        [t for a in after for t in a["world_writes"]]),
                    "cpu_s": {"etcd": round(cpu1[0] - cpu0[0], 2),
                              "nodes": round(cpu1[1] - cpu0[1], 2),
                              "keep-alives": round(cpu1[2] - cpu0[2], 2)},
                    "leases_lost": leases_lost,
                    "rejoins": sum(r[8] for r in replies)})
        if len(finished) == nodes:
            epoch = max(r[6] for r in replies)
            try:
                load = _steady_and_loss(conns, kconns, nodes, workers, ttl, steady, cap, epoch)
            except (TimeoutError, EOFError, OSError) as exc:
                # The round is measured and complete: a failure in the window after it
                # costs the steady-load row, not the round.
                print(f"warning: {OURS} N={nodes}: the round completed, but the steady load "
                      f"after it could not be measured: {exc}", file=sys.stderr, flush=True)
                result.detail["steady_error"] = repr(exc)
        for c in conns:
            c.send(("halt",))
        for c in conns:
            _recv(c, 60, "halt")
        for c in conns:
            c.send(("stop",))
        for c in conns:
            with contextlib.suppress(TimeoutError, EOFError, OSError):
                _recv(c, 120, "stop")
    except (TimeoutError, EOFError, OSError) as exc:
        print(f"warning: {OURS} N={nodes}: {exc}", file=sys.stderr, flush=True)
        if result is None:
            result = RoundResult(OURS, nodes, None, 0, cap, 0, 0, nodes,
                                 detail={"first_error": repr(exc)})
    finally:
        for c in kconns:
            with contextlib.suppress(OSError):
                c.send("stop")
        for p in [*procs, *helpers]:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        queues.clear()
    return result, load


def _phases(go: float, phases: list[dict[str, float]], world_writes: list[float]
            ) -> dict[str, float]:
    """When, after the start, the nodes were through each step (median and last), and when
    the first world was written: where a round's time goes."""
    out: dict[str, float] = {}
    for name in ("open_run", "watching", "joined"):
        times = sorted(p[name] - go for p in phases if name in p)
        if times:
            out[f"{name}_median"] = round(statistics.median(times), 3)
            out[f"{name}_last"] = round(times[-1], 3)
    if world_writes:
        out["world_written"] = round(min(world_writes) - go, 3)
    return out


def _pooled_refreshes(kconns: list[Any]) -> int:
    for c in kconns:
        c.send("count")
    return sum(_recv(c, 60, "keep-alive count")[0] for c in kconns)


def _steady_and_loss(conns: list[Any], kconns: list[Any], nodes: int, workers: int,
                     ttl: int, steady: float, cap: float, epoch: int) -> LoadResult:
    time.sleep(1.0)  # the round's last watch events and writes settle
    for c in conns:
        c.send(("counters",))
    before = [_recv(c, 60, "counters")[1] for c in conns]
    pooled = _pooled_refreshes(kconns)
    began = time.monotonic()
    time.sleep(steady)
    for c in conns:
        c.send(("counters",))
    after = [_recv(c, 60, "counters")[1] for c in conns]
    pooled = _pooled_refreshes(kconns) - pooled
    window = time.monotonic() - began
    calls = _delta(after, before, "calls")
    keepalives = calls.pop(KEEPALIVE_PATH, 0) + pooled
    streams = sum(a["streams"] for a in after) - sum(b["streams"] for b in before)
    load = LoadResult(
        nodes=nodes, workers=workers, window_s=window, keepalives_per_s=keepalives / window,
        watches=sum(a["watches"] for a in after), watch_streams_per_s=streams / window,
        other_requests_per_s=sum(calls.values()) / window,
        predicted=predicted_load(nodes, ttl=ttl))
    if nodes < 2:
        return load
    for i, c in enumerate(conns):
        c.send(("loss", i == 0, epoch, cap))
    replies = [_recv(c, cap + 60, "loss round") for c in conns]
    left_at = replies[0][1]
    done = [t for r in replies for t in r[2]]
    finished = [t for t in done if t is not None]
    for c in conns:
        c.send(("counters",))
    final = [_recv(c, 60, "counters")[1] for c in conns]
    load.loss_completed = len(finished)
    load.loss_round_s = max(finished) - left_at if len(finished) == len(done) else None
    load.loss_round_cas = (sum(_sum(final, "cas").values()) - sum(_sum(after, "cas").values()))
    return load


# --------------------------------------------------------------------------------------------
# torch's c10d dynamic rendezvous


class _SetStateCounter:
    """Counts ``set_state`` calls (each a compare-and-swap of the whole pickled state) and the
    lost ones, per thread (one thread = one node)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def wrap(self, backend_cls: Any) -> None:
        original = backend_cls.set_state
        counter = self

        def counted(self: Any, state: bytes, token: Any = None) -> Any:
            result = original(self, state, token)
            counter.local.writes = getattr(counter.local, "writes", 0) + 1
            if result is not None and not result[2]:
                counter.local.lost = getattr(counter.local, "lost", 0) + 1
            return result

        backend_cls.set_state = counted

    def read(self) -> tuple[int, int]:
        return getattr(self.local, "writes", 0), getattr(self.local, "lost", 0)


def _c10d_process(endpoint: str, run_id: str, nodes: int, count: int, cap: float,
                  ready: Any, start_at: Any, results: Any, finished: Any) -> None:
    """Runs ``count`` c10d handlers as threads; puts one result tuple each on ``results``."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        registry,  # noqa: F401  (registers c10d)
    )
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    counter = _SetStateCounter()
    counter.wrap(C10dRendezvousBackend)
    params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id=run_id,
                                  min_nodes=nodes, max_nodes=nodes, local_addr="127.0.0.1",
                                  join_timeout=cap + 30, last_call_timeout=1, is_host=False)
    handlers = [rendezvous_handler_registry.create_handler(params) for _ in range(count)]
    ready.release()
    try:
        go = start_at.get(timeout=300)
    except queue.Empty:
        os._exit(0)
    time.sleep(max(0.0, go - time.time()))

    def join(handler: Any) -> None:
        try:
            handler.next_rendezvous()
            writes, lost = counter.read()
            results.put((time.time(), writes, lost, ""))
        except Exception as exc:  # reported, not raised: the parent counts errors
            writes, lost = counter.read()
            results.put((time.time(), writes, lost, repr(exc)))

    for handler in handlers:
        threading.Thread(target=join, args=(handler,), daemon=True).start()
    # Stay in the round (keep-alives running) until the parent has every result or gave up.
    finished.wait(cap + 120)
    os._exit(0)  # a handler still inside next_rendezvous() cannot be stopped otherwise


def c10d_round(nodes: int, processes: int, endpoint: str, cap: float) -> RoundResult:
    """One c10d round of ``nodes`` handlers; incomplete (not a crash) past ``cap``."""
    ctx = mp.get_context("spawn")
    run_id = f"scale-c10d-{nodes}-{uuid.uuid4().hex[:6]}"
    procs_n = min(processes, nodes)
    per = [nodes // procs_n + (1 if i < nodes % procs_n else 0) for i in range(procs_n)]
    ready, results, finished, start_at = ctx.Semaphore(0), ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_c10d_process, daemon=True,
                         args=(endpoint, run_id, nodes, k, cap, ready, start_at, results,
                               finished))
             for k in per]
    for p in procs:
        p.start()
    got: list[tuple[float, int, int, str]] = []
    go = time.time()
    try:
        if all(ready.acquire(timeout=300) for _ in procs):
            go = time.time() + 1.0
            for _ in procs:
                start_at.put(go)
            deadline = go + cap
            while len(got) < nodes and time.time() < deadline:
                with contextlib.suppress(queue.Empty):
                    got.append(results.get(timeout=max(0.05, min(1.0, deadline - time.time()))))
        else:
            print(f"warning: {C10D} N={nodes}: a node process did not get ready",
                  file=sys.stderr, flush=True)
    finally:
        finished.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    ok = [g for g in got if not g[3]]
    errors = [g[3] for g in got if g[3]]
    complete = len(ok) == nodes
    return RoundResult(C10D, nodes, max(g[0] for g in ok) - go if complete else None, len(ok),
                       cap, sum(g[1] for g in got), sum(g[2] for g in got), len(errors),
                       detail={"first_error": errors[0] if errors else ""})


# --------------------------------------------------------------------------------------------
# Report


def _fmt_round(r: RoundResult | None) -> str:
    if r is None:
        return "not run"
    if r.round_s is None:
        return f"incomplete ({r.completed} of {r.nodes} in {r.cap_s:g} s)"
    return f"{r.round_s:.2f}"


def _median_round(rounds: list[RoundResult]) -> RoundResult | None:
    if not rounds:
        return None
    complete = [r for r in rounds if r.round_s is not None]
    if len(complete) < len(rounds):
        return next(r for r in rounds if r.round_s is None)
    times = sorted(r.round_s for r in complete if r.round_s is not None)
    return min(complete, key=lambda r: abs((r.round_s or 0) - statistics.median(times)))


def report(rounds: list[RoundResult], loads: list[LoadResult], nodes: list[int]) -> str:
    """The Markdown tables: rounds side by side, steady load, the computed large job."""
    lines = ["| N | elastic-run round (s) | c10d round (s) | elastic-run / c10d | "
             "elastic-run CAS attempts: generation + leader + world = total (per node) | "
             "c10d CAS attempts (lost) |", "|---|---|---|---|---|---|"]
    for n in nodes:
        ours = _median_round([r for r in rounds if r.backend == OURS and r.nodes == n])
        base = _median_round([r for r in rounds if r.backend == C10D and r.nodes == n])
        ratio = (f"{ours.round_s / base.round_s:.2f}" if ours and base and ours.round_s
                 and base.round_s else "-")
        cas = "-"
        if ours is not None and ours.cas_attempts:
            by = ours.detail.get("cas_by_key", {})
            cas = (f"{by.get('generation', 0)} + {by.get('leader', 0)} + {by.get('world', 0)}"
                   f" = {ours.cas_attempts} ({ours.cas_attempts / n:.2f})")
        base_cas = (f"{base.cas_attempts} ({base.cas_lost})" if base is not None else "-")
        lines.append(f"| {n} | {_fmt_round(ours)} | {_fmt_round(base)} | {ratio} | {cas} | "
                     f"{base_cas} |")
    lines += ["", "Steady etcd load of elastic-run after the round (measured at the clients "
              "over the window) against the protocol's prediction, and a loss round (one node "
              "leaves; every other node sees the next world):", "",
              "| N | keep-alives/s (predicted) | live watches (predicted) | "
              "watch streams opened/s (predicted) | other requests/s (predicted) | "
              "loss round (s) | loss round CAS attempts |",
              "|---|---|---|---|---|---|---|"]
    for load in sorted(loads, key=lambda x: x.nodes):
        p = load.predicted
        loss = (f"{load.loss_round_s:.2f}" if load.loss_round_s is not None
                else f"incomplete ({load.loss_completed} of {load.nodes - 1})")
        # Rates over a window shorter than the keep-alive period (--steady 0) mean nothing.
        measured = load.window_s >= MIN_STEADY_WINDOW_S

        def rate(value: float, digits: int, measured: bool = measured) -> str:
            return f"{value:.{digits}f}" if measured else "-"

        lines.append(
            f"| {load.nodes} | {rate(load.keepalives_per_s, 1)} ({p['keepalives_per_s']:.1f}) | "
            f"{load.watches} ({p['watches']:.0f}) | {rate(load.watch_streams_per_s, 1)} "
            f"({p['watch_streams_per_s']:.1f}) | {rate(load.other_requests_per_s, 2)} "
            f"({p['reads_per_s']:.2f}) | "
            f"{loss} | {load.loss_round_cas} |")
    big_nodes, big_workers = LARGE_JOB
    big = predicted_load(big_nodes)
    lines += [
        "",
        f"A {big_nodes}-node x {big_workers}-worker job, computed from the protocol's defaults "
        f"(node lease TTL {big['ttl_s']:g} s, refreshed every {big['keepalive_period_s']:g} s; "
        "workers hold no lease and no watch): "
        f"{big['leases']:.0f} leases, **{big['keepalives_per_s']:.0f} keep-alives/s**, "
        f"**{big['watches']:.0f} watches** (one per node on the run's control keys, plus the "
        f"leader's on the node records), {big['watch_streams_per_s']:.0f} idle watch streams "
        f"re-opened/s, {big['reads_per_s']:.0f} reads/s (each node checks its own record), "
        "no writes while membership does not change. Per worker it would be "
        f"{big_nodes * big_workers} leases and watches.",
    ]
    return "\n".join(lines)


def goals(rounds: list[RoundResult]) -> list[str]:
    """The issue's goals, each with whether this run met it."""
    def of(backend: str, n: int) -> RoundResult | None:
        return _median_round([r for r in rounds if r.backend == backend and r.nodes == n])

    out = []
    big = of(OURS, 1024)
    if big is not None:
        met = big.round_s is not None and big.round_s < 10.0
        unit = " s" if big.round_s is not None else ""
        out.append(f"- goal: 1024 nodes complete a round in < 10 s: {_fmt_round(big)}{unit}: "
                   f"{'met' if met else 'NOT met'}")
    ours, base = of(OURS, 128), of(C10D, 128)
    if ours is not None and base is not None:
        met = (ours.round_s is not None
               and (base.round_s is None or ours.round_s <= base.round_s))
        out.append(f"- goal: at 128 nodes no slower than c10d: {_fmt_round(ours)} vs "
                   f"{_fmt_round(base)} (s): {'met' if met else 'NOT met'}")
    per_node = [(r.nodes, r.cas_attempts / r.nodes) for r in rounds
                if r.backend == OURS and r.round_s is not None]
    if per_node:
        world = sorted({r.detail.get("cas_by_key", {}).get("world", 0) for r in rounds
                        if r.backend == OURS and r.round_s is not None})
        out.append(
            "- CAS attempts per round: elastic-run "
            + ", ".join(f"{a:.2f}/node at N={n}" for n, a in per_node)
            + f": O(N), at most one create attempt per node for the job generation and one "
            f"for the leader key (only while nobody leads); world CAS per round: "
            f"{'/'.join(str(w) for w in world)} (O(1): the leader alone writes it)")
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; prints the tables (and writes ``--json`` if given)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", default="8,32,128,256,512,1024", help="comma-separated N values")
    p.add_argument("--backends", default=f"{OURS},{C10D}")
    p.add_argument("--processes", type=int, default=4, help="node processes per round")
    p.add_argument("--workers", type=int, default=8, help="worker slots per node record")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--round-timeout", type=float, default=60.0,
                   help="cap on one round; beyond it the round is reported incomplete")
    p.add_argument("--steady", type=float, default=10.0,
                   help="seconds of steady load counted after each elastic-run round (0: skip)")
    p.add_argument("--ttl", type=int, default=0,
                   help="node lease TTL in seconds (default: elastic-run's, --inplace-ttl)")
    p.add_argument("--via", choices=("membership", "plugin"), default="membership",
                   help="what each simulated node runs: the agent's membership, or torchrun's "
                   "plugin handler (next_rendezvous(); use with --keepalive per-lease)")
    p.add_argument("--keepalive", choices=("pooled", "per-lease"), default="pooled",
                   help="keep-alive threads of the simulated nodes (see the docstring)")
    p.add_argument("--etcd-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="where etcd keeps its data (default /dev/shm: memory, standing in "
                   "for the SSD a production etcd has; this machine's disk swings 3x)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    nodes = [int(n) for n in args.nodes.split(",")]
    backends = args.backends.split(",")
    unknown = set(backends) - {OURS, C10D}
    if unknown:
        p.error(f"--backends {args.backends!r}: unknown {sorted(unknown)}; use {OURS},{C10D}")

    from launch.etcd_server import EmbeddedEtcd, free_port
    from membership.config import DEFAULTS

    ttl = args.ttl or int(DEFAULTS["member_ttl"])
    rounds: list[RoundResult] = []
    loads: list[LoadResult] = []
    c10d_gave_up: int | None = None
    with tempfile.TemporaryDirectory(prefix="rdzv-scale-", dir=args.etcd_dir) as tmp:
        etcd = EmbeddedEtcd(data_dir=str(Path(tmp) / "etcd"))
        etcd.start()
        store: Any = None  # the c10d backend's store, served by this process
        if C10D in backends:
            import torch.distributed as dist

            port = free_port()
            store = dist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1", port, is_master=True, wait_for_workers=False,
                timeout=timedelta(seconds=args.round_timeout + 60))
        try:
            for _ in range(args.repeats):
                for n in nodes:
                    if OURS in backends:
                        r, load = ours_round(n, args.processes, etcd.endpoint,
                                             workers=args.workers, ttl=ttl,
                                             cap=args.round_timeout, steady=args.steady,
                                             keepalive=args.keepalive,
                                             etcd_pid=etcd.pid or 0, via=args.via)
                        rounds.append(r)
                        if load is not None:
                            loads.append(load)
                        by = r.detail.get("cas_by_key", {})
                        print(f"{OURS:11s} N={n:4d} round {_fmt_round(r):>9s}  CAS "
                              f"{r.cas_attempts:5d} (generation {by.get('generation', 0)}, "
                              f"leader {by.get('leader', 0)}, world {by.get('world', 0)})  "
                              f"world {r.detail.get('world_bytes', 0)} B  errors {r.errors}"
                              + (f" ({r.detail['first_error']})" if r.errors else ""),
                              flush=True)
                        print(f"{'':11s}        phases (s after the start): "
                              f"{r.detail.get('phases_s', {})}; CPU s "
                              f"{r.detail.get('cpu_s', {})}; leases lost "
                              f"{r.detail.get('leases_lost', 0)}; leases retaken "
                              f"{r.detail.get('rejoins', 0)}", flush=True)
                        if load is not None and load.window_s >= MIN_STEADY_WINDOW_S:
                            print(f"{'':11s}        keep-alives/s {load.keepalives_per_s:.1f} "
                                  f"(predicted {load.predicted['keepalives_per_s']:.1f})  "
                                  f"watches {load.watches} (predicted "
                                  f"{load.predicted['watches']:.0f})  loss round "
                                  f"{load.loss_round_s}", flush=True)
                    if C10D in backends:
                        if c10d_gave_up is not None and n > c10d_gave_up:
                            print(f"{C10D:11s} N={n:4d} not run: incomplete at "
                                  f"N={c10d_gave_up}", flush=True)
                            continue
                        r = c10d_round(n, args.processes, f"127.0.0.1:{port}",
                                       args.round_timeout)
                        rounds.append(r)
                        if r.round_s is None:
                            c10d_gave_up = n
                        print(f"{C10D:11s} N={n:4d} round {_fmt_round(r):>9s}  CAS "
                              f"{r.cas_attempts:5d} (lost {r.cas_lost})  errors {r.errors}",
                              flush=True)
        finally:
            etcd.stop()
            del store
    print()
    print(f"Rendezvous of N simulated nodes ({args.processes} processes, {args.workers} "
          f"worker slots per node record, one etcd, cap {args.round_timeout:g} s per round, "
          f"{args.repeats} repeat(s), medians).")
    print()
    print(report(rounds, loads, nodes))
    print()
    print("\n".join(goals(rounds)))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"rounds": [asdict(r) for r in rounds], "loads": [asdict(x) for x in loads],
             "large_job": {"nodes": LARGE_JOB[0], "workers": LARGE_JOB[1],
                           **predicted_load(LARGE_JOB[0])}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
