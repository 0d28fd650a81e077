"""What live metrics cost training: step time with metrics on and off, interleaved in one run.

Two worker processes (spawned, one torch thread each, a 2-rank gloo world from
``elastic.init``) train a DDP MLP (256-512-512-10, Adam, global batch 128: about 10 ms a
step, the short end of real steps, where a fixed cost per step weighs most) under
``ElasticLoop`` in blocks of ``--steps-per-block`` steps, switching
telemetry on and off at every block (the order alternates: off-on, on-off, ...), both workers
in the same mode at once (a barrier at each block). This process plays the node agent exactly
as ``elastic-run --metrics-port`` does: ``NodeTelemetry`` (the workers' Unix datagram socket,
the event log written to a local directory, the Prometheus registry); a scraper process reads
``/metrics`` over HTTP every ``--scrape-interval`` seconds while telemetry is on (15, as the
``deploy/`` PodMonitor; 1 s makes the scrape's own cost visible).

* **on**: the workers' loops report their events to the agent, as under ``elastic-run``:
  rank 0 (the node's reporter, and the job log's writer) sends its step records coalesced,
  one non-blocking datagram per tenth of a second, rank 1 builds none (its records would
  repeat rank 0's); the agent projects each datagram's records onto its series and writes
  them to the event log;
* **off**: no socket and no events directory: the loop's event log has no sink.

Two figures, each the median over the repeats of on / off of the repeat's two adjacent blocks
(adjacent blocks share the machine's other load), the goal being under 1.01:

* **step time** (wall clock, measured in each worker over whole blocks, loop overhead and the
  event records included, averaged over the workers): what the issue asks, but on a shared
  machine its pairs scatter by several percent either way;
* **CPU per step**: the workers' own CPU time per step (``time.process_time``), plus the
  agent's extra CPU time while telemetry is on (its receiver, the projection, the event log
  and the scrapes; sampled five times a second) spread over the steps it served, over the
  workers' CPU time per step with telemetry off. That is the slowdown a job whose workers
  keep every core busy would see; it hardly moves with other processes' load.

* **cost counted where it is spent**: the CPU time the workers spend on their events (timed
  around the loop's own ``record`` calls, plus the CPU time of the thread that sends the
  coalesced step records) plus the agent's CPU share per worker, over the step time with
  telemetry off. Precise, and the headline against the goal; the two
  ratios above check end to end that nothing else moves.

Every block is in the JSON.

Usage::

    python benchmarks/metrics_overhead.py [--repeats 10] [--steps-per-block 200]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORKERS = 2
BATCH = 128


@dataclass
class Result:
    """One run of the benchmark."""

    steps_per_block: int
    repeats: int
    on_step_s: list[float] = field(default_factory=list)
    off_step_s: list[float] = field(default_factory=list)
    on_cpu_s: list[float] = field(default_factory=list)
    """Workers' CPU seconds per step, per on block (mean over the workers)."""
    on_record_s: list[float] = field(default_factory=list)
    """CPU seconds per step the workers spent on their events, per on block: the loop's
    ``record`` calls and the sender's coalescing thread (mean over the workers: rank 0 sends,
    rank 1 records nothing no sink takes)."""
    off_cpu_s: list[float] = field(default_factory=list)
    agent_cpu_on_s: float = 0.0
    """The agent's CPU seconds while telemetry was on."""
    agent_cpu_off_s: float = 0.0
    agent_wall_on_s: float = 0.0
    agent_wall_off_s: float = 0.0
    records_received: int = 0
    records_dropped: int = 0
    scrapes: int = 0
    steps_scraped: float = 0.0
    scrape_interval_s: float = 15.0
    receiver_cpu_s: float = 0.0
    """CPU seconds of the agent's receiver thread (decode, projection, event log)."""
    twin: bool = False
    """Two jobs ran side by side, one with telemetry on and one off in every block, swapping
    each block (``--twin``): ``on_step_s[b]`` and ``off_step_s[b]`` were measured at the
    same time."""

    @property
    def on_median(self) -> float:
        return statistics.median(self.on_step_s)

    @property
    def off_median(self) -> float:
        return statistics.median(self.off_step_s)

    @property
    def pair_ratios(self) -> list[float]:
        """on / off per pair of blocks (twin: the geometric mean of the pair's two blocks,
        which cancels what sets one job apart from the other, its cores say)."""
        return self._paired([on / off for on, off in zip(self.on_step_s, self.off_step_s,
                                                         strict=True)])

    def _paired(self, ratios: list[float]) -> list[float]:
        if not self.twin:
            return ratios
        return [math.sqrt(a * b) for a, b in zip(ratios[0::2], ratios[1::2], strict=True)]

    @property
    def ratio_ci95(self) -> tuple[float, float]:
        """95 % bootstrap interval of :attr:`ratio` (2000 resamples of the pairs, seed 0)."""
        return bootstrap_median_ci(self.pair_ratios)

    @property
    def ratio(self) -> float:
        """Median over the repeats of on / off of the repeat's two blocks."""
        return statistics.median(self.pair_ratios)

    @property
    def agent_cpu_per_step_s(self) -> float:
        """The agent's extra CPU seconds per step (each step runs on every worker) while on."""
        idle_rate = self.agent_cpu_off_s / self.agent_wall_off_s if self.agent_wall_off_s else 0
        extra = max(0.0, self.agent_cpu_on_s - idle_rate * self.agent_wall_on_s)
        return extra / (self.steps_per_block * len(self.on_step_s))

    @property
    def cpu_pair_ratios(self) -> list[float]:
        share = self.agent_cpu_per_step_s / WORKERS
        return self._paired([(on + share) / off for on, off in zip(self.on_cpu_s,
                                                                   self.off_cpu_s, strict=True)])

    @property
    def cpu_ratio(self) -> float:
        """Median over the repeats of (workers' + agent's CPU per step) on / off."""
        return statistics.median(self.cpu_pair_ratios)

    @property
    def cost_ratio(self) -> float:
        """1 + what telemetry adds to a step, counted where it is spent: the workers' time
        recording events plus the agent's CPU share per worker, over the step time off."""
        added = statistics.mean(self.on_record_s) + self.agent_cpu_per_step_s / WORKERS
        return 1.0 + added / self.off_median


