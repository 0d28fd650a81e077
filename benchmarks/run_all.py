"""Every benchmark in one go, side by side with torchrun and the physical floors: one table.

Runs each script of ``benchmarks/`` as a subprocess (this interpreter, from the repository
root, with a timeout), passing ``--json`` to a file in a work directory it prints; each
script's stdout (its own Markdown table) and stderr go to log files there. From the JSON files
it builds ONE summary table, a row per headline figure::

    | benchmark | measure | elastic-run | baseline | ratio | goal | met? |

where the baseline is torchrun, c10d, DCP ``async_save``, the copy or disk floor, or raw s3fs
puts, and the goals are those set in the issues (checkpoint blocking <= 1.5x the copy floor,
durable <= 1.3x the disk floor and <= 1.3x raw s3fs puts, CUDA checkpoint blocking <= 1.5x
the device-to-pinned-host copy floor, and in training on a GPU each save's stall <= 1.5x
that floor with the loop's step time <= 1.003x plain DDP's; goodput >= 0.95 and above
torchrun's; live metrics cost under 1 % of step time; the sampler's resident memory under
10 MB at a billion samples; the managed loop at most 0.3 ms per step over plain DDP; a
1024-node rendezvous round under 10 s, at 128 nodes no slower than c10d; an FSDP2 model's
recovery in place at most 1/5 of the restart path's, its peer copies costing <= 1.01x step
time; in restart mode, a plain torchrun script's survivors stall at most 2 s after a worker
kill and 3 s after a node kill). Below it come each benchmark's own detailed table, then the
command line, date, commit and machine. A benchmark that fails or times out is shown as
failed (with its log) and the others still run; one that cannot run on this machine (the
CUDA benchmarks without a GPU) exits 0 with
``{"skipped": reason}`` as its JSON and is shown as skipped.

Two presets: the default runs the settings each script's docstring gives for the published
figures (about two hours on 2 cores); ``--quick`` runs small settings for a smoke
check (minutes). The table is printed, and written to ``benchmarks/RESULTS.md`` when every
chosen benchmark succeeded under the full preset; ``--out FILE`` writes it in every case (so a
quick or failed run never overwrites the published table by accident).

Usage::

    python benchmarks/run_all.py [--quick] [--only rendezvous,checkpoint] [--out FILE]
        [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT_DIR = REPO / "benchmarks"
DEFAULT_OUT = SCRIPT_DIR / "RESULTS.md"
#: After a timeout, how long a benchmark gets to stop its agents and etcd (SIGINT runs its
#: ``finally`` blocks) before its whole process tree is SIGKILLed.
STOP_GRACE_S = 30.0
MiB = 1 << 20

# Goals set in the issues.
CKPT_BLOCKING_GOAL = 1.5  # ours blocking / copy floor
CKPT_DURABLE_GOAL = 1.3  # ours durable / disk floor, and ours on S3 / raw s3fs puts
GOODPUT_GOAL = 0.95  # and above torchrun's
METRICS_OVERHEAD_GOAL = 1.01  # step time with live metrics on / off
GPU_STEP_GOAL = 1.003  # the loop's step time / plain DDP's, in training on a GPU
SHARDED_RECOVERY_GOAL = 0.2  # sharded in place, kill to next step / restart + DCP load's
SHARDED_COPIES_GOAL = 1.01  # sharded step time with peer copies on / off
SAMPLER_MEMORY_GOAL_BYTES = 10e6  # the sampler's resident memory at N = 1e9
SAMPLER_GOAL_SIZE = 10**9
RESTART_GOALS = {"worker": 2.0, "node": 3.0}  # restart mode, plain script: the survivors' stall

# Names the scripts write into their JSON (tests check they still occur in the scripts).
CKPT_COPY_FLOOR = "floor: copy into reused host memory"
CKPT_DISK_FLOOR = "floor: raw write + fsync"
CKPT_DCP_ASYNC = "DCP async_save"
CKPT_OURS = "ours (CheckpointManager)"
CKPT_S3_RAW = "s3: raw s3fs puts (4 in parallel)"
CKPT_S3_RAW_ZERO_COPY = "s3: raw s3fs puts, zero-copy body"
CKPT_S3_OURS = "s3: ours"
CUDA_FLOOR = "floor: device-to-pinned-host copy"
CUDA_OURS = "ours (CheckpointManager)"
CUDA_DCP_CACHED = "DCP async_save, cache_staged_state_dict=True"
CUDA_DCP_STAGER = "DCP async_save, DefaultStager (pinned, non-blocking)"
SAMPLER_OURS = "feistel"
SAMPLER_BASELINES = {"randperm sampler": "torch.randperm sampler (before)",
                     "randperm tensor": "torch.randperm tensor alone"}
PHASE_LABELS = {"worker_kill": "worker SIGKILL", "node_loss": "node loss"}


# -------------------------------------------------------------------------------- summary rows


@dataclass(frozen=True)
class Row:
    """One headline figure of the summary table (or a benchmark that produced none).

    Attributes:
        benchmark: Short benchmark name (``recovery``, ``checkpoint``...).
        measure: What is compared, with its conditions.
        ours: elastic-run's value, or ``None`` when it was not measured.
        baseline: The baseline's value, or ``None``.
        baseline_name: What the baseline is (``torchrun``, ``copy floor``...).
        unit: ``"s"``, ``"ms"`` (seconds shown in milliseconds), ``""`` (a fraction),
            ``"steps"``, ``"MiB"``.
        speedup: The ratio is ``baseline / ours`` (a speed-up) instead of ``ours / baseline``.
        goal: The goal in words, empty when the issues set none.
        met: Whether the goal is met; ``None`` without a goal or without the values.
        ours_note: Appended to elastic-run's cell (runs measured, hangs, faults).
        baseline_note: Appended to the baseline's cell.
        failed: Why the benchmark gave no figures (then the other fields are unused).
        skipped: Why the benchmark could not run on this machine (then the others are unused).
    """

    benchmark: str
    measure: str
    ours: float | None = None
    baseline: float | None = None
    baseline_name: str = ""
    unit: str = "s"
    speedup: bool = False
    goal: str = ""
    met: bool | None = None
    ours_note: str = ""
    baseline_note: str = ""
    failed: str = ""
    skipped: str = ""

    @property
    def ratio(self) -> float | None:
        """``ours / baseline``, or ``baseline / ours`` for a speed-up; ``None`` if undefined."""
        if self.ours is None or self.baseline is None:
            return None
        num, den = (self.baseline, self.ours) if self.speedup else (self.ours, self.baseline)
        return num / den if den > 0 else None


def _median(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return statistics.median(vals) if vals else None


def _at_most(ratio: float | None, limit: float) -> bool | None:
    return None if ratio is None else ratio <= limit


def _runs_note(measured: int, total: int, hung: int) -> str:
    """Says how many runs a median is of, when not all of them."""
    if measured == total and not hung:
        return ""
    note = f"{measured} of {total} runs"
    return f"{note}, {hung} hung" if hung else note


def _phase(runs: list[dict[str, Any]], launcher: str, phase: str,
           key: str = "times") -> tuple[float | None, str]:
    """Median of ``run[key][phase]`` over ``launcher``'s runs, and a note on runs missing."""
    mine = [r for r in runs if r.get("launcher") == launcher]
    vals = [float(r[key][phase]) for r in mine if phase in r.get(key, {})]
    hung = sum(1 for r in mine if phase in r.get("hung", []))
    return _median(vals), _runs_note(len(vals), len(mine), hung)


