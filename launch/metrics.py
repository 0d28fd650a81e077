"""Live Prometheus metrics of a node agent: a projection of its event log.

Every fact the series need is an event record (:mod:`elastic.eventlog`): the agent's own and
those its workers send it (:mod:`elastic.telemetry`). :class:`NodeMetrics` is one more event
sink: it turns each record into counter, gauge and histogram updates in its own registry, and
:meth:`NodeMetrics.serve` exposes them as Prometheus text at ``/metrics`` (``elastic-run
--metrics-port``). Wiring it into an agent is attaching the sink to the agent's log.

Series (every one labelled ``job_id`` and ``node``; ``job_id`` rather than ``job`` because
Prometheus sets ``job`` to the scrape job and would rename ours to ``exported_job``):

========================================== ========= =======================================
series                                     type      from
========================================== ========= =======================================
elastic_run_steps_total                    counter   ``step`` (each step of the node's
                                                     workers once)
elastic_run_step_seconds                   histogram ``step`` duration_s (compute time)
elastic_run_last_step                      gauge     ``step`` step (index of the newest)
elastic_run_last_step_timestamp_seconds    gauge     ``step`` time (for "stalled" alerts)
elastic_run_world_size                     gauge     ``step`` world (ranks training now)
elastic_run_nodes                          gauge     ``round_started`` world (nodes)
elastic_run_membership_changes_total       counter   a new world after a change, by ``kind``
elastic_run_recovery_seconds               histogram that change's recovery by ``part``:
                                                     detection, rendezvous, restore, total
elastic_run_steps_redone_total             counter   ``step`` of an index completed before
elastic_run_checkpoint_blocking_seconds    histogram ``checkpoint`` blocked_s
elastic_run_checkpoint_stall_seconds       histogram ``checkpoint_staged`` stall_s (the save call
                                                     plus the training stream's wait for
                                                     its device-to-host copy)
elastic_run_checkpoint_deferred_total      counter   ``checkpoint_deferred`` (a save due
                                                     while the previous one was written)
elastic_run_checkpoint_durable_seconds     histogram ``checkpoint_committed`` durable_s
elastic_run_checkpoint_load_seconds        histogram ``restored`` duration_s (when found)
elastic_run_checkpoint_failures_total      counter   ``checkpoint_failed``
elastic_run_checkpoint_last_committed_step gauge     ``checkpoint_committed``/``restored`` step
                                                     (-1 until one is seen)
elastic_run_worker_restarts_total          counter   ``workers_started`` workers (restarts)
elastic_run_worker_failures_total          counter   ``worker_failed``, by ``cause``
elastic_run_goodput_ratio                  gauge     productive step time / time since the
                                                     agent started
elastic_run_events_total                   counter   every record, by ``event``
elastic_run_events_dropped_total           counter   records lost, by ``where``: telemetry
                                                     (worker to agent) or event_log (storage)
========================================== ========= =======================================

Per node, not per job: each agent counts the steps of its own workers (each step once, however
many workers it has), so a job's step rate is ``max by (job_id)`` of the nodes' rates, not
their sum. A membership change is counted by every node that lived through it, with the kind
the job's cause of the change (a worker crash is ``worker_failed`` on every node, then
``node_joined`` when the replacement is admitted) and the recovery that node saw; the recovery is
split exactly as ``elastic-run goodput`` splits it (:func:`launch.goodput.split_change`).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from elastic_errors import ConfigError
from launch.goodput import CHANGE_REASONS, NOTICED, NOTICED_BY_WORKERS, split_change

logger = logging.getLogger(__name__)

PREFIX: Final = "elastic_run"
LABELS: Final = ("job_id", "node")
RECOVERY_PARTS: Final = ("detection", "rendezvous", "restore", "total")
DROP_SOURCES: Final = ("telemetry", "event_log")
#: Event names counted by name in ``elastic_run_events_total`` (others count as ``other``).
KNOWN_EVENTS: Final = frozenset({
    "agent_started", "round_started", "worker_failed", "workers_restarted_in_place",
    "restart_refunded", "node_lost", "peer_departed", "planned_departure", "left_rendezvous",
    "job_finished", "agent_exited", "step", "peer_failed", "checkpoint", "restored",
    "checkpoint_committed", "checkpoint_failed", "workers_started", "checkpoint_staged",
    "checkpoint_deferred", "rewound",
})
STEP_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 30.0, 60.0)
RECOVERY_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                           600.0)
CHECKPOINT_BUCKETS: Final = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                             120.0, 300.0, 600.0)
#: Records remembered to tell a sibling worker's copy of a step from a new step.
_DEDUPE_WINDOW: Final = 1024
#: Step durations remembered to take a redone step's first execution out of goodput.
_DURATIONS_KEPT: Final = 8192


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


class _DropCollector(Collector):
    """``elastic_run_events_dropped_total``: read from the counting components at scrape."""

    def __init__(self, labels: tuple[str, str]) -> None:
        self._labels = labels
        self._sources: dict[str, list[Callable[[], int]]] = {w: [] for w in DROP_SOURCES}

    def add(self, where: str, count: Callable[[], int]) -> None:
        self._sources[where].append(count)

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            f"{PREFIX}_events_dropped", "Event records lost: telemetry (a worker's record that "
            "did not reach its agent) or event_log (not written to the job log).",
            labels=[*LABELS, "where"])
        for where, counts in self._sources.items():
            total = 0
            for count in counts:
                try:
                    total += int(count())
                except Exception:  # a scrape must never fail on one source
                    logger.debug("drop counter %s failed", where, exc_info=True)
            family.add_metric([*self._labels, where], total)
        yield family


class NodeMetrics:
    """The Prometheus series of one node agent, updated from its event records.

    An event sink (:class:`elastic.eventlog.EventSink`); thread-safe (the agent's main thread
    and its telemetry receiver both write).

    Args:
        job: The job id (label ``job_id``).
        node: The node (label ``node``; the agent's ``host/pid``).
        clock: Wall-clock seconds (tests pass their own).
    """

    def __init__(self, *, job: str, node: str, clock: Callable[[], float] = time.time) -> None:
        self.job = job
        self.node = node
        self.registry = CollectorRegistry()
        self._clock = clock
        self._lock = threading.Lock()
        self._server: Any = None
        labels = (job, node)
        reg = self.registry

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, [*LABELS, *extra], registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, LABELS, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *extra: str) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, [*LABELS, *extra], buckets=buckets,
                             registry=reg)

        self.steps = counter("steps", "Training steps completed by this node's workers (each "
                             "step once).").labels(*labels)
        self.step_seconds = histogram("step_seconds", "Compute time of a training step.",
                                      STEP_BUCKETS).labels(*labels)
        self.last_step = gauge("last_step", "Index of the newest step completed.").labels(*labels)
        self.last_step_time = gauge("last_step_timestamp_seconds",
                                    "Wall-clock time the newest step completed.").labels(*labels)
        self.world_size = gauge("world_size", "Ranks (worker processes) in the world training "
                                "now.").labels(*labels)
        self.nodes = gauge("nodes", "Nodes in the agent's current rendezvous round.").labels(
            *labels)
        changes = counter("membership_changes", "Membership changes this node lived through, "
                          "by kind.", "kind")
        self.changes = {kind: changes.labels(*labels, kind) for kind in CHANGE_REASONS}
        self._changes_family = changes
        recovery = histogram("recovery_seconds", "Recovery of a membership change (last step "
                             "before to first step after), by part.", RECOVERY_BUCKETS, "part")
        self.recovery = {part: recovery.labels(*labels, part) for part in RECOVERY_PARTS}
        self.redone = counter("steps_redone", "Steps executed again after a rollback.").labels(
            *labels)
        self.ckpt_blocking = histogram(
            "checkpoint_blocking_seconds", "Time the training loop waited on a save or a "
            "commit.", CHECKPOINT_BUCKETS).labels(*labels)
        self.ckpt_stall = histogram(
            "checkpoint_stall_seconds", "Time a save held training back: the save call plus "
            "the training stream's wait for its device-to-host copy.",
            CHECKPOINT_BUCKETS).labels(*labels)
        self.ckpt_deferred = counter(
            "checkpoint_deferred", "Saves deferred because the previous one was still being "
            "written (save_backpressure='defer').").labels(*labels)
        self.ckpt_durable = histogram(
            "checkpoint_durable_seconds", "Save call to commit (durable and committed).",
            CHECKPOINT_BUCKETS).labels(*labels)
        self.ckpt_load = histogram("checkpoint_load_seconds", "Time spent loading a checkpoint "
                                   "at a restore.", CHECKPOINT_BUCKETS).labels(*labels)
        self.ckpt_failures = counter("checkpoint_failures", "Saves that did not commit.").labels(
            *labels)
        self.last_committed = gauge("checkpoint_last_committed_step",
                                    "Step of the newest committed checkpoint (-1: none "
                                    "yet).").labels(*labels)
        self.last_committed.set(-1)
        self.restarts = counter("worker_restarts", "Worker processes this node started again "
                                "(after its first start).").labels(*labels)
        failures = counter("worker_failures", "Worker failures seen by this node's agent, by "
                           "cause.", "cause")
        self.failures = {c: failures.labels(*labels, c)
                         for c in ("crash", "node_lost", "planned_departure")}
        self._failures_family = failures
        goodput = gauge("goodput_ratio", "Productive step time of this node's workers over the "
                        "time since the agent started.")
        goodput.labels(*labels).set_function(self._goodput)
        self._events = counter("events", "Event records seen, by event.", "event")
        self._event_counts: dict[str, Any] = {}
        # Updates a batch of records makes once, at its end (_publish).
        self._tally: collections.Counter[str] = collections.Counter()
        self._new_steps = 0
        self._newest: tuple[int, float] | None = None
        self._newest_world: int | None = None
        self._labels = labels
        self._drops = _DropCollector(labels)
        reg.register(self._drops)
        # Projection state (under the lock).
        self._seen: collections.OrderedDict[tuple[Any, ...], None] = collections.OrderedDict()
        self._label: Any = None
        self._labels_seen: set[Any] = set()
        self._last_end: float | None = None
        self._world: int | None = None
        self._noticed: list[tuple[float, str]] = []
        self._starts: list[tuple[float, str]] = []
        self._max_step = -1
        self._last_committed = -1
        self._durations: dict[int, float] = {}
        self._productive = 0.0
        self._started_at: float | None = None
        self._created_at = clock()

    # -- sink -------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Always: the registry takes every record."""
        return True

    def write(self, record: Mapping[str, Any], durable: bool) -> None:
        """Updates the series from one record (durable or live)."""
        with self._lock:
            self._observe(record)
            self._publish()

    def write_many(self, items: Iterable[tuple[Mapping[str, Any], bool]]) -> None:
        """Updates the series from several records (a worker's batch), under one lock; the
        step counters and gauges move once per batch, to where the records one by one would
        have left them."""
        with self._lock:
            for record, _durable in items:
                self._observe(record)
            self._publish()

    def flush(self, timeout: float) -> bool:
        """Nothing is buffered."""
        return True

    def close(self, timeout: float) -> None:
        """Stops the HTTP endpoint, if serving."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def add_drop_source(self, where: str, count: Callable[[], int]) -> None:
        """Adds a component's drop count to ``elastic_run_events_dropped_total{where}``."""
        if where not in DROP_SOURCES:
            raise ValueError(f"where ({where!r}) must be one of {', '.join(DROP_SOURCES)}.")
        self._drops.add(where, count)

    # -- HTTP -------------------------------------------------------------------------------

    def serve(self, port: int, host: str = "") -> int:
        """Serves ``/metrics`` on ``host:port`` from a daemon thread; returns the port.

        Args:
            port: TCP port (0: any free one).
            host: Address to bind (default every IPv4 interface; ``::`` for IPv6).

        Raises:
            ConfigError: the address cannot be bound (in use, not local).
        """
        try:
            server, _thread = start_http_server(port, addr=host or "0.0.0.0",
                                                registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port ({port}) cannot be served on {host or '0.0.0.0'} ({exc}); pick "
                "a free port or leave --metrics-port off."
            ) from exc
        self._server = server
        bound = int(server.server_port)
        logger.info("Prometheus metrics at http://%s:%d/metrics", host or "0.0.0.0", bound)
        return bound

    # -- the projection ---------------------------------------------------------------------

    def _goodput(self) -> float:
        with self._lock:
            since = self._started_at if self._started_at is not None else self._created_at
            elapsed = self._clock() - since
            return self._productive / elapsed if elapsed > 0 else 0.0

    def _first(self, key: tuple[Any, ...]) -> bool:
        """True the first time ``key`` is seen (each worker of the node reports each step)."""
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > _DEDUPE_WINDOW:
            self._seen.popitem(last=False)
        return True

    def _publish(self) -> None:
        """Applies the counts and the newest step gathered since the last call (each
        Prometheus update takes a lock of its own: once per batch, not per record)."""
        for event, count in self._tally.items():
            counted = self._event_counts.get(event)
            if counted is None:
                counted = self._events.labels(*self._labels,
                                              event if event in KNOWN_EVENTS else "other")
                if event in KNOWN_EVENTS:
                    self._event_counts[event] = counted
            counted.inc(count)
        self._tally.clear()
        if self._new_steps:
            self.steps.inc(self._new_steps)
            self._new_steps = 0
        if self._newest is not None:
            self.last_step.set(self._newest[0])
            self.last_step_time.set(self._newest[1])
            self._newest = None
        if self._newest_world is not None:
            self.world_size.set(self._newest_world)
            self._newest_world = None

    def _observe(self, record: Mapping[str, Any]) -> None:
        event = str(record.get("event"))
        self._tally[event] += 1
        when = _number(record.get("time"))
        label = record.get("round")
        agent = record.get("source") == "agent"
        if event == "step":
            self._step(record, label)
        elif (event in NOTICED and agent) or event in NOTICED_BY_WORKERS:
            if when is not None:
                self._noticed.append((when, event))
            if event == "worker_failed":
                cause = str(record.get("cause"))
                if cause in self.failures:
                    self.failures[cause].inc()
        elif event == "round_started":
            if when is not None:
                self._starts.append((when, str(record.get("reason", ""))))
            if isinstance(record.get("world"), int):
                self.nodes.set(record["world"])
        elif event == "agent_started":
            self._started_at = _number(record.get("launched_at")) or when
        elif event == "checkpoint":
            blocked = _number(record.get("blocked_s"))
            key = ("checkpoint", label, record.get("step"), record.get("wait"))
            if blocked is not None and self._first(key):
                self.ckpt_blocking.observe(blocked)
        elif event == "checkpoint_staged":
            stall = _number(record.get("stall_s"))
            if stall is not None and self._first(("staged", label, record.get("step"))):
                self.ckpt_stall.observe(stall)
        elif event == "checkpoint_deferred":
            if self._first(("deferred", label, record.get("step"))):
                self.ckpt_deferred.inc()
        elif event == "checkpoint_committed":
            if self._first(("committed", label, record.get("step"))):
                durable = _number(record.get("durable_s"))
                if durable is not None:
                    self.ckpt_durable.observe(durable)
                if isinstance(record.get("step"), int):
                    self._last_committed = record["step"]
                    self.last_committed.set(record["step"])
        elif event == "checkpoint_failed":
            if self._first(("ckpt_failed", label, record.get("step"))):
                self.ckpt_failures.inc()
        elif event == "restored":
            if record.get("found") and self._first(("restored", label, record.get("step"))):
                load = _number(record.get("duration_s"))
                if load is not None:
                    self.ckpt_load.observe(load)
                step = record.get("step")
                if isinstance(step, int) and step > self._last_committed:
                    self._last_committed = step
                    self.last_committed.set(step)
        elif event == "workers_started":
            workers = record.get("workers")
            if record.get("restart") and isinstance(workers, int):
                self.restarts.inc(workers)

    def _step(self, record: Mapping[str, Any], label: Any) -> None:
        step, end = record.get("step"), _number(record.get("time"))
        if not isinstance(step, int) or end is None or not self._first(("step", label, step)):
            return
        duration = _number(record.get("duration_s")) or 0.0
        world = record.get("world") if isinstance(record.get("world"), int) else None
        self._new_steps += 1
        self.step_seconds.observe(duration)
        self._newest = (step, end)
        if world is not None:
            self._newest_world = world
        if step <= self._max_step:
            self.redone.inc()
            self._productive -= self._durations.get(step, 0.0)
        self._max_step = max(self._max_step, step)
        self._durations[step] = duration
        self._productive += duration
        if len(self._durations) > _DURATIONS_KEPT:
            floor = self._max_step - _DURATIONS_KEPT // 2
            self._durations = {s: d for s, d in self._durations.items() if s > floor}
        if label != self._label and label not in self._labels_seen:
            self._new_world(label, end - duration, world)
        if label == self._label:
            self._last_end = max(self._last_end or end, end)
            self._world = world if world is not None else self._world
        # Earlier notices and rounds cannot belong to a later change.
        floor_time = self._last_end or 0.0
        self._noticed = [n for n in self._noticed if n[0] >= floor_time]
        self._starts = [s for s in self._starts if s[0] >= floor_time]

    def _new_world(self, label: Any, resumed: float, world: int | None) -> None:
        """The first step of a new world (round or in-place epoch): count the change."""
        if self._label is not None and self._last_end is not None:
            ended = self._last_end
            split = split_change(ended, resumed, sorted(self._noticed), sorted(self._starts),
                                 self._world, world)
            kind = split.reason
            if kind not in self.changes:  # a reason added to the report later
                self.changes[kind] = self._changes_family.labels(*self._labels, kind)
            self.changes[kind].inc()
            parts = {"detection": split.detected - ended, "rendezvous": split.began -
                     split.detected, "restore": resumed - split.began, "total": resumed - ended}
            for part, seconds in parts.items():
                self.recovery[part].observe(max(0.0, seconds))
        self._label = label
        self._labels_seen.add(label)
        self._last_end = None
        self._world = world
