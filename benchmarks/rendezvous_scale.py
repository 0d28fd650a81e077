"""Rendezvous at scale: N simulated agents completing one round, etcd v3 versus torch's c10d.

Each simulated agent is a thread that builds a real rendezvous handler (ours through
``elastic.rendezvous.create_rdzv_handler``, torch's through its ``c10d`` registry entry) and calls
``next_rendezvous()``; no workers are started. Agents are spread over ``--processes`` processes
(one torch import each) so that their requests really are concurrent. ``min_nodes = max_nodes =
N``, so the round closes the moment the N-th agent joins and no last-call wait is measured.

For each backend and N it reports, as medians over ``--repeats`` rounds:

- **round time**: the common start to the last agent leaving ``next_rendezvous()``;
- **CAS writes / conflicts**: ``set_state`` calls, and how many lost the compare-and-swap race
  (each loss costs a re-read and a retry);
- **state size**: bytes of the pickled rendezvous state at the end (every write carries it all).

The c10d baseline (a ``TCPStore`` served by this process) runs in the same invocation, so the
ratio between the two is meaningful even though absolute times drift on a shared machine.

Usage::

    python benchmarks/rendezvous_scale.py [--nodes 8,32,128] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOIN_TIMEOUT_S = 600.0


@dataclass
class AgentResult:
    """What one simulated agent saw."""

    done: float  # time.time() when next_rendezvous() returned
    rank: int
    world: int
    cas_writes: int
    cas_conflicts: int
    error: str = ""


@dataclass
class RoundResult:
    """One rendezvous round of N agents on one backend."""

    backend: str
    nodes: int
    round_s: float
    cas_writes: int
    cas_conflicts: int
    state_bytes: int
    errors: int


# --------------------------------------------------------------------------------------------
# Inside each agent process


class _CasCounter:
    """Counts ``set_state`` calls and lost compare-and-swaps per thread (one thread = one agent)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def wrap(self, backend_cls: Any) -> None:
        original = backend_cls.set_state
        counter = self

        def counted(self: Any, state: bytes, token: Any = None) -> Any:
            result = original(self, state, token)
            counter.local.writes = getattr(counter.local, "writes", 0) + 1
            if result is not None and not result[2]:
                counter.local.conflicts = getattr(counter.local, "conflicts", 0) + 1
            return result

        backend_cls.set_state = counted

    def read(self) -> tuple[int, int]:
        return getattr(self.local, "writes", 0), getattr(self.local, "conflicts", 0)


def _params(backend: str, endpoint: str, run_id: str, nodes: int) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    config: dict[str, Any] = {"join_timeout": JOIN_TIMEOUT_S, "last_call_timeout": 1}
    if backend == "etcd-v3":
        config["deadline"] = 60
    else:
        config["is_host"] = False
    return RendezvousParameters(backend=backend, endpoint=endpoint, run_id=run_id,
                                min_nodes=nodes, max_nodes=nodes, local_addr="127.0.0.1",
                                **config)


