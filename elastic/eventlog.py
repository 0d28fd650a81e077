"""The job event log: JSON records of agents and workers, read by the goodput report and
projected onto the live metrics.

Enabled by ``elastic-run --events-dir DIR`` (or ``ELASTIC_EVENTS_DIR``). An :class:`EventLog`
builds each record and hands it to its *sinks* (:class:`EventSink`); which sinks a process has
decides where its records go:

* a local directory: each process appends to a file of its own, so no two writers share a
  file, even on a shared file system, and every line is on disk as soon as it is recorded::

      DIR/{job}.{source}.{host}.{pid}.jsonl      source: agent or worker

* any other fsspec URL (``s3://bucket/prefix``): each writer puts immutable chunk objects of
  its own, at least every half second (:mod:`elastic.event_chunks`), so several agents share
  one log without append and a node that dies loses at most its last second of events;
* under ``elastic-run`` a worker sends its records to its node's agent over a Unix datagram
  socket (:mod:`elastic.telemetry`) and never writes the log itself; the agent writes the
  *durable* ones (global rank 0's, one copy per step) to the job log and feeds every one to
  the node's metrics (:mod:`launch.metrics`). Since every worker of a node records the same
  collective facts, only the node's local rank 0 sends its live-only records (the others send
  their durable ones only), so an agent gets one record per step whatever its worker count;
* the agent's metrics registry is one more sink.

:func:`read_events` reads both layouts, from a local directory or a URL.

Every line is one JSON object (format version 1)::

    {"v": 1, "time": 1717171717.25, "job": "exp-1", "source": "agent",
     "node": "host-a/4242", "round": 3, "event": "round_started", ...fields of the event}

``time`` is wall-clock seconds since the epoch (events of different nodes are merged on it);
``node`` is ``host/pid`` of the node's agent (a worker reports its agent's); ``round`` is the
rendezvous round or null; an event's own fields never reuse these names. Events and their
fields (fields may be added, never renamed):

=====================  ==========================================================================
event                  fields
=====================  ==========================================================================
agent_started          min_nodes, max_nodes, nproc_per_node, max_restarts, preemption_watch,
                       launched_at (wall-clock start of the agent's process, or null: the
                       report's wall time counts from there, interpreter start-up included)
round_started          group_rank, world (nodes), reason: start, worker_failed, node_lost,
                       planned_departure or node_joined
worker_failed          exit_codes ({global rank: code}), cause: crash, node_lost or
                       planned_departure (only ``crash`` is charged to ``--max-restarts``)
workers_restarted_in_place
                       (in place: this node's workers restarted without a new round)
restart_refunded       reason (a charged crash turned out to be a membership change)
node_lost              ranks (group ranks of the round that vanished without notice)
peer_departed          ranks (group ranks of the round that announced a planned departure)
planned_departure      notice (aws, gcp, azure or sigterm), deadline (ISO or null), time_left_s,
                       drain_budget_s, member_ttl, announced (the peers were told in etcd)
left_rendezvous        drained (workers exited within the budget), exit_codes, drain_s
job_finished           (this node's workers finished the job)
agent_exited           outcome: succeeded, already_finished (came after the job ended), failed,
                       departed, signal or rendezvous_error;
                       exit_code
step                   step, duration_s (compute time of the step), world (ranks)
peer_failed            step, error (in place: a collective of the step failed because a peer
                       died; every survivor records it)
checkpoint             step, blocked_s (time the loop waited on the save), final, wait
                       ("commit": waiting for an earlier save's commit, not starting one)
restored               step (where training resumes), found (a checkpoint was loaded),
                       duration_s (time spent loading it), read_from (``memory``,
                       ``storage`` or ``mixed``: :mod:`checkpointing.memory_tier`)
checkpoint_staged      step, bytes, stage_s (the save call's staging), copy_s (its
                       device-to-host copy), held_s (the training stream's wait for that copy),
                       stall_s (the save call plus held_s: how long the save held training
                       back); recorded once known, a step or more after the save
checkpoint_deferred    step, reason (a save due while the previous one was still being written
                       was deferred: ``save_backpressure="defer"``)
rewound                step (where training resumes), ahead (the step the host had reached): the
                       NCCL device gate skipped the steps in between after an abort
checkpoint_committed   step, durable_s (save call to commit), world (the checkpoint group's ranks);
                       recorded by every rank of the group, durable on its rank 0
checkpoint_failed      step, error (the save did not commit; the previous checkpoint stays)
workers_started        workers (processes started), restart (false for the node's first start),
                       warm (it started in a warm standby: :mod:`launch.standby`)
=====================  ==========================================================================

The loop's events (``step``, ``checkpoint``, ``checkpoint_staged``, ``checkpoint_deferred``,
``rewound``, ``restored``) and the checkpoint events are
recorded by every rank and marked durable on global rank 0 only: the job log gets each once,
and each agent's metrics see the steps of its own workers. Without an agent (plain torchrun)
only durable records are written.

Writing never raises: an unwritable directory is logged once and the job goes on.
"""


