"""The job event log: JSON lines that agents and workers append, read by the goodput report.

Enabled by ``elastic-run --events-dir DIR`` (or ``ELASTIC_EVENTS_DIR``); the agent exports the
directory to its workers. Each process appends to a file of its own, so no two writers share a
file, even on a shared file system::

    DIR/{job}.{source}.{host}.{pid}.jsonl      source: agent or worker

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
step                   step, duration_s (compute time of the step), world (global rank 0 only)
peer_failed            step, error (in place: a collective of the step failed because a peer
                       died; every survivor records it)
checkpoint             step, blocked_s (time the loop waited on the save), final, wait
                       ("commit": waiting for an earlier save's commit, not starting one)
restored               step (where training resumes), found (a checkpoint was loaded),
                       duration_s (time spent loading it)
=====================  ==========================================================================

Writing never raises: an unwritable directory is logged once and the job goes on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from elastic import env

logger = logging.getLogger(__name__)

FORMAT_VERSION: Final = 1
SUFFIX: Final = ".jsonl"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def node_id(pid: int | None = None) -> str:
    """``host/pid`` of a node's agent (``pid`` defaults to this process)."""
    return f"{socket.gethostname()}/{os.getpid() if pid is None else pid}"


class EventLog:
    """Appends events of one process to its own file under ``directory``.

    Thread-safe; each event is written and flushed as one line, so a reader never sees half
    of one (it may see a partial last line of a file still being written, and skips it).

    Args:
        directory: The events directory (created if missing); ``None`` disables the log.
        job: The job id (``--job-id``).
        source: ``agent`` or ``worker``.
        node: ``host/pid`` of the node's agent (default: this process).
    """

    def __init__(
        self, directory: str | os.PathLike[str] | None, *, job: str, source: str,
        node: str | None = None,
    ) -> None:
        self.job = job
        self.source = source
        self.node = node or node_id()
        self.path: Path | None = None
        self._lock = threading.Lock()
        self._failed = False
        if directory:
            name = ".".join(_UNSAFE.sub("_", part) for part in
                            (job, source, socket.gethostname(), str(os.getpid())))
            self.path = Path(directory) / f"{name}{SUFFIX}"

    @classmethod
    def from_env(cls, *, source: str = "worker") -> EventLog:
        """The log of a worker: directory, job and agent from elastic-run's environment."""
        agent_pid = os.environ.get(env.AGENT_PID, "")
        return cls(
            os.environ.get(env.EVENTS_DIR) or None,
            job=os.environ.get(env.RUN_ID) or os.environ.get("TORCHELASTIC_RUN_ID", "none"),
            source=source,
            node=node_id(int(agent_pid)) if agent_pid.isdigit() else None,
        )

    @property
    def enabled(self) -> bool:
        """Whether events are written anywhere."""
        return self.path is not None and not self._failed

    def record(self, event: str, *, round: int | None = None, **fields: Any) -> None:
        """Appends one event (never raises)."""
        if self.path is None or self._failed:
            return
        record: dict[str, Any] = {
            "v": FORMAT_VERSION, "time": round_time(time.time()), "job": self.job,
            "source": self.source, "node": self.node, "round": round, "event": event,
        }
        clashes = sorted(set(fields) & set(record))
        if clashes:  # a caller's bug; the envelope must stay intact for every reader
            logger.warning("Event %s: dropping field(s) %s that name envelope keys.", event,
                           clashes)
        record.update((k, v) for k, v in fields.items() if k not in record)
        line = json.dumps(record, default=str)
        with self._lock:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(line + "\n")
            except OSError as exc:
                # An events directory must never take training down: report once, go on.
                self._failed = True
                logger.warning("Cannot write the event log %s (%s); events are off for this "
                               "process.", self.path, exc)


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


def read_events(directory: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every well-formed event under ``directory``, file by file (not sorted).

    Lines that are not JSON objects with ``time`` and ``event`` (a partial last line of a file
    being written, say) are skipped.
    """
    for path in sorted(Path(directory).glob(f"*{SUFFIX}")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            logger.warning("Skipping the unreadable event log %s (%s).", path, exc)
            continue
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("time"), (int, float)) \
                    and isinstance(record.get("event"), str):
                yield record