def _agent_process(backend: str, endpoint: str, run_id: str, nodes: int, agents: int,
                   ready: Any, start_at: Any, results: Any, finished: Any) -> None:
    """Runs ``agents`` simulated agents as threads; puts one ``AgentResult`` each on ``results``."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    sys.path.insert(0, str(REPO))
    # Agents leaving at the end look like lost members to those still watching; not news here.
    logging.getLogger("elastic").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    from torch.distributed.elastic.rendezvous import registry  # noqa: F401  (registers c10d)
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    counter = _CasCounter()
    if backend == "etcd-v3":
        from elastic._rdzv_backend import EtcdV3RendezvousBackend

        from elastic.rendezvous import create_rdzv_handler

        counter.wrap(EtcdV3RendezvousBackend)
        make = create_rdzv_handler
    else:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )

        counter.wrap(C10dRendezvousBackend)
        make = rendezvous_handler_registry.create_handler  # type: ignore[assignment]

    handlers = [make(_params(backend, endpoint, run_id, nodes)) for _ in range(agents)]
    ready.release()
    go = start_at.get(timeout=JOIN_TIMEOUT_S)
    time.sleep(max(0.0, go - time.time()))

    def join(handler: Any) -> None:
        try:
            info = handler.next_rendezvous()
            done = time.time()
            writes, conflicts = counter.read()
            results.put(AgentResult(done, info.rank, info.world_size, writes, conflicts))
        except Exception as exc:  # reported, not raised: the parent counts errors
            writes, conflicts = counter.read()
            results.put(AgentResult(time.time(), -1, -1, writes, conflicts, repr(exc)))

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    # Stay in the round (keep-alives running) until every process is done, then leave.
    finished.wait(JOIN_TIMEOUT_S)
    for h in handlers:
        with contextlib.suppress(Exception):  # shutting down a benchmark; nothing to save
            h.shutdown()


# --------------------------------------------------------------------------------------------
# The parent


def _state_bytes(backend: str, endpoint: str, run_id: str, store: Any) -> int:
    if backend == "etcd-v3":
        from elastic.etcd import EtcdClient, EtcdConfig, parse_endpoints

        client = EtcdClient(EtcdConfig(endpoints=parse_endpoints(endpoint)))
        try:
            kv = client.get(f"/elastic/{run_id}/rdzv/state")
            if kv is None:  # key layout changed: fall back to the largest key of the run
                kvs = client.get_prefix(f"/elastic/{run_id}/")
                return max((len(k.value) for k in kvs), default=0)
            return len(kv.value)
        finally:
            client.close()
    return len(store.get(f"torch.rendezvous.{run_id}"))


def one_round(backend: str, nodes: int, processes: int, endpoint: str, store: Any,
              seq: int) -> RoundResult:
    """Runs one round of ``nodes`` agents on ``backend``; returns what it measured."""
    ctx = mp.get_context("spawn")
    run_id = f"scale-{backend}-{nodes}-{seq}-{os.getpid()}"
    procs_n = min(processes, nodes)
    per = [nodes // procs_n + (1 if i < nodes % procs_n else 0) for i in range(procs_n)]
    ready, results, finished = ctx.Semaphore(0), ctx.Queue(), ctx.Event()
    start_at = ctx.Queue()
    procs = [ctx.Process(target=_agent_process, daemon=True,
                         args=(backend, endpoint, run_id, nodes, k, ready, start_at, results,
                               finished))
             for k in per]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if not ready.acquire(timeout=JOIN_TIMEOUT_S):
                raise RuntimeError("an agent process did not get ready")
        go = time.time() + 0.5
        for _ in procs:
            start_at.put(go)
        agents = [results.get(timeout=JOIN_TIMEOUT_S) for _ in range(nodes)]
        state = _state_bytes(backend, endpoint, run_id, store)
    finally:
        finished.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    ok = [a for a in agents if not a.error]
    ranks = sorted(a.rank for a in ok)
    if ranks != list(range(nodes)) or any(a.world != nodes for a in ok):
        print(f"warning: {backend} N={nodes}: ranks {ranks[:5]}..., errors "
              f"{[a.error for a in agents if a.error][:2]}", file=sys.stderr)
    return RoundResult(
        backend=backend, nodes=nodes,
        round_s=max(a.done for a in agents) - go,
        cas_writes=sum(a.cas_writes for a in agents),
        cas_conflicts=sum(a.cas_conflicts for a in agents),
        state_bytes=state, errors=nodes - len(ok),
    )


def report(rounds: list[RoundResult], backends: list[str], nodes: list[int]) -> str:
    """A Markdown table of medians per backend and N, with the etcd/c10d round-time ratio."""
    def med(b: str, n: int, field: str) -> float:
        values = [getattr(r, field) for r in rounds if r.backend == b and r.nodes == n]
        return statistics.median(values) if values else float("nan")

    lines = ["| backend | N | round time (s) | CAS writes | CAS conflicts | conflicts/agent | "
             "state bytes | errors |", "|---|---|---|---|---|---|---|---|"]
    for n in nodes:
        for b in backends:
            lines.append(
                f"| {b} | {n} | {med(b, n, 'round_s'):.2f} | {med(b, n, 'cas_writes'):.0f} | "
                f"{med(b, n, 'cas_conflicts'):.0f} | {med(b, n, 'cas_conflicts') / n:.1f} | "
                f"{med(b, n, 'state_bytes'):.0f} | {med(b, n, 'errors'):.0f} |"
            )
    if {"etcd-v3", "c10d"} <= set(backends):
        lines.append("")
        for n in nodes:
            ratio = med("etcd-v3", n, "round_s") / med("c10d", n, "round_s")
            lines.append(f"- N={n}: etcd-v3 round time / c10d round time = {ratio:.2f}")
    return "\n".join(lines)


def etcd_write_floor(endpoint: str, value_bytes: int = 4096, writes: int = 200) -> float:
    """Sequential puts per second of a state-sized value on this etcd: the ceiling on CAS
    writes per second that every agent's joins and keep-alives share (one Raft commit and one
    fsync each)."""
    from elastic.etcd import EtcdClient, EtcdConfig

    client = EtcdClient(EtcdConfig(endpoints=(endpoint,)))
    value = os.urandom(value_bytes)
    start = time.perf_counter()
    for i in range(writes):
        client.put(f"/floor/{i % 8}", value)
    rate = writes / (time.perf_counter() - start)
    client.close()
    return rate


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; prints the table (and writes ``--json`` if given)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", default="8,32,128", help="comma-separated N values")
    p.add_argument("--backends", default="etcd-v3,c10d")
    p.add_argument("--processes", type=int, default=8, help="agent processes per round")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the raw rounds to this file")
    args = p.parse_args(argv)
    nodes = [int(n) for n in args.nodes.split(",")]
    backends = args.backends.split(",")

    sys.path.insert(0, str(REPO))
    from torch.distributed import TCPStore

    from elastic.rendezvous import HEARTBEAT_WRITES_PER_S
    from launch.etcd_server import EmbeddedEtcd, free_port

    rounds: list[RoundResult] = []
    with tempfile.TemporaryDirectory(prefix="rdzv-scale-") as tmp:
        etcd = EmbeddedEtcd(data_dir=str(Path(tmp) / "etcd"))
        etcd.start()
        port = free_port()
        store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        try:
            for seq in range(args.repeats):
                for n in nodes:
                    if "etcd-v3" in backends:
                        floor = etcd_write_floor(etcd.endpoint)
                        beat = max(1, -(-n // HEARTBEAT_WRITES_PER_S))  # the default period
                        print(f"etcd write floor: {floor:.0f} puts/s of 4 KiB; torch's keep-alives "
                              f"alone need {n / beat:.1f}/s at N={n}", flush=True)
                    for b in backends:
                        endpoint = etcd.endpoint if b == "etcd-v3" else f"127.0.0.1:{port}"
                        r = one_round(b, n, args.processes, endpoint, store, seq)
                        print(f"{b:8s} N={n:4d} round {r.round_s:7.2f}s  writes {r.cas_writes:6d}"
                              f"  conflicts {r.cas_conflicts:6d}  state {r.state_bytes:7d} B"
                              f"  errors {r.errors}", flush=True)
                        rounds.append(r)
        finally:
            etcd.stop()
    print()
    print(report(rounds, backends, nodes))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rounds], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