from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from elastic import env
from elastic.event_chunks import ChunkWriter, is_url, read_texts

logger = logging.getLogger(__name__)

FORMAT_VERSION: Final = 1
SUFFIX: Final = ".jsonl"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
#: How long closing a log waits for its records to reach storage.
CLOSE_TIMEOUT_S: Final = 5.0
#: The keys every record has; an event's own fields never reuse them.
ENVELOPE: Final = frozenset({"v", "time", "job", "source", "node", "round", "event"})


def node_id(pid: int | None = None) -> str:
    """``host/pid`` of a node's agent (``pid`` defaults to this process)."""
    return f"{socket.gethostname()}/{os.getpid() if pid is None else pid}"


class EventSink(Protocol):
    """Where an :class:`EventLog` sends its records (a file, an object store, the agent, the
    metrics registry). A sink must not block its caller on I/O that can hang, and must not
    raise (the log catches and reports what it raises anyway)."""

    @property
    def enabled(self) -> bool:
        """Whether the sink still takes records (an unwritable log turns itself off)."""
        ...

    def write(self, record: Mapping[str, Any], durable: bool) -> None:
        """Takes one record; ``durable`` ones belong in the job log, the others are live
        telemetry only (a rank other than 0 reporting its step to its agent)."""
        ...

    def flush(self, timeout: float) -> bool:
        """Makes the records written so far durable; True if done within ``timeout`` s."""
        ...

    def close(self, timeout: float) -> None:
        """Flushes (up to ``timeout`` s) and releases the sink's resources."""
        ...


def takes_live(sink: EventSink) -> bool:
    """Whether ``sink`` wants records that are not durable (a sink says so with a
    ``takes_live`` attribute; without one it is assumed to)."""
    return bool(getattr(sink, "takes_live", True))


def write_many(sink: EventSink, items: Sequence[tuple[Mapping[str, Any], bool]]) -> None:
    """Hands ``items`` (``(record, durable)``, oldest first) to ``sink``: at once when it has
    a ``write_many`` method (one lock, one write for the lot), else one by one."""
    many = getattr(sink, "write_many", None)
    if many is not None:
        many(items)
        return
    for record, durable in items:
        sink.write(record, durable)


class FileSink:
    """Appends durable records as JSON lines to this process's own file under ``directory``.

    Each record is written and flushed as one line, so a reader never sees half of one (it may
    see a partial last line of a file still being written, and skips it). The file stays open
    between records (an agent writes a record per training step).
    """

    #: Records that are not durable never reach a file.
    takes_live: Final = False

    def __init__(self, directory: str | os.PathLike[str], *, job: str, source: str) -> None:
        name = ".".join(_UNSAFE.sub("_", part) for part in
                        (job, source, socket.gethostname(), str(os.getpid())))
        self.path = Path(os.fspath(directory).removeprefix("file://")) / f"{name}{SUFFIX}"
        self._lock = threading.Lock()
        self._file: Any = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        """False once the file could not be written."""
        return not self._failed

    def write(self, record: Mapping[str, Any], durable: bool) -> None:
        """Appends ``record`` if durable (never raises)."""
        self.write_many(((record, durable),))

    def write_many(self, items: Iterable[tuple[Mapping[str, Any], bool]]) -> None:
        """Appends the durable records of ``items`` with one write (never raises)."""
        if self._failed:
            return
        text = "".join([json.dumps(record, default=str) + "\n"
                        for record, durable in items if durable])
        if not text:
            return
        with self._lock:
            try:
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self.path.open("a", encoding="utf-8")
                self._file.write(text)
                self._file.flush()
            except OSError as exc:
                # An events directory must never take training down: report once, go on.
                self._failed = True
                logger.warning("Cannot write the event log %s (%s); events are off for this "
                               "process.", self.path, exc)

    def flush(self, timeout: float) -> bool:
        """Nothing to do: every line is flushed when recorded."""
        return not self._failed

    def close(self, timeout: float) -> None:
        """Closes the file."""
        with self._lock:
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None