def recovery_rows(runs: list[dict[str, Any]], stdout: str = "") -> list[Row]:
    """Rows of ``recovery_vs_torchrun.py --json`` (a list of its ``Run`` dicts).

    Per recovery phase, elastic-run's median against each torchrun variant that ran; the
    ratio is the speed-up (torchrun / elastic-run).
    """
    del stdout
    launchers = {r.get("launcher") for r in runs}
    baselines = [(name, label) for name, label in (
        ("torchrun-default", "torchrun"),
        ("torchrun-noshare", "torchrun, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
    ) if name in launchers]
    if "elastic-run" not in launchers:
        return []
    rows = []
    for phase in ("worker_kill", "node_loss"):
        ours, ours_note = _phase(runs, "elastic-run", phase)
        for name, label in baselines:
            base, base_note = _phase(runs, name, phase)
            rows.append(Row("recovery", f"{PHASE_LABELS[phase]}: kill to first step, median",
                            ours, base, label, speedup=True, ours_note=ours_note,
                            baseline_note=base_note))
    return rows


def restart_rows(runs: list[dict[str, Any]], stdout: str = "") -> list[Row]:
    """Rows of ``restart_path.py --json`` (a list of its ``Run`` dicts).

    Per fault: elastic-run's median stall (restart mode, the plain torchrun script) against
    torchrun's in the same run, the speed-up as ratio, and the goal (a worker kill costs the
    survivors at most 2 s, a node kill at most 3 s); where the run measured it, the same with
    ``--warm-standby off --memory-checkpoints off`` (``elastic-run-off``: the restart path
    without its caches, no goal).
    """
    del stdout

    def stalls(launcher: str, fault: str) -> tuple[float | None, str]:
        mine = [r for r in runs if r.get("launcher") == launcher]
        vals = [r["faults"][fault]["stall"] for r in mine
                if (r.get("faults", {}).get(fault) or {}).get("stall") is not None]
        return _median(vals), _runs_note(len(vals), len(mine), 0)

    if not any(r.get("launcher") == "elastic-run" for r in runs):
        return []
    rows = []
    for fault, goal in RESTART_GOALS.items():
        ours, ours_note = stalls("elastic-run", fault)
        base, base_note = stalls("torchrun", fault)
        rows.append(Row("restart", f"{fault} SIGKILL: survivors' stall, restart mode, plain "
                        "script, median", ours, base, "torchrun", speedup=True,
                        goal=f"<= {goal:g} s", met=None if ours is None else ours <= goal,
                        ours_note=ours_note, baseline_note=base_note))
    if any(r.get("launcher") == "elastic-run-off" for r in runs):
        for fault in RESTART_GOALS:
            off, off_note = stalls("elastic-run-off", fault)
            base, base_note = stalls("torchrun", fault)
            rows.append(Row("restart", f"{fault} SIGKILL: survivors' stall, restart mode, "
                            "plain script, warm standby and memory checkpoints off, median",
                            off, base, "torchrun", speedup=True, ours_note=off_note,
                            baseline_note=base_note))
    return rows


def inplace_rows(runs: list[dict[str, Any]], stdout: str = "") -> list[Row]:
    """Rows of ``inplace_vs_torchrun.py --json`` (a list of its ``Run`` dicts).

    Per phase: recovery of elastic-run in place and in restart mode against torchrun (the
    speed-up), and steps redone in place against torchrun.
    """
    del stdout
    launchers = {r.get("launcher") for r in runs}
    if "torchrun" not in launchers:
        return []
    rows = []
    for ours_name, label in (("elastic-run-inplace", "in place"),
                             ("elastic-run-restart", "restart mode")):
        if ours_name not in launchers:
            continue
        for phase in ("worker_kill", "node_loss"):
            ours, ours_note = _phase(runs, ours_name, phase)
            base, base_note = _phase(runs, "torchrun", phase)
            rows.append(Row("inplace", f"{PHASE_LABELS[phase]}: recovery, {label}, median",
                            ours, base, "torchrun", speedup=True, ours_note=ours_note,
                            baseline_note=base_note))
    if "elastic-run-inplace" in launchers:
        for phase in ("worker_kill", "node_loss"):
            ours, ours_note = _phase(runs, "elastic-run-inplace", phase, "redone")
            base, base_note = _phase(runs, "torchrun", phase, "redone")
            rows.append(Row("inplace", f"{PHASE_LABELS[phase]}: steps redone, in place, median",
                            ours, base, "torchrun", unit="steps", ours_note=ours_note,
                            baseline_note=base_note))
    return rows


RDZV_ROUND_GOAL_S = 10.0  # 1024 nodes complete a round in under 10 s
RDZV_GOAL_NODES = 1024
RDZV_C10D_GOAL_NODES = 128  # no slower than c10d there


def rendezvous_rows(data: dict[str, Any], stdout: str = "") -> list[Row]:
    """Rows of ``rendezvous_scale.py --json`` (``{"rounds": [RoundResult], "loads":
    [LoadResult], "large_job": {...}}``).

    Per N: elastic-run's round time against c10d's (ours / c10d; a round that did not
    complete within the cap is shown as such), with the goals (under 10 s at 1024 nodes, no
    slower than c10d at 128); then, at the largest N measured, the keep-alives per second
    measured against those computed from the protocol.
    """
    del stdout
    rounds = data["rounds"]
    rows = []
    for n in sorted({int(r["nodes"]) for r in rounds}):
        def of(backend: str, n: int = n) -> tuple[float | None, str]:
            mine = [r for r in rounds if r["backend"] == backend and int(r["nodes"]) == n]
            done = [r["round_s"] for r in mine if r["round_s"] is not None]
            if len(done) < len(mine):
                worst = min(mine, key=lambda r: r["completed"])
                return None, (f"incomplete: {worst['completed']} of {n} nodes in "
                              f"{worst['cap_s']:g} s")
            return _median(done), ""

        ours, ours_note = of("elastic-run")
        base, base_note = of("c10d")
        c10d_ran = any(r["backend"] == "c10d" and int(r["nodes"]) == n for r in rounds)
        if not c10d_ran and any(r["backend"] == "c10d" for r in rounds):
            base_note = "not run: incomplete at a smaller N"
        row = Row("rendezvous", f"round time, N={n}, median", ours, base, "c10d",
                  ours_note=ours_note, baseline_note=base_note)
        if n == RDZV_GOAL_NODES:
            row = replace(row, goal=f"< {RDZV_ROUND_GOAL_S:g} s",
                          met=ours is not None and ours < RDZV_ROUND_GOAL_S)
        elif n == RDZV_C10D_GOAL_NODES and c10d_ran:
            # c10d not completing counts as slower than a round that completed.
            met = ours is not None and (base is None or ours <= base)
            row = replace(row, goal="<= c10d", met=met)
        rows.append(row)
    loads = data.get("loads") or []
    if loads:
        big = max(loads, key=lambda x: x["nodes"])
        rows.append(Row("rendezvous", f"keep-alives/s at N={big['nodes']}, measured vs "
                        "computed from the protocol", big["keepalives_per_s"],
                        big["predicted"]["keepalives_per_s"], "computed", unit=""))
    return rows


def checkpoint_rows(data: dict[str, Any], stdout: str = "") -> list[Row]:
    """Rows of ``checkpoint_throughput.py --json`` (see its module docstring for the shape).

    Per size: ours against the copy floor (blocking) and the disk floor (durable), with the
    goals, and against DCP ``async_save`` (the speed-up); on S3, ours against raw s3fs puts
    (the goal's baseline) and against the same puts with ours' zero-copy body (the floor).
    """
    del stdout
    rows = []
    for entry in data.get("local", []):
        m = entry["methods"]
        size = f"{entry['bytes'] / MiB:.0f} MiB"
        ours = m[CKPT_OURS]
        block = Row("checkpoint", f"blocking (training thread), {size}",
                    ours["blocking_s"], m[CKPT_COPY_FLOOR]["blocking_s"], "copy floor",
                    goal=f"<= {CKPT_BLOCKING_GOAL:g}x copy floor")
        durable = Row("checkpoint", f"durable (fsynced, committed), {size}",
                      ours["durable_s"], m[CKPT_DISK_FLOOR]["durable_s"], "disk floor",
                      goal=f"<= {CKPT_DURABLE_GOAL:g}x disk floor")
        rows += [
            _with_met(block, _at_most(block.ratio, CKPT_BLOCKING_GOAL)),
            Row("checkpoint", f"blocking (training thread), {size}", ours["blocking_s"],
                m[CKPT_DCP_ASYNC]["blocking_s"], "DCP async_save", speedup=True),
            _with_met(durable, _at_most(durable.ratio, CKPT_DURABLE_GOAL)),
            Row("checkpoint", f"durable (fsynced, committed), {size}", ours["durable_s"],
                m[CKPT_DCP_ASYNC]["durable_s"], "DCP async_save", speedup=True),
        ]
    s3 = data.get("s3")
    if s3:
        m = s3["methods"]
        row = Row("checkpoint", f"durable on S3 (moto server), {s3['bytes'] / MiB:.0f} MiB",
                  m[CKPT_S3_OURS]["durable_s"], m[CKPT_S3_RAW]["durable_s"],
                  "raw s3fs puts, 4 in parallel", goal=f"<= {CKPT_DURABLE_GOAL:g}x raw s3fs puts")
        rows.append(_with_met(row, _at_most(row.ratio, CKPT_DURABLE_GOAL)))
        if CKPT_S3_RAW_ZERO_COPY in m:
            rows.append(Row(
                "checkpoint", f"durable on S3 (moto server), {s3['bytes'] / MiB:.0f} MiB",
                m[CKPT_S3_OURS]["durable_s"], m[CKPT_S3_RAW_ZERO_COPY]["durable_s"],
                "the same puts, zero-copy body",
            ))
    return rows


def _with_met(row: Row, met: bool | None) -> Row:
    return replace(row, met=met)


def goodput_rows(runs: list[dict[str, Any]], stdout: str = "") -> list[Row]:
    """Rows of ``goodput_under_faults.py --json`` (a list of its ``Run`` dicts).

    Per elastic-run mode: goodput and training goodput (stopwatch) against torchrun's (ours /
    torchrun) with the goal >= 0.95 and above torchrun's, and elastic-run's own report against
    the stopwatch of the same run.
    """
    period = re.search(r"a node killed every ([0-9.]+) s", stdout)
    faults = f"a node killed every {period.group(1)} s" if period else "nodes killed"
    by_name = {r["launcher"]: r for r in runs}
    torchrun = by_name.get("torchrun")
    rows = []
    for name, label in (("elastic-run-inplace", "in place"), ("elastic-run", "restart mode")):
        run = by_name.get(name)
        if run is None:
            continue
        ours_note = f"{run.get('faults', 0)} faults"
        base_note = "" if torchrun is None else f"{torchrun.get('faults', 0)} faults"
        for field, what in (("stopwatch_goodput", "goodput"),
                            ("stopwatch_training_goodput", "training goodput")):
            ours = run.get(field)
            base = None if torchrun is None else torchrun.get(field)
            met = None if ours is None else (
                ours >= GOODPUT_GOAL and (base is None or ours > base))
            rows.append(Row("goodput", f"{what} (stopwatch), {label}, {faults}",
                            ours, base, "torchrun", unit="", goal=f">= {GOODPUT_GOAL:g} and "
                            "> torchrun's", met=met, ours_note=ours_note,
                            baseline_note=base_note))
        if run.get("reported_goodput") is not None:
            rows.append(Row("goodput", f"goodput, elastic-run's own report vs the stopwatch, "
                            f"{label}", run["reported_goodput"], run.get("stopwatch_goodput"),
                            "stopwatch, same run", unit=""))
    return rows


def metrics_rows(data: dict[str, Any], stdout: str = "") -> list[Row]:
    """Rows of ``metrics_overhead.py --json``: step time and CPU per step with telemetry on,
    over the same with it off (medians of paired blocks), against the goal of 1 %."""
    del stdout
    note = (f"{len(data['pair_ratios'])} pairs of {data['steps_per_block']} steps, "
            f"{data['on_median_s'] * 1e3:.1f} ms steps")
    rows = []
    for field, what in (("cost_ratio", "step time + the time metrics cost (recording, "
                         "agent CPU), over step time off"),
                        ("ratio", "step time, metrics on / off (median of paired blocks)"),
                        ("cpu_ratio", "CPU per step incl. the agent's, metrics on / off")):
        ratio = data[field]
        rows.append(Row("metrics", what, ratio, 1.0, "metrics off, same run", unit="",
                        goal=f"< {METRICS_OVERHEAD_GOAL:g}x", met=ratio < METRICS_OVERHEAD_GOAL,
                        ours_note=note))
    return rows


def cuda_checkpoint_rows(data: dict[str, Any], stdout: str = "") -> list[Row]:
    """Rows of ``cuda_checkpoint.py --json`` (see its module docstring for the shape).

    Per size: ours against the device-to-pinned-host copy floor (blocking, with the goal),
    and against DCP ``async_save`` with each of its cached pinned stagers (the speed-up).
    """
    del stdout
    rows = []
    for entry in data["sizes"]:
        m = entry["methods"]
        measure = f"blocking (training thread), CUDA state, {entry['bytes'] / (1 << 30):.2f} GiB"
        ours = m[CUDA_OURS]["blocking_s"]
        floor = Row("cuda_checkpoint", measure, ours, m[CUDA_FLOOR]["blocking_s"],
                    "device-to-pinned-host copy floor",
                    goal=f"<= {CKPT_BLOCKING_GOAL:g}x copy floor")
        rows.append(_with_met(floor, _at_most(floor.ratio, CKPT_BLOCKING_GOAL)))
        for name in (CUDA_DCP_CACHED, CUDA_DCP_STAGER):
            if name not in m:  # the baseline raised in this torch (entry["failed"] says why)
                continue
            rows.append(Row("cuda_checkpoint", measure, ours, m[name]["blocking_s"],
                            name.removeprefix("DCP "), speedup=True))
    return rows


def sampler_rows(data: dict[str, Any], stdout: str = "") -> list[Row]:
    """Rows of ``sampler_memory.py --json`` (its ``Case`` dicts under ``cases``).

    Per size: the sampler's resident memory after its first batch against the randperm
    sampler it replaced and against a bare randperm tensor (ours / baseline; the goal, at
    N = 1e9, is under 10 MB), and its time to first batch against the randperm sampler's
    (the speed-up). A baseline that did not fit in memory is shown without a value.
    """
    del stdout
    cases = {(int(c["size"]), c["order"]): c for c in data["cases"]}
    rows = []
    for size in sorted({size for size, _ in cases}):
        ours = cases.get((size, SAMPLER_OURS))
        if ours is None or ours["rss_mib"] is None:
            continue
        peak = f"peak {ours['peak_mib']:.2f} MiB"
        goal = f"< {SAMPLER_MEMORY_GOAL_BYTES / 1e6:g} MB" if size >= SAMPLER_GOAL_SIZE else ""
        met = (max(ours["rss_mib"], ours["peak_mib"]) * MiB < SAMPLER_MEMORY_GOAL_BYTES
               if goal else None)
        for order, label in SAMPLER_BASELINES.items():
            base = cases.get((size, order))
            if base is None:
                continue
            note = "" if base["status"] == "ok" else f"{base['status']}: {base['error']}"
            rows.append(Row("sampler", f"resident memory after the first batch, N={size:.0e}",
                            ours["rss_mib"], base["rss_mib"], label, unit="MiB", goal=goal,
                            met=met, ours_note=peak, baseline_note=note))
        base = cases.get((size, "randperm sampler"))
        if base is not None:
            note = "" if base["status"] == "ok" else f"{base['status']}: {base['error']}"
            rows.append(Row("sampler", f"time to first batch, N={size:.0e}",
                            ours["first_batch_s"], base["first_batch_s"],
                            SAMPLER_BASELINES["randperm sampler"], speedup=True,
                            baseline_note=note))
    return rows


LOOP_OVERHEAD_GOAL_S = 0.3e-3  # the managed loop's own cost per step over plain DDP


def loop_rows(data: dict[str, Any], stdout: str = "") -> list[Row]:
    """Rows of ``loop_overhead.py --json``: the managed loop's step time and CPU per step
    against plain DDP's on the same job (medians over interleaved blocks), with the goal of
    at most 0.3 ms over plain DDP."""
    del stdout

    def median(mode: str, key: str) -> float:
        return float(statistics.median(b[key] for b in data["blocks"] if b["mode"] == mode))

    note = f"{len(data['pair_overheads_s'])} pairs of {data['steps']}-step blocks"
    rows = []
    for key, what, over in (("step_s", "step time", data["overhead_s"]),
                            ("cpu_s", "CPU per step", data["cpu_overhead_s"])):
        rows.append(Row("loop", f"{what}, ElasticLoop managed in place vs plain DDP "
                        f"(+{1e3 * over:.3f} ms, median of pairs)", median("managed", key),
                        median("plain", key), "plain DDP + DistributedSampler, same job",
                        unit="ms", goal="<= plain + 0.3 ms", met=over <= LOOP_OVERHEAD_GOAL_S,
                        ours_note=note))
    return rows


def sharded_rows(data: dict[str, Any], stdout: str = "") -> list[Row]:
    """Rows of ``sharded_recovery.py --json`` (lists of one figure per run, see its
    docstring): FSDP2 recovery in place against the restart path as the issue set it (a cold
    restart and a DCP load from storage, ``restart-cold``), goal <= 0.2x on the stall (the
    next step completed, less one step of the world it ran in; on the time to the next step
    completed for a JSON without it), with the time to resume alone and the steps lost; the
    same against today's default restart path (warm standbys, the checkpoint's copy in
    memory), without a goal; the step time with the peer copies on against off
    (``redundancy=0``), goal <= 1.01x. Medians over the runs. A JSON of an older script,
    whose ``restart`` was the cold path, reads as ``restart-cold``."""
    del stdout
    rows = []
    size = f"{float(data.get('state_mb', 0)):.0f} MB params + Adam, 6 workers"
    inplace = _median(data.get("inplace_s", []))
    cold_key = "restart-cold" if data.get("restart-cold_s") else "restart"
    baselines = [(cold_key, "cold restart + DCP load, same run", True)]
    if cold_key != "restart":
        baselines.append(("restart", "warm restart path + memory checkpoint, same run", False))
    for key, name, goal in baselines:
        restart = _median(data.get(f"{key}_s", []))
        if inplace is None or restart is None:
            continue
        stall_in = _median(data.get("inplace_stall_s", []))
        stall_re = _median(data.get(f"{key}_stall_s", []))
        # The goal is judged on the stall when the JSON has it (the in-place world is smaller,
        # so its next step is longer whatever the recovery costs; see the script).
        on_stall = goal and stall_in is not None and stall_re is not None
        row = Row("sharded", f"FSDP2 recovery, worker SIGKILL to next step completed, {size}",
                  inplace, restart, name,
                  goal=f"<= {SHARDED_RECOVERY_GOAL:g}x restart" if goal and not on_stall
                  else "")
        rows.append(_with_met(row, _at_most(row.ratio, SHARDED_RECOVERY_GOAL))
                    if goal and not on_stall else row)
        if on_stall:
            stall = Row("sharded", "FSDP2 recovery stall: next step completed less one step "
                        "of the world it ran in", stall_in, stall_re, name,
                        goal=f"<= {SHARDED_RECOVERY_GOAL:g}x restart")
            rows.append(_with_met(stall, _at_most(stall.ratio, SHARDED_RECOVERY_GOAL)))
        rows += [
            Row("sharded", "FSDP2 recovery, worker SIGKILL to next step started",
                _median(data.get("inplace_resumed_s", [])),
                _median(data.get(f"{key}_resumed_s", [])), name),
            Row("sharded", "FSDP2 steps lost per worker SIGKILL",
                _median(data.get("inplace_lost", [])), _median(data.get(f"{key}_lost", [])),
                name, unit="steps"),
        ]
    on, off = _median(data.get("step_on_s", [])), _median(data.get("step_off_s", []))
    if on is not None and off is not None:
        row = Row("sharded", f"FSDP2 step time, peer copies on (redundancy=1), {size}", on, off,
                  "redundancy=0, same run", goal=f"<= {SHARDED_COPIES_GOAL:g}x")
        rows.append(_with_met(row, _at_most(row.ratio, SHARDED_COPIES_GOAL)))
    return rows


def gpu_training_rows(data: dict[str, Any], stdout: str = "") -> list[Row]:
    """Rows of ``gpu_training.py --json`` (``{"worker", "summary"}``, see its docstring):
    the loop's step time against plain DDP (goal <= 1.003x), the worst stall of each of our
    save phases against the copy floor (goal <= 1.5x, the first save included), and against
    DCP ``async_save`` at the same interval (the speed-up)."""
    del stdout
    summary = data["summary"]
    rows = []
    steps = summary["steps"]
    if "loop" in steps and "plain" in steps and "ratio" in steps["loop"]:
        ratio = steps["loop"]["ratio"]
        rows.append(Row("gpu_training", f"step time, ElasticLoop in place vs plain DDP "
                        f"({ratio:.4f}x, median of rounds)", steps["loop"]["step_s"],
                        steps["plain"]["step_s"], "plain DDP + DistributedSampler, same run",
                        unit="ms", goal=f"<= {GPU_STEP_GOAL:g}x plain DDP",
                        met=ratio <= GPU_STEP_GOAL))
    floor = summary["floor_s"]
    saves = summary["saves"]
    for name, phase in saves.items():
        if not name.startswith("ours") or name.endswith("wait policy") or not phase["stalls_s"]:
            continue
        worst = max(phase["stalls_s"])
        row = Row("gpu_training", f"worst stall per save, {name} (first included)", worst,
                  floor, "device-to-pinned-host copy floor", unit="ms",
                  goal=f"<= {CKPT_BLOCKING_GOAL:g}x copy floor")
        rows.append(_with_met(row, _at_most(row.ratio, CKPT_BLOCKING_GOAL)))
        dcp = saves.get(name.replace("ours", "DCP", 1))
        if dcp and dcp["stalls_s"]:
            rows.append(Row("gpu_training", f"worst stall per save, {name}", worst,
                            max(dcp["stalls_s"]), "DCP async_save, one in flight", unit="ms",
                            speedup=True))
    return rows


def failed_row(benchmark: str, why: str) -> Row:
    """The row of a benchmark that gave no figures."""
    return Row(benchmark, "", failed=why)


# ------------------------------------------------------------------------------------ rendering


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v:.3f} s" if v < 1 else f"{v:.2f} s"
    if unit == "steps":
        return f"{v:.0f} steps"
    if unit == "MiB":
        return f"{v:.2f} MiB" if v < 1024 else f"{v / 1024:.2f} GiB"
    if unit == "ms":  # a value in seconds, shown in milliseconds
        return f"{1e3 * v:.3f} ms"
    return f"{v:.3f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_row(row: Row) -> str:
    """One Markdown table line for ``row``."""
    if row.failed:
        cells = [row.benchmark, f"**failed**: {row.failed}", "-", "-", "-", "-", "failed"]
        return "| " + " | ".join(_cell(c) for c in cells) + " |"
    if row.skipped:
        cells = [row.benchmark, f"skipped: {row.skipped}", "-", "-", "-", "-", "skipped"]
        return "| " + " | ".join(_cell(c) for c in cells) + " |"
    ours = _value(row.ours, row.unit) + (f" ({row.ours_note})" if row.ours_note else "")
    base = f"{_value(row.baseline, row.unit)} ({row.baseline_name}"
    base += f"; {row.baseline_note})" if row.baseline_note else ")"
    ratio = row.ratio
    if ratio is None:
        ratio_text = "-"
    elif row.speedup:
        ratio_text = f"{ratio:.1f}x faster (baseline / ours)"
    else:
        ratio_text = f"{ratio:.{2 if ratio < 10 else 0}f} (ours / baseline)"
    met = "-" if not row.goal else {True: "yes", False: "**no**", None: "n/a"}[row.met]
    cells = [row.benchmark, row.measure, ours, base, ratio_text, row.goal or "-", met]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def summary_table(rows: Sequence[Row]) -> str:
    """The summary table, one line per row."""
    lines = ["| benchmark | measure | elastic-run | baseline | ratio | goal | met? |",
             "|---|---|---:|---:|---:|---|---|"]
    return "\n".join(lines + [render_row(r) for r in rows])


