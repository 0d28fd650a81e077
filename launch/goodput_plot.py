"""The timeline picture of a goodput report: ``elastic-run goodput DIR --plot OUT.png``.

Draws from the report's JSON (:meth:`launch.goodput.Report.to_json`), so a saved report can be
drawn again later: one lane per part of the wall time (productive steps, recomputed steps,
checkpoint stalls, detection, rendezvous, restore), a dashed line at each membership change
labelled with its reason and recovery time, and the world size below. Uses matplotlib's Agg
backend (no display needed).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

_COLORS: Final = {
    "productive": "#2e7d32", "recomputed": "#f9a825", "checkpoint": "#1565c0",
    "detection": "#c62828", "rendezvous": "#6a1b9a", "restore": "#ef6c00",
}


def plot(report: Mapping[str, Any], out: str | Path) -> Path:
    """Writes the timeline of one job's report (its JSON dict) to ``out`` as a PNG.

    Raises:
        ValueError: If the report has no timeline (its job logged no step events).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    timeline: Sequence[Sequence[Any]] = report.get("timeline") or []
    if not timeline:
        raise ValueError(f"the report of job {report.get('job')!r} has no timeline (no step "
                         "events); run the job with --events-dir and ElasticLoop.")
    wall = float(report.get("wall_s") or max(float(end) for _, end, _ in timeline))
    breakdown: Mapping[str, float] = report.get("breakdown") or {}
    lanes = [k for k in _COLORS if any(kind == k for _, _, kind in timeline)]
    fig, (ax, ax_world) = plt.subplots(
        2, 1, figsize=(14, 1.6 + 0.45 * len(lanes) + 1.4), sharex=True,
        gridspec_kw={"height_ratios": [max(1, len(lanes)), 1.2]},
    )
    for row, kind in enumerate(lanes):
        bars = [(float(a), max(float(b) - float(a), wall / 2000)) for a, b, k in timeline
                if k == kind]
        share = 100 * float(breakdown.get(kind, 0.0)) / wall if wall else 0.0
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=_COLORS[kind],
                       label=f"{kind} {breakdown.get(kind, 0.0):.1f} s ({share:.1f} %)")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    for change in report.get("changes") or []:
        for axis in (ax, ax_world):
            axis.axvline(float(change["at"]), color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(f"{change['reason']}\n{float(change['recovery_s']):.1f} s",
                    (float(change["at"]), -0.5), fontsize=7, va="bottom", ha="left",
                    annotation_clip=False)
    goodput = report.get("goodput")
    ax.set_title(f"job {report.get('job')}: wall {wall:.1f} s, goodput "
                 f"{'?' if goodput is None else f'{float(goodput):.3f}'}, "
                 f"{len(report.get('changes') or [])} membership changes", pad=22)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    worlds: Sequence[Sequence[Any]] = report.get("worlds") or []
    if worlds:
        xs = [float(t) for t, _ in worlds] + [wall]
        ys = [int(w) for _, w in worlds]
        ax_world.step(xs, [*ys, ys[-1]], where="post", color="black")
        ax_world.set_ylim(0, max(ys) + 1)
        ax_world.set_yticks(range(max(ys) + 2))
    ax_world.set_ylabel("world")
    ax_world.set_xlabel("seconds since the first agent started")
    ax_world.set_xlim(0, wall)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m launch.goodput_plot REPORT.json OUT.png`` (a saved ``--json`` report)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        sys.stderr.write("usage: python -m launch.goodput_plot REPORT.json OUT.png\n")
        return 2
    data = json.loads(Path(args[0]).read_text())
    reports = data if isinstance(data, list) else [data]
    if len(reports) != 1:
        sys.stderr.write(f"error: {args[0]} holds {len(reports)} reports; save one job's "
                         "(elastic-run goodput DIR --job ID --json).\n")
        return 2
    plot(reports[0], args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
