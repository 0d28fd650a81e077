"""The goodput report of a job, from its event log (:mod:`elastic.eventlog`).

``elastic-run goodput EVENTS_DIR [--job ID] [--json] [--plot OUT.png]`` (or
``python -m launch.goodput``) prints, per job found in the event log (a local directory or an
fsspec URL such as ``s3://bucket/job/events``, with ``--storage-option k=v``):

* wall time: the first agent's start (its process start, where logged) to the last agent's
  exit;
* productive time: the compute time of every step that counts (the last execution of each
  step index); executions of a step index that was later redone (after a rollback to a
  checkpoint) are *recomputed* time instead; goodput is productive time over wall time;
* checkpoint stalls: the time the training loop waited on saves;
* the rendezvous rounds, each with why it started and its recovery time (the last step of the
  round before to the first step of this one);
* departures, planned (a preemption notice: the node drained and left) apart from failures (a
  node lost without notice, or a crashed worker).

* the wall time split into ``breakdown``: productive, recomputed, checkpoint (stalls),
  detection, rendezvous, restore and other (what is left: loop overhead between steps, the
  exit barrier); the parts add up to the wall time;
* the membership changes, each with its recovery time split the same way: *detection* from
  the last step before the change to the first agent that noticed it (a ``worker_failed``,
  ``node_lost``, ``peer_departed`` or ``planned_departure`` event), or, in place, to the first
  worker whose collective failed (``peer_failed``); zero for a joining node, which nobody has
  to detect; *rendezvous* from there to the new round's start, *restore*
  from the round's start to its first step's start (new workers, process group, checkpoint
  load; ``load_s`` is the checkpoint load alone). The job's start counts as rendezvous (first
  agent start to the first round) and restore (to the first step);
* ``timeline``: the same intervals as ``[start, end, kind]`` seconds after the job's start,
  consecutive steps merged, and ``worlds`` as ``[time, world]`` points, for
  ``--plot OUT.png`` (a timeline picture; needs matplotlib, the ``plot`` extra).

Every agent started with ``--events-dir`` ends with this summary: printed to stderr at its exit
and written to ``DIR/{job}.goodput.json`` (:func:`write_summary`; the last agent to exit writes
the complete one).

Step and checkpoint times come from the workers' ``step``/``checkpoint`` events (written by
``ElasticLoop`` on global rank 0); without them the report still lists rounds and departures,
and productive time is unknown.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

from elastic.event_chunks import filesystem, is_url
from elastic.eventlog import read_events
from elastic_errors import ConfigError

logger = logging.getLogger(__name__)
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_.-]+")
_REASON_ORDER: Final = ("planned_departure", "node_lost", "worker_failed", "peer_failed",
                        "node_joined", "start")
#: Agents' events that notice a membership change (the end of its detection).
NOTICED: Final = ("worker_failed", "node_lost", "peer_departed", "planned_departure")
#: Noticed by the workers themselves (in place), before any agent does.
NOTICED_BY_WORKERS: Final = ("peer_failed",)
#: Every reason a membership change can be given (``Change.reason``).
CHANGE_REASONS: Final = ("planned_departure", "node_lost", "worker_failed", "peer_failed",
                         "node_joined", "node_left", "world_changed")
#: Parts of the wall time, in the order they are printed and plotted.
PARTS: Final = ("productive", "recomputed", "checkpoint", "detection", "rendezvous", "restore",
                "other")
#: Steps closer than this are drawn as one interval of the timeline.
_MERGE_GAP_S: Final = 0.25


@dataclass(frozen=True, slots=True)
class Round:
    """One rendezvous round as the agents reported it."""

    round: int
    started_at: float
    """Seconds after the job's start."""
    world: int | None
    reason: str
    first_step_at: float | None = None
    recovery_s: float | None = None
    """Last step of the previous round to the first step of this one."""


@dataclass(frozen=True, slots=True)
class Departure:
    """A node that left the job before it finished."""

    node: str
    at: float
    """Seconds after the job's start."""
    round: int | None
    planned: bool
    cause: str
    """The notice's source (aws, gcp, azure, sigterm) or ``node_lost``/``crash``."""
    drained: bool | None = None
    """Planned only: whether its workers stopped (and checkpointed) within the budget."""