def open_sink(location: str | os.PathLike[str], *, job: str, source: str,
              storage_options: Mapping[str, Any] | None = None) -> EventSink | None:
    """The log sink for ``location``: a :class:`FileSink` for a local directory, a
    :class:`~elastic.event_chunks.ChunkWriter` for a URL; ``None`` (logged) when the URL's
    backend cannot be used."""
    if not is_url(location):
        return FileSink(location, job=job, source=source)
    try:
        return ChunkWriter(os.fspath(location), job, storage_options=storage_options)
    except Exception as exc:  # an unknown scheme or a missing backend: report, train on
        logger.error("Cannot write the event log at %s (%s: %s); events are off for this "
                     "process.", location, type(exc).__name__, exc)
        return None


class EventLog:
    """Builds the records of one process and hands them to its sinks.

    Thread-safe; never raises.

    Args:
        directory: Where the log goes (a local directory or an fsspec URL); ``None``: no log
            (sinks may still be added, e.g. the metrics registry).
        job: The job id (``--job-id``).
        source: ``agent`` or ``worker``.
        node: ``host/pid`` of the node's agent (default: this process).
        storage_options: fsspec options for a URL.
    """

    def __init__(
        self, directory: str | os.PathLike[str] | None, *, job: str, source: str,
        node: str | None = None, storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.job = job
        self.source = source
        self.node = node or node_id()
        self._sinks: list[EventSink] = []
        # Whether any sink takes live-only records; if none does, record() builds none.
        self._live = False
        if directory:
            sink = open_sink(directory, job=job, source=source, storage_options=storage_options)
            if sink is not None:
                self.add_sink(sink)

    @classmethod
    def from_env(cls, *, source: str = "worker") -> EventLog:
        """The log of a worker: its agent's socket, or else the directory, from the environment.

        Under ``elastic-run`` (``ELASTIC_TELEMETRY_SOCKET`` set) records go to the node's agent
        (:mod:`elastic.telemetry`); otherwise durable ones go to ``ELASTIC_EVENTS_DIR``, if set.
        """
        agent_pid = os.environ.get(env.AGENT_PID, "")
        log = cls(
            None,
            job=os.environ.get(env.RUN_ID) or os.environ.get("TORCHELASTIC_RUN_ID", "none"),
            source=source,
            node=node_id(int(agent_pid)) if agent_pid.isdigit() else None,
        )
        socket_path = os.environ.get(env.TELEMETRY_SOCKET)
        directory = os.environ.get(env.EVENTS_DIR)
        if socket_path:
            from elastic.telemetry import TelemetrySink, shared_sender

            # Every worker of a node reports the same collective facts (steps, saves): one
            # reporter per node is enough for the node's metrics; rank 0's go to the job log.
            reporter = os.environ.get("LOCAL_RANK", "0") == "0"
            log.add_sink(TelemetrySink(shared_sender(socket_path), live=reporter))
        elif directory and is_url(directory):
            sink = _shared_chunk_writer(directory, log.job)
            if sink is not None:
                log.add_sink(sink)
        elif directory:
            log.add_sink(FileSink(directory, job=log.job, source=source))
        return log

    @property
    def sinks(self) -> tuple[EventSink, ...]:
        """The sinks records go to."""
        return tuple(self._sinks)

    @property
    def path(self) -> Path | None:
        """The local file this process appends to, if it has one."""
        return next((s.path for s in self._sinks if isinstance(s, FileSink)), None)

    @property
    def enabled(self) -> bool:
        """Whether records go anywhere."""
        return any(s.enabled for s in self._sinks)

    def add_sink(self, sink: EventSink) -> None:
        """Sends every later record to ``sink`` too."""
        self._sinks.append(sink)
        self._live = self._live or takes_live(sink)

    def record(self, event: str, *, round: int | None = None, durable: bool = True,
               **fields: Any) -> None:
        """Records one event (never raises).

        Args:
            event: The event's name (module doc).
            round: The rendezvous round (or the in-place world epoch), if any.
            durable: False for live telemetry only: the record reaches the node's metrics but
                not the job log (a rank other than 0 reporting its step).
            fields: The event's own fields.
        """
        # Called once per training step: cheap when nothing takes the record (a worker that
        # is not its node's reporter), and no work beyond one dict when something does.
        if not self._sinks or not (durable or self._live):
            return
        record: dict[str, Any] = {
            "v": FORMAT_VERSION, "time": round_time(time.time()), "job": self.job,
            "source": self.source, "node": self.node, "round": round, "event": event,
        }
        if ENVELOPE.isdisjoint(fields):
            record.update(fields)
        else:  # a caller's bug; the envelope must stay intact for every reader
            logger.warning("Event %s: dropping field(s) %s that name envelope keys.", event,
                           sorted(ENVELOPE & set(fields)))
            record.update((k, v) for k, v in fields.items() if k not in ENVELOPE)
        self.emit(record, durable=durable)

    def emit(self, record: Mapping[str, Any], *, durable: bool = True) -> None:
        """Hands an already built record (e.g. a worker's, received by the agent) to every
        sink (never raises)."""
        for sink in self._sinks:
            try:
                sink.write(record, durable)
            except Exception:  # a sink's bug must not reach the training or agent loop
                logger.exception("Event sink %s failed on a %s event.", type(sink).__name__,
                                 record.get("event"))

    def emit_many(self, items: Sequence[tuple[Mapping[str, Any], bool]]) -> None:
        """Hands already built ``(record, durable)`` items (a worker's batch, oldest first) to
        every sink, each sink taking the lot at once where it can (never raises)."""
        for sink in self._sinks:
            try:
                write_many(sink, items)
            except Exception:  # a sink's bug must not reach the agent loop
                logger.exception("Event sink %s failed on %d records.", type(sink).__name__,
                                 len(items))

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Makes every record so far durable; True if every sink did within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        return all([s.flush(max(0.0, deadline - time.monotonic())) for s in self._sinks])

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Flushes (up to ``timeout`` s in all) and closes every sink; records after this are
        dropped."""
        deadline = time.monotonic() + timeout
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            try:
                sink.close(max(0.0, deadline - time.monotonic()))
            except Exception:
                logger.exception("Closing event sink %s failed.", type(sink).__name__)


@functools.cache
def _shared_chunk_writer(location: str, job: str) -> ChunkWriter | None:
    """A worker without an agent writing to a URL: one writer per process, flushed at exit."""
    import atexit

    sink = open_sink(location, job=job, source="worker")
    if isinstance(sink, ChunkWriter):
        atexit.register(sink.close, CLOSE_TIMEOUT_S)
        return sink
    return None


def process_started_at(pid: int | None = None) -> float | None:
    """Wall-clock time (epoch seconds) at which ``pid`` (default: this process) started.

    From ``/proc`` (Linux); ``None`` where that cannot be read.
    """
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return round_time(boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def round_time(value: float) -> float:
    """Wall-clock seconds rounded to the millisecond (plenty for the report, shorter lines)."""
    return round(value, 3)


def read_events(location: str | os.PathLike[str],
                storage_options: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every well-formed event under ``location`` (a directory or URL), file by file (not
    sorted), in either layout (module doc).

    Lines that are not JSON objects with ``time`` and ``event`` (a partial last line of a file
    being written, say) are skipped.
    """
    for _path, text in read_texts(location, storage_options):
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("time"), (int, float)) \
                    and isinstance(record.get("event"), str):
                yield record