def markdown_detail(stdout: str) -> str:
    """A script's stdout as Markdown: its tables as they are, progress lines in a code block.

    A paragraph of several lines none of which is a table or list line would otherwise be
    run together into one line by a Markdown renderer.
    """
    out = []
    for para in re.split(r"\n\s*\n", stdout.strip("\n")):
        lines = [line.rstrip() for line in para.splitlines()]
        if not lines:
            continue
        plain = not any(line.lstrip().startswith(("|", "- ", "* ")) for line in lines)
        out.append("```text\n" + "\n".join(lines) + "\n```" if plain and len(lines) > 1
                   else "\n".join(lines))
    return "\n\n".join(out)


# ------------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Bench:
    """One benchmark script and its two presets."""

    name: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    timeout_s: float
    quick_timeout_s: float
    rows: Callable[[Any, str], list[Row]]


BENCHES: tuple[Bench, ...] = (
    Bench("recovery", "recovery_vs_torchrun.py", ("--runs", "3"),
          ("--runs", "1", "--hang-timeout", "30"), 3600, 600, recovery_rows),
    Bench("inplace", "inplace_vs_torchrun.py", ("--runs", "5"),
          ("--runs", "1", "--hang-timeout", "30"), 3600, 600, inplace_rows),
    Bench("restart", "restart_path.py",
          ("--runs", "3", "--launchers", "elastic-run,elastic-run-off,torchrun"),
          ("--runs", "1", "--hang-timeout", "60"), 3600, 900, restart_rows),
    Bench("rendezvous", "rendezvous_scale.py", ("--nodes", "8,32,128,256,512,1024"),
          ("--nodes", "4,8", "--processes", "2", "--steady", "3"), 1800, 600,
          rendezvous_rows),
    Bench("checkpoint", "checkpoint_throughput.py",
          ("--sizes", "300,1500", "--repeats", "3", "--s3-size", "300"),
          ("--sizes", "50", "--repeats", "1", "--s3-size", "50", "--settle", "0.2"), 3600, 600,
          checkpoint_rows),
    Bench("goodput", "goodput_under_faults.py", ("--duration", "300", "--period", "30"),
          ("--duration", "40", "--period", "15", "--calm", "10"), 3600, 900, goodput_rows),
    Bench("metrics", "metrics_overhead.py", ("--repeats", "30", "--steps-per-block", "100"),
          ("--repeats", "3", "--steps-per-block", "30"), 1800, 300, metrics_rows),
    Bench("cuda_checkpoint", "cuda_checkpoint.py", ("--sizes", "1,4,16", "--repeats", "3"),
          ("--sizes", "1", "--repeats", "1", "--settle", "0.2"), 3600, 600,
          cuda_checkpoint_rows),
    Bench("gpu_training", "gpu_training.py", (), (), 600, 120, gpu_training_rows),
    Bench("sharded", "sharded_recovery.py", ("--runs", "3"),
          ("--runs", "1", "--hidden", "256", "--layers", "2", "--steps", "16", "--warmup", "4",
           "--interval", "4"), 5400, 900, sharded_rows),
    Bench("sampler", "sampler_memory.py", ("--sizes", "1e6,1e8,1e9"),
          ("--sizes", "1e5,1e6", "--throughput", "100000"), 3600, 300, sampler_rows),
    Bench("loop", "loop_overhead.py", ("--repeats", "6", "--steps", "1500"),
          ("--repeats", "1", "--steps", "300", "--warmup", "50"), 1800, 300, loop_rows),
)