@dataclass(frozen=True, slots=True)
class Change:
    """One membership change (a round after the first that trained), with its recovery time."""

    round: int
    """The round (in place: the world epoch) that resumed training; -1 if unknown."""
    reason: str
    at: float
    """End of the last step before the change, seconds after the job's start."""
    world_before: int | None
    world_after: int | None
    detection_s: float
    rendezvous_s: float
    restore_s: float
    load_s: float | None
    """Checkpoint load alone (part of restore), from the loop's ``restored`` event."""
    recovery_s: float
    """Last step before to first step start after: detection + rendezvous + restore."""
    rounds: int = 0
    """Agent rounds started during the change (0 in place; more than one when a round
    failed early)."""


@dataclass(slots=True)
class Report:
    """Goodput and membership history of one job."""

    job: str
    wall_s: float
    productive_s: float | None
    recomputed_s: float
    recomputed_steps: int
    checkpoint_s: float
    steps: int
    finished: bool
    rounds: list[Round] = field(default_factory=list)
    departures: list[Departure] = field(default_factory=list)
    worker_failures: list[dict[str, Any]] = field(default_factory=list)
    breakdown: dict[str, float] = field(default_factory=dict)
    """Wall time by part (:data:`PARTS`), seconds; empty without step events."""
    training_s: float | None = None
    """First step's start to the last step's end (the job minus start-up and shut-down)."""
    changes: list[Change] = field(default_factory=list)
    timeline: list[tuple[float, float, str]] = field(default_factory=list)
    worlds: list[tuple[float, int]] = field(default_factory=list)

    @property
    def goodput(self) -> float | None:
        """Productive time over wall time (None without step events)."""
        if self.productive_s is None or self.wall_s <= 0:
            return None
        return self.productive_s / self.wall_s

    @property
    def training_goodput(self) -> float | None:
        """Productive time over :attr:`training_s`: goodput once training runs, which is what
        a long job converges to (start-up and shut-down are paid once)."""
        if self.productive_s is None or not self.training_s:
            return None
        return self.productive_s / self.training_s

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict (``goodput`` and ``training_goodput`` included)."""
        return {**asdict(self), "goodput": self.goodput,
                "training_goodput": self.training_goodput}


def load(directory: str, storage_options: Mapping[str, Any] | None = None,
         ) -> dict[str, list[dict[str, Any]]]:
    """Events under ``directory`` (a local directory or an fsspec URL) grouped by job, each
    list in time order."""
    jobs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in read_events(directory, storage_options):
        jobs[str(event.get("job", ""))].append(event)
    for events in jobs.values():
        events.sort(key=lambda e: float(e["time"]))
    return dict(jobs)


def _of(events: Iterable[dict[str, Any]], *kinds: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] in kinds]


def _rounds(events: list[dict[str, Any]], t0: float, steps: list[dict[str, Any]]) -> list[Round]:
    by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in _of(events, "round_started"):
        if isinstance(e.get("round"), int):
            by_round[e["round"]].append(e)
    first_step: dict[int, float] = {}
    last_step: dict[int, float] = {}
    for s in steps:
        r = s.get("round")
        if isinstance(r, int):
            first_step.setdefault(r, s["time"])
            last_step[r] = s["time"]
    rounds = []
    for number in sorted(by_round):
        starts = by_round[number]
        reasons = [str(e.get("reason", "")) for e in starts]
        reason = min(reasons, key=lambda r: _REASON_ORDER.index(r)
                     if r in _REASON_ORDER else len(_REASON_ORDER))
        worlds = [int(e["world"]) for e in starts if isinstance(e.get("world"), int)]
        first = first_step.get(number)
        before = [t for r, t in last_step.items() if r < number]
        recovery = first - max(before) if first is not None and before else None
        rounds.append(Round(
            round=number, started_at=min(e["time"] for e in starts) - t0,
            world=max(worlds) if worlds else None, reason=reason,
            first_step_at=None if first is None else first - t0,
            recovery_s=None if recovery is None else round(recovery, 3),
        ))
    return rounds


def _departures(events: list[dict[str, Any]], t0: float) -> list[Departure]:
    drained = {e["node"]: e.get("drained") for e in _of(events, "left_rendezvous")}
    out = [
        Departure(node=e["node"], at=e["time"] - t0, round=e.get("round"), planned=True,
                  cause=str(e.get("notice", "")), drained=drained.get(e["node"]))
        for e in _of(events, "planned_departure")
    ]
    planned_nodes = {d.node for d in out}
    # (round, group rank) -> node, from each agent's own round_started events.
    node_at = {(e.get("round"), e.get("group_rank")): e["node"]
               for e in _of(events, "round_started")}
    seen: set[tuple[Any, Any]] = set()
    for e in _of(events, "node_lost"):
        for rank in e.get("ranks", []):
            key = (e.get("round"), rank)
            node = node_at.get(key, f"rank {rank}")
            if key in seen or node in planned_nodes:
                continue
            seen.add(key)
            out.append(Departure(node=node, at=e["time"] - t0, round=e.get("round"),
                                 planned=False, cause="node_lost"))
    return sorted(out, key=lambda d: d.at)


def build_report(job: str, events: list[dict[str, Any]]) -> Report:
    """Compute the report of one job from its events (in time order)."""
    agent = [e for e in events if e.get("source") == "agent"] or events
    # From the first agent's process start where it was logged: the stopwatch of a person
    # who launched the job counts the interpreter's start-up too.
    t0 = min(min(e["time"], e.get("launched_at") or e["time"])
             for e in (_of(agent, "agent_started") or agent))
    exits = _of(agent, "agent_exited")
    t1 = max(e["time"] for e in (exits or events))
    steps = _of(events, "step")
    last: dict[int, dict[str, Any]] = {}
    for s in steps:
        last[int(s["step"])] = s  # time order: the last execution wins
    counted = {id(s) for s in last.values()}
    redone = [s for s in steps if id(s) not in counted]
    productive = sum(float(s.get("duration_s") or 0.0) for s in last.values())
    failures = [
        {"node": e["node"], "at": e["time"] - t0, "round": e.get("round"),
         "cause": e.get("cause"), "exit_codes": e.get("exit_codes")}
        for e in _of(agent, "worker_failed")
    ]
    breakdown, changes, timeline, worlds = _split(agent, events, steps, redone, t0, t1)
    return Report(
        job=job, wall_s=max(0.0, t1 - t0),
        productive_s=productive if steps else None,
        recomputed_s=sum(float(s.get("duration_s") or 0.0) for s in redone),
        recomputed_steps=len(redone),
        checkpoint_s=sum(float(e.get("blocked_s") or 0.0) for e in _of(events, "checkpoint")),
        steps=len(last),
        finished=bool(_of(agent, "job_finished")),
        rounds=_rounds(agent, t0, steps),
        departures=_departures(agent, t0),
        worker_failures=failures,
        breakdown=breakdown, changes=changes, timeline=timeline, worlds=worlds,
        training_s=None if not steps else round(
            max(float(s["time"]) for s in steps)
            - min(float(s["time"]) - float(s.get("duration_s") or 0.0) for s in steps), 3),
    )


@dataclass(frozen=True, slots=True)
class ChangeSplit:
    """Why one membership change happened and where its recovery's parts begin."""

    reason: str
    detected: float
    """When the change was first noticed (the end of the last step before it when nobody had
    to notice it: a node joining is announced, not detected)."""
    began: float
    """When the last agent round of the change started (``detected`` without one: in place,
    forming the new world and healing count as restore)."""
    rounds: int
    """Agent rounds started during the change."""