def bootstrap_median_ci(values: list[float], resamples: int = 2000,
                        seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the median of ``values`` resampled with
    replacement: how far the median of this many pairs can move by chance."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def schedule(repeats: int) -> list[bool]:
    """Telemetry on (True) or off per block: off-on, on-off, off-on, ... (``2 * repeats``)."""
    out: list[bool] = []
    for r in range(repeats):
        out += [False, True] if r % 2 == 0 else [True, False]
    return out


def _worker(job: int, rank: int, port: int, socket_path: str, blocks: list[bool], steps: int,
            barrier: Any, mode: Any | None, results: Any, cpus: set[int] | None = None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORKERS),
                      LOCAL_WORLD_SIZE=str(WORKERS), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import elastic
    from elastic import env
    from elastic.loop import ElasticLoop

    torch.set_num_threads(1)
    ctx = elastic.init("gloo")  # a 2-rank gloo world, as under elastic-run
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)))
    optimizer = torch.optim.Adam(model.parameters())
    torch.manual_seed(rank)
    x, y = torch.randn(BATCH // WORKERS, 256), torch.randint(0, 10, (BATCH // WORKERS,))
    os.environ[env.RUN_ID] = "metrics-overhead"
    os.environ.pop(env.EVENTS_DIR, None)
    for block, on in enumerate(blocks):
        if on:
            os.environ[env.TELEMETRY_SOCKET] = socket_path
        else:
            os.environ.pop(env.TELEMETRY_SOCKET, None)
        first = block * steps  # new step indices every block, as a job's are
        loop = ElasticLoop(ctx, state={}, checkpoint=None, sampler=None,
                           max_steps=first + steps, checkpoint_interval=first + steps,
                           global_batch_size=BATCH, install_signal_handler=False)
        # The loop's own event records, timed where they are made (benchmark instrumentation).
        recording = [0.0]
        record = loop._events.record

        def timed(*args: Any, _record: Any = record, _spent: list[float] = recording,
                  **kwargs: Any) -> None:
            began = time.thread_time()  # CPU: other processes' load does not count
            _record(*args, **kwargs)
            _spent[0] += time.thread_time() - began

        loop._events.record = timed  # type: ignore[method-assign]
        barrier.wait()
        if rank == 0 and mode is not None:  # None with --twin: one job is always on
            mode.value = int(on)
        started, cpu, sender_cpu = time.perf_counter(), time.process_time(), _sender_thread_cpu()
        with loop:
            loop.step = first
            for _ in loop:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                loop.end_step()
        recording[0] += _sender_thread_cpu() - sender_cpu
        results.put((job, rank, block, on, (time.perf_counter() - started) / steps,
                     (time.process_time() - cpu) / steps, recording[0] / steps))
    barrier.wait()
    ctx.close()


def _sender_thread_cpu() -> float:
    """CPU seconds so far of this worker's telemetry coalescing threads (they send the step
    records the loop queued: their time is the records' too)."""
    from elastic import telemetry

    total = 0.0
    for sender in list(telemetry._senders.values()):
        thread = sender._flusher
        if thread is not None and thread.ident is not None and thread.is_alive():
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


def _scraper(url: str, interval: float, mode: Any, stop: Any, scrapes: Any) -> None:
    """Prometheus, in a process of its own: GET /metrics every ``interval`` s while telemetry
    is on (the text is parsed afterwards, outside the measured blocks)."""
    while not stop.wait(interval):
        if not mode.value:
            continue
        with urllib.request.urlopen(url, timeout=5) as reply:
            reply.read()
        with scrapes.get_lock():
            scrapes.value += 1


def _steps_total(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "elastic_run_steps_total")


def _agent_cpu(mode: Any, stop: threading.Event, result: Result) -> None:
    """Splits this process's CPU and wall time between the on and off blocks."""
    cpu, wall = time.process_time(), time.monotonic()
    while not stop.wait(0.2):
        now_cpu, now_wall, on = time.process_time(), time.monotonic(), bool(mode.value)
        if on:
            result.agent_cpu_on_s += now_cpu - cpu
            result.agent_wall_on_s += now_wall - wall
        else:
            result.agent_cpu_off_s += now_cpu - cpu
            result.agent_wall_off_s += now_wall - wall
        cpu, wall = now_cpu, now_wall


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _thread_cpu(thread: threading.Thread | None) -> float:
    """CPU seconds of one thread of this process (Linux), 0 if unknown."""
    if thread is None or thread.native_id is None:
        return 0.0
    try:
        with open(f"/proc/self/task/{thread.native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


TWIN_MIN_CPUS = 6
"""``--twin`` pins each of the four workers to a core of its own and leaves the agent two."""


def run(repeats: int, steps: int, scrape_interval: float = 15.0, twin: bool = False) -> Result:
    """Runs the interleaved blocks; returns the per-block step times of both modes.

    With ``twin``, two identical jobs (each 2 workers and its own agent telemetry) run at
    once, in lockstep blocks, one with telemetry on and the other off, swapping at every
    block: each block's on and off are measured over the same seconds, so the machine's
    drifts, which scatter sequential pairs by several percent, cancel.
    """
    from elastic.eventlog import EventLog
    from launch.telemetry import NodeTelemetry

    jobs = 2 if twin else 1
    cpus = os.cpu_count() or 1
    pin = twin and cpus >= TWIN_MIN_CPUS  # unpinned, twin jobs still run (but share cores)
    result = Result(steps_per_block=steps, repeats=repeats, scrape_interval_s=scrape_interval,
                    twin=twin)
    blocks = schedule(repeats)
    schedules = [blocks, [not on for on in blocks]][:jobs]
    with tempfile.TemporaryDirectory(prefix="metrics-overhead-") as tmp:
        logs = [EventLog(Path(tmp) / f"events-{j}", job=f"metrics-overhead-{j}",
                         source="agent") for j in range(jobs)]
        agents = [NodeTelemetry(log, metrics_port=0, metrics_host="127.0.0.1").start()
                  for log in logs]
        receivers = [a.receiver for a in agents]
        assert all(r is not None for r in receivers)
        if pin:  # workers on cores 0-3, this process and the scrapers on the rest
            os.sched_setaffinity(0, set(range(2 * WORKERS, cpus)))
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(WORKERS * jobs), ctx.Queue()
        # Twin: one job is always on, so the scraper always scrapes and the agent's CPU is
        # counted by its receiver threads instead of by splitting on and off time.
        mode = ctx.Value("i", 1 if twin else 0)
        stop, scraper_stop, scrapes = threading.Event(), ctx.Event(), ctx.Value("i", 0)
        urls = [f"http://127.0.0.1:{a.metrics_port}/metrics" for a in agents]
        scrapers = [ctx.Process(target=_scraper, daemon=True,
                                args=(url, scrape_interval, mode, scraper_stop, scrapes))
                    for url in urls]
        for scraper in scrapers:
            scraper.start()
        if not twin:
            threading.Thread(target=_agent_cpu, args=(mode, stop, result), daemon=True).start()
        procs = []
        for j in range(jobs):
            port = _free_port()
            receiver = receivers[j]
            assert receiver is not None
            procs += [ctx.Process(target=_worker, daemon=True, args=(
                j, rank, port, receiver.path, schedules[j], steps, barrier,
                None if twin else mode, results,
                {j * WORKERS + rank} if pin else None)) for rank in range(WORKERS)]
        try:
            for proc in procs:
                proc.start()
            per_block: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
            for _ in range(len(procs) * len(blocks)):
                job, _rank, block, _on, step_s, cpu_s, record_s = results.get(timeout=600)
                per_block.setdefault((block, job), []).append((step_s, cpu_s, record_s))
            for proc in procs:
                proc.join(60)
                if proc.exitcode != 0:
                    raise RuntimeError(f"a worker exited with {proc.exitcode}")
            result.steps_scraped = sum(_steps_total(url) for url in urls)
            result.receiver_cpu_s = sum(_thread_cpu(r._thread) for r in receivers if r)
        finally:
            stop.set()
            scraper_stop.set()
            for proc in [*procs, *scrapers]:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
            for agent in agents:
                agent.close()
            for log in logs:
                log.close()
        result.scrapes = scrapes.value
        for (block, job), times in sorted(per_block.items()):
            on = schedules[job][block]
            walls, cpus_ = (result.on_step_s, result.on_cpu_s) if on else (
                result.off_step_s, result.off_cpu_s)
            walls.append(statistics.mean(t for t, _, _ in times))
            cpus_.append(statistics.mean(c for _, c, _ in times))
            if on:
                result.on_record_s.append(statistics.mean(r for _, _, r in times))
        if twin:
            result.agent_cpu_on_s = result.receiver_cpu_s
        result.records_received = sum(r.received for r in receivers if r)
        result.records_dropped = sum(r.dropped for r in receivers if r)
    return result


def table(result: Result) -> str:
    """The result as Markdown."""
    def ms(values: list[float]) -> str:
        return f"{1e3 * statistics.median(values):.2f} ms ({1e3 * min(values):.2f}-" \
               f"{1e3 * max(values):.2f})"

    def ratio(pairs: list[float], median: float) -> str:
        return f"**{median:.4f}** ({100 * (median - 1):+.2f} %; pairs {min(pairs):.3f}-" \
               f"{max(pairs):.3f})"

    agent_us = 1e6 * result.agent_cpu_per_step_s
    low, high = result.ratio_ci95
    receiver_us = 1e6 * result.receiver_cpu_s / max(1, result.records_received)
    return "\n".join([
        "| telemetry | blocks | step time, median (min-max) | workers' CPU per step |",
        "|---|---:|---:|---:|",
        f"| off | {len(result.off_step_s)} | {ms(result.off_step_s)} | "
        f"{ms(result.off_cpu_s)} |",
        f"| on (socket, metrics, event log, scrapes) | {len(result.on_step_s)} | "
        f"{ms(result.on_step_s)} | {ms(result.on_cpu_s)} + agent {agent_us:.0f} us |",
        "",
        f"- step time on / off, median of the paired blocks: "
        f"{ratio(result.pair_ratios, result.ratio)}; 95 % bootstrap interval "
        f"{low:.4f}-{high:.4f}"
        + (" (twin jobs: on and off measured over the same seconds)" if result.twin else ""),
        f"- CPU per step on / off (workers' plus the agent's share), median of the pairs: "
        f"{ratio(result.cpu_pair_ratios, result.cpu_ratio)}",
        f"- cost counted where it is spent: the workers' event records (loop and sender thread) "
        f"{1e6 * statistics.mean(result.on_record_s):.0f} us per step per worker, the agent "
        f"{agent_us:.0f} us of CPU per step: **{result.cost_ratio:.4f}** of the step time off",
        f"- goal: under 1.01; {WORKERS} workers x {result.steps_per_block} steps per block, "
        f"{result.repeats} pairs; the agent received {result.records_received} records, "
        f"{result.records_dropped} dropped ({receiver_us:.0f} us of the receiver thread's CPU "
        f"each); {result.scrapes} scrapes, one every "
        f"{result.scrape_interval_s:g} s; the exporter counted {result.steps_scraped:.0f} steps.",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10,
                        help="pairs of blocks (one on, one off) (default 10)")
    parser.add_argument("--steps-per-block", type=int, default=200)
    parser.add_argument("--scrape-interval", type=float, default=15.0,
                        help="seconds between scrapes, as Prometheus (default 15, the "
                        "deploy/ PodMonitor's)")
    parser.add_argument("--twin", action="store_true",
                        help="two jobs side by side, one on and one off in every block "
                        f"(needs {TWIN_MIN_CPUS} CPUs; see run())")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    if args.twin and (os.cpu_count() or 1) < TWIN_MIN_CPUS:
        parser.error(f"--twin needs at least {TWIN_MIN_CPUS} CPUs (one per worker, two for the "
                     f"agents) but this machine has {os.cpu_count()}; run without --twin.")
    result = run(args.repeats, args.steps_per_block, args.scrape_interval, args.twin)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps({
            **asdict(result), "on_median_s": result.on_median,
            "off_median_s": result.off_median, "pair_ratios": result.pair_ratios,
            "ratio": result.ratio, "ratio_ci95": result.ratio_ci95,
            "agent_cpu_per_step_s": result.agent_cpu_per_step_s,
            "cpu_pair_ratios": result.cpu_pair_ratios, "cpu_ratio": result.cpu_ratio,
            "cost_ratio": result.cost_ratio},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