@dataclass(frozen=True)
class Outcome:
    """How one benchmark run went."""

    bench: Bench
    args: tuple[str, ...]
    status: str  # "ok", "failed" or "timed out"
    returncode: int | None
    seconds: float
    stdout_path: Path
    stderr_path: Path
    json_path: Path

    @property
    def command(self) -> str:
        """The command line, as a user would type it from the repository root."""
        return shlex.join(["python", f"benchmarks/{self.bench.script}", *self.args])


def _process_tree(pid: int) -> list[tuple[int, str]]:
    """``(pid, start time)`` of ``pid`` and all its descendants, new sessions included."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except (OSError, IndexError):
        return []
    out = [(pid, start)]
    for kid in kids:
        out.extend(_process_tree(kid))
    return out


def _kill_if_same(pid: int, start: str) -> None:
    """SIGKILL ``pid`` unless it has exited (and its number been reused) meanwhile."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[19] != start:
                return
        os.kill(pid, signal.SIGKILL)
    except (OSError, IndexError):
        pass


def stop(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """Stops a benchmark and everything it started.

    SIGINT first, to its process group: the script's ``finally`` blocks stop its agents and
    etcd. Then SIGKILL to every process of the tree as it was before (agents run in sessions
    of their own and would otherwise be orphaned when the script dies).
    """
    tree = _process_tree(proc.pid)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    for pid, start in tree:
        _kill_if_same(pid, start)
    proc.wait()


def run_bench(bench: Bench, args: Sequence[str], workdir: Path, timeout_s: float,
              script_dir: Path | None = None) -> Outcome:
    """Runs one benchmark script with ``args`` plus ``--json``; returns how it went.

    Args:
        bench: The benchmark.
        args: Its arguments (the preset), without ``--json``.
        workdir: Where its stdout, stderr and JSON files go.
        timeout_s: Seconds before it is stopped and reported as timed out.
        script_dir: Where its script is (default: ``SCRIPT_DIR``, this directory).
    """
    stdout_path = workdir / f"{bench.name}.stdout.md"
    stderr_path = workdir / f"{bench.name}.stderr.log"
    json_path = workdir / f"{bench.name}.json"
    script = (script_dir or SCRIPT_DIR) / bench.script
    cmd = [sys.executable, str(script), *args, "--json", str(json_path)]
    began = time.monotonic()
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            stop(proc)
            rc, status = None, "timed out"
        except BaseException:  # Ctrl-C: leave nothing running behind us
            stop(proc)
            raise
    return Outcome(bench, tuple(args), status, rc, time.monotonic() - began, stdout_path,
                   stderr_path, json_path)


def summarize(outcome: Outcome) -> list[Row]:
    """The summary rows of one outcome; one failed row if it gave no figures."""
    name = outcome.bench.name
    if outcome.status == "timed out":
        return [failed_row(name, f"timed out after {outcome.seconds:.0f} s; log: "
                                 f"{outcome.stderr_path}")]
    if outcome.status != "ok":
        return [failed_row(name, f"exit status {outcome.returncode} after "
                                 f"{outcome.seconds:.0f} s; log: {outcome.stderr_path}")]
    try:
        data = json.loads(outcome.json_path.read_text())
    except (OSError, ValueError) as exc:
        return [failed_row(name, f"no readable JSON ({exc}); log: {outcome.stderr_path}")]
    if isinstance(data, dict) and data.get("skipped"):
        return [Row(name, "", skipped=str(data["skipped"]))]
    try:
        stdout = outcome.stdout_path.read_text(errors="replace")
        rows = outcome.bench.rows(data, stdout)
    except Exception as exc:  # a script's JSON changed shape: say so, keep the others
        return [failed_row(name, f"its JSON could not be summarized ({exc!r}); "
                                 f"JSON: {outcome.json_path}")]
    return rows or [failed_row(name, f"no figures in its JSON: {outcome.json_path}")]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return str(exc)


def detail_section(outcome: Outcome) -> str:
    """A benchmark's heading, command and own table (or the end of its log if it failed)."""
    head = [f"## {outcome.bench.name}: `{outcome.bench.script}`", "",
            f"`{outcome.command}`: {outcome.status} in {outcome.seconds:.0f} s.", ""]
    if outcome.status != "ok":
        head += [f"Log: `{outcome.stderr_path}`; its last lines:", "",
                 "```text", _tail(outcome.stderr_path), "```"]
        return "\n".join(head)
    try:
        stdout = outcome.stdout_path.read_text(errors="replace")
    except OSError as exc:
        stdout = str(exc)
    return "\n".join([*head, markdown_detail(stdout)])


def machine() -> str:
    """CPUs, Python, torch and OS of this machine."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return (f"{os.cpu_count()} CPUs (nproc), Python {platform.python_version()}, torch "
            f"{torch_version}, {platform.platform()}")


def commit() -> str:
    """The repository's commit, marked when the tracked files have local changes."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                             capture_output=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, text=True, capture_output=True, timeout=30,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha} (with uncommitted changes)" if dirty else sha


def render(outcomes: Sequence[Outcome], command: str, began: datetime, seconds: float,
           load: tuple[float, float], preset: str) -> str:
    """The whole report: summary table, each benchmark's own table, how it was made."""
    rows = [row for o in outcomes for row in summarize(o)]
    parts = [
        "# elastic-run benchmarks",
        "",
        f"Summary of the {preset} preset (`{command}`). Ratio: \"x faster\" is baseline / "
        "elastic-run (a speed-up, higher is better); otherwise elastic-run / baseline (for "
        "times lower is better, for goodput higher). Medians; each benchmark's own table "
        "below gives the spread and conditions.",
        "",
        summary_table(rows),
    ]
    for o in outcomes:
        parts += ["", detail_section(o)]
    parts += [
        "",
        "## How this was made",
        "",
        f"- command: `{command}` (from the repository root)",
        f"- date: {began:%Y-%m-%d %H:%M} UTC, {seconds:.0f} s in all",
        f"- commit: {commit()}",
        f"- machine: {machine()}; load average (1 min) {load[0]:.1f} at start, "
        f"{load[1]:.1f} at end",
    ]
    return "\n".join(parts) + "\n"


def select(only: str | None) -> list[Bench]:
    """The benchmarks named in ``--only`` (all when ``None``), in the registry's order."""
    if not only:
        return list(BENCHES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {b.name for b in BENCHES}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--only {only!r}: unknown benchmark(s) {', '.join(unknown) or '-'}; "
                         f"choose from {', '.join(b.name for b in BENCHES)}.")
    return [b for b in BENCHES if b.name in names]


def _command_line(argv: Sequence[str]) -> str:
    return shlex.join(["python", "benchmarks/run_all.py", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the chosen benchmarks; prints (and writes) the report. 1 if any failed."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true",
                        help="small settings for a smoke check (minutes, not an hour)")
    parser.add_argument("--only", default=None,
                        help="comma-separated: " + ",".join(b.name for b in BENCHES))
    parser.add_argument("--out", type=Path, default=None,
                        help="write the report here (default: benchmarks/RESULTS.md, only "
                             "for a full run in which every benchmark succeeded)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the logs and JSON files go (default: a new temp dir)")
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(args_list)
    try:
        chosen = select(args.only)
    except ValueError as exc:
        parser.error(str(exc))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="run-all-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"work directory {workdir}", file=sys.stderr, flush=True)

    began, t0, load0 = datetime.now(timezone.utc), time.monotonic(), os.getloadavg()[0]
    outcomes = []
    for bench in chosen:
        bench_args = bench.quick if args.quick else bench.full
        timeout = bench.quick_timeout_s if args.quick else bench.timeout_s
        print(f"{bench.name}: {shlex.join(['python', f'benchmarks/{bench.script}', *bench_args])}"
              f" (timeout {timeout:.0f} s)", file=sys.stderr, flush=True)
        outcome = run_bench(bench, bench_args, workdir, timeout)
        print(f"{bench.name}: {outcome.status} in {outcome.seconds:.0f} s; "
              f"{outcome.stdout_path}, {outcome.stderr_path}", file=sys.stderr, flush=True)
        outcomes.append(outcome)
    text = render(outcomes, _command_line(args_list), began, time.monotonic() - t0,
                  (load0, os.getloadavg()[0]), "quick" if args.quick else "full")
    print(text)
    all_ok = all(o.status == "ok" for o in outcomes)
    out = args.out or (DEFAULT_OUT if all_ok and not args.quick else None)
    if out is not None:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(f"{DEFAULT_OUT} not written ("
              f"{'quick preset' if args.quick else 'a benchmark failed'}); --out FILE writes "
              "the report anyway", file=sys.stderr)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