def split_change(
    ended: float, resumed: float, noticed: Sequence[tuple[float, str]],
    starts: Sequence[tuple[float, str]], world_before: int | None, world_after: int | None,
) -> ChangeSplit:
    """Splits one membership change's recovery into detection, rendezvous and restore.

    The recovery runs from ``ended`` (the end of the last step before the change) to
    ``resumed`` (the start of the first step after it): *detection* up to the first event in
    ``noticed`` within it, *rendezvous* from there to the start of the last agent round within
    it (in ``starts``), *restore* from there to ``resumed``. Shared by the report and the live
    metrics (:mod:`launch.metrics`), so that both split a recovery the same way.

    Args:
        ended: End of the last step before the change (epoch seconds).
        resumed: Start of the first step after it.
        noticed: ``(time, event)`` of the agents' :data:`NOTICED` events and the workers'
            :data:`NOTICED_BY_WORKERS` ones, in time order.
        starts: ``(time, reason)`` of the agents' ``round_started`` events, in time order.
        world_before: World size (ranks) before the change, if known.
        world_after: World size after it, if known.
    """
    seen = [(t, kind) for t, kind in noticed if ended <= t <= resumed]
    # Nothing noticed (a node joining is announced, not detected): no detection time.
    detected = seen[0][0] if seen else ended
    rounds_in = [(t, reason) for t, reason in starts if detected <= t <= resumed]
    # No agent round (in place): forming the new world and healing count as restore.
    began = max(t for t, _ in rounds_in) if rounds_in else detected
    # What the agents saw (a lost node, a crash) outranks a round's own label: in place,
    # a round that admits nobody new can still be labelled node_joined. The round's cause
    # counts even when it reached this node before its workers noticed anything (the
    # world's cause is the job's, the same on every node).
    labelled = [(t, r) for t, r in starts if ended <= t <= resumed]
    reasons = [r for _, r in labelled if r != "start"] + [
        {"peer_departed": "planned_departure"}.get(kind, kind) for _, kind in seen]
    if reasons:
        reason = min(reasons, key=lambda r: _REASON_ORDER.index(r)
                     if r in _REASON_ORDER else len(_REASON_ORDER))
    else:
        # Seen by the workers first (in place): the world size tells which way it went.
        size_before, size_after = world_before or 0, world_after or 0
        reason = ("node_joined" if size_after > size_before else
                  "node_left" if size_after < size_before else "world_changed")
    return ChangeSplit(reason=reason, detected=detected, began=began, rounds=len(rounds_in))


def _merge(intervals: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Sorted intervals with touching ones of the same kind merged (a readable timeline)."""
    out: list[tuple[float, float, str]] = []
    for start, end, kind in sorted(intervals):
        if out and out[-1][2] == kind and start - out[-1][1] <= _MERGE_GAP_S:
            out[-1] = (out[-1][0], max(out[-1][1], end), kind)
        else:
            out.append((start, end, kind))
    return [(round(a, 3), round(b, 3), k) for a, b, k in out]


def _split(
    agent: list[dict[str, Any]], events: list[dict[str, Any]], steps: list[dict[str, Any]],
    redone: list[dict[str, Any]], t0: float, t1: float,
) -> tuple[dict[str, float], list[Change], list[tuple[float, float, str]],
           list[tuple[float, int]]]:
    """The wall-time breakdown, membership changes, timeline and world sizes (module doc)."""
    if not steps:
        return {}, [], [], []
    redone_ids = {id(s) for s in redone}
    intervals: list[tuple[float, float, str]] = []
    for s in steps:
        end = float(s["time"])
        start = end - float(s.get("duration_s") or 0.0)
        intervals.append((start - t0, end - t0,
                          "recomputed" if id(s) in redone_ids else "productive"))
    for e in _of(events, "checkpoint"):
        blocked = float(e.get("blocked_s") or 0.0)
        if blocked > 0:
            intervals.append((e["time"] - blocked - t0, e["time"] - t0, "checkpoint"))
    # Times of the agents' rounds, matched to a change by time, not by number: in place
    # (--elastic-mode inplace) the workers label their steps with their own world epoch.
    starts = sorted((float(e["time"]), str(e.get("reason", ""))) for e in
                    _of(agent, "round_started"))
    loads = {e.get("round"): float(e.get("duration_s") or 0.0) for e in _of(events, "restored")}
    first_start: dict[Any, float] = {}
    last_end: dict[Any, float] = {}
    world_of: dict[Any, int] = {}
    for s in sorted(steps, key=lambda e: float(e["time"])):
        label = s.get("round")
        first_start.setdefault(label, float(s["time"]) - float(s.get("duration_s") or 0.0))
        last_end[label] = float(s["time"])
        if isinstance(s.get("world"), int):
            world_of.setdefault(label, s["world"])
    trained = sorted(first_start, key=lambda label: first_start[label])
    noticed = sorted((float(e["time"]), str(e["event"])) for e in
                     [*_of(agent, *NOTICED), *_of(events, *NOTICED_BY_WORKERS)])
    changes: list[Change] = []
    if trained:
        # The start: first agent up to the first round (rendezvous), then to the first step.
        resumed = first_start[trained[0]]
        begin = min([t for t, _ in starts if t <= resumed] or [resumed])
        intervals.append((0.0, begin - t0, "rendezvous"))
        intervals.append((begin - t0, resumed - t0, "restore"))
    for before, after in itertools.pairwise(trained):
        ended, resumed = last_end[before], first_start[after]
        split = split_change(ended, resumed, noticed, starts, world_of.get(before),
                             world_of.get(after))
        parts = (("detection", ended, split.detected), ("rendezvous", split.detected,
                                                        split.began),
                 ("restore", split.began, resumed))
        intervals.extend((a - t0, b - t0, kind) for kind, a, b in parts)
        changes.append(Change(
            round=after if isinstance(after, int) else -1, reason=split.reason,
            at=round(ended - t0, 3),
            world_before=world_of.get(before), world_after=world_of.get(after),
            detection_s=round(split.detected - ended, 3),
            rendezvous_s=round(split.began - split.detected, 3),
            restore_s=round(resumed - split.began, 3),
            load_s=loads.get(after), recovery_s=round(resumed - ended, 3),
            rounds=split.rounds,
        ))
    breakdown = dict.fromkeys(PARTS, 0.0)
    for start, end, kind in intervals:
        breakdown[kind] += max(0.0, end - start)
    breakdown["other"] = max(0.0, (t1 - t0) - sum(breakdown.values()))
    worlds: list[tuple[float, int]] = []
    for s in steps:
        w = s.get("world")
        if isinstance(w, int) and (not worlds or worlds[-1][1] != w):
            worlds.append((round(float(s["time"]) - t0, 3), w))
    return ({k: round(v, 3) for k, v in breakdown.items()}, changes, _merge(intervals),
            worlds)


def format_report(report: Report) -> str:
    """The report as text for a terminal."""
    lines = [f"job {report.job}: {'finished' if report.finished else 'not finished'}",
             f"  wall time          {report.wall_s:9.1f} s"]
    if report.productive_s is None:
        lines.append("  productive         (no step events: goodput unknown)")
    else:
        lines.append(f"  productive         {report.productive_s:9.1f} s   goodput "
                     f"{report.goodput or 0.0:.3f} ({report.steps} steps)")
        lines.append(f"  training           {report.training_s or 0.0:9.1f} s   goodput "
                     f"{report.training_goodput or 0.0:.3f} (first step to last step)")
    lines.append(f"  recomputed         {report.recomputed_s:9.1f} s   "
                 f"({report.recomputed_steps} steps redone)")
    lines.append(f"  checkpoint stalls  {report.checkpoint_s:9.1f} s")
    if report.breakdown:
        wall = report.wall_s or 1.0
        lines.append("  wall time by part:")
        for part in PARTS:
            value = report.breakdown.get(part, 0.0)
            lines.append(f"    {part:<12} {value:9.1f} s  {100 * value / wall:5.1f} %")
    if report.changes:
        lines.append("  membership changes (recovery = detection + rendezvous + restore):")
    for c in report.changes:
        load = "" if c.load_s is None else f" (load {c.load_s:.2f})"
        lines.append(
            f"    +{c.at:7.1f} s  round {c.round:<3} {c.reason:<17} world {c.world_before}"
            f"->{c.world_after}  recovery {c.recovery_s:5.2f} s = {c.detection_s:.2f} + "
            f"{c.rendezvous_s:.2f} + {c.restore_s:.2f}{load}")
    lines.append("  rounds:")
    for r in report.rounds:
        recovery = "" if r.recovery_s is None else f"  recovery {r.recovery_s:.1f} s"
        lines.append(f"    round {r.round:<3} +{r.started_at:7.1f} s  world {r.world}  "
                     f"{r.reason}{recovery}")
    lines.append("  departures:" if report.departures else "  departures: none")
    for d in report.departures:
        if d.planned:
            how = "drained" if d.drained else ("killed" if d.drained is False else "?")
            what = f"planned ({d.cause} notice, workers {how})"
        else:
            what = f"failure ({d.cause})"
        lines.append(f"    +{d.at:7.1f} s  {d.node}  round {d.round}  {what}")
    crashes = [f for f in report.worker_failures if f["cause"] == "crash"]
    lines.append(f"  worker failures charged as crashes: {len(crashes)}")
    for f in crashes:
        lines.append(f"    +{f['at']:7.1f} s  {f['node']}  round {f['round']}  "
                     f"exit codes {f['exit_codes']}")
    return "\n".join(lines)


def write_summary(events_dir: str, job: str, *, out: TextIO | None = None,
                  storage_options: Mapping[str, Any] | None = None) -> Report | None:
    """At an agent's exit: the job's report as seen so far, to ``DIR/{job}.goodput.json``
    (replaced atomically; the last agent to exit writes the complete one) and as text to
    ``out`` (stderr by default). Never raises: the job's outcome is decided already.

    ``events_dir`` may be a URL; then the agent's own records must be flushed first
    (:meth:`elastic.eventlog.EventLog.close`).
    """
    try:
        events = load(events_dir, storage_options).get(job)
        if not events:
            return None
        report = build_report(job, events)
        name = f"{_UNSAFE.sub('_', job)}.goodput.json"
        text = json.dumps(report.to_json(), indent=2)
        if is_url(events_dir):
            fs, root = filesystem(events_dir, storage_options)
            where = f"{events_dir.rstrip('/')}/{name}"
            fs.pipe_file(f"{root.rstrip('/')}/{name}", text.encode())  # one put: atomic
        else:
            path = Path(events_dir.removeprefix("file://")) / name
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
            where = str(path)
        stream = sys.stderr if out is None else out
        stream.write(format_report(report) + f"\n  (JSON: {where}; timeline: elastic-run goodput "
                     f"{events_dir} --job {job} --plot timeline.png)\n")
        stream.flush()
        return report
    except Exception as exc:  # a summary must never change how the agent exits
        logger.warning("Could not write the goodput summary under %s (%s).", events_dir, exc)
        return None


def parse_storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``k=v`` flags as fsspec storage options: JSON values where they parse (numbers, true,
    objects), strings otherwise; ``client_kwargs.endpoint_url=...`` sets a nested key.

    Raises:
        ConfigError: a flag is not ``k=v``.
    """
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option ({pair}) is not KEY=VALUE; pass for example "
                              "--storage-option client_kwargs.endpoint_url=http://host:9000.")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = key.strip().split(".")
        target = options
        for parent in parents:
            target = target.setdefault(parent, {})
            if not isinstance(target, dict):
                raise ConfigError(f"--storage-option ({pair}) sets a key inside {parent!r}, "
                                  "which another flag set to a value; pass each key once.")
        target[leaf] = value
    return options


def main(argv: Sequence[str] | None = None) -> int:
    """``elastic-run goodput EVENTS_DIR``; exit 0, or 2 when the directory has no events."""
    parser = argparse.ArgumentParser(prog="elastic-run goodput",
                                     description="Goodput report of a job's event log.")
    parser.add_argument("events_dir", help="the --events-dir of the job (a directory or an "
                        "fsspec URL such as s3://bucket/job/events)")
    parser.add_argument("--job", default=None, help="only this job id (default: every job)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--plot", metavar="OUT.png", default=None,
                        help="also draw the timeline of the job (one job: pass --job when the "
                             "directory has several) as a PNG; needs matplotlib")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an fsspec storage option for a URL (repeatable), e.g. "
                        "client_kwargs.endpoint_url=http://minio:9000; fsspec also reads "
                        "FSSPEC_S3_ENDPOINT_URL and the like from the environment")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        jobs = load(args.events_dir, parse_storage_options(args.storage_option))
    except ConfigError as exc:
        sys.stderr.write(f"elastic-run goodput: error: {exc}\n")
        return 2
    except (OSError, ValueError, ImportError) as exc:
        sys.stderr.write(f"elastic-run goodput: error: cannot read the event log at "
                         f"{args.events_dir} ({type(exc).__name__}: {exc}); check the URL, "
                         "its storage options and credentials.\n")
        return 2
    if args.job is not None:
        jobs = {k: v for k, v in jobs.items() if k == args.job}
    if not jobs:
        what = f"job {args.job!r}" if args.job else "any job"
        sys.stderr.write(f"elastic-run goodput: error: no events of {what} under "
                         f"{args.events_dir}; pass the job's --events-dir.\n")
        return 2
    reports = [build_report(job, events) for job, events in sorted(jobs.items())]
    if args.plot is not None:
        if len(reports) != 1:
            sys.stderr.write(f"elastic-run goodput: error: --plot draws one job but "
                             f"{args.events_dir} has {len(reports)} "
                             f"({', '.join(r.job for r in reports)}); pass --job ID.\n")
            return 2
        try:
            from launch.goodput_plot import plot
        except ImportError as exc:
            sys.stderr.write(f"elastic-run goodput: error: --plot needs matplotlib ({exc}); "
                             "install the 'plot' extra: pip install 'elastic-run[plot]'.\n")
            return 2
        plot(reports[0].to_json(), args.plot)
    if args.json:
        print(json.dumps([r.to_json() for r in reports], indent=2))
    else:
        print("\n\n".join(format_report(r) for r in reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
