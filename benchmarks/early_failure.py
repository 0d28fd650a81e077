"""A script that dies before its first step: how soon the job ends, with the script's error.

``elastic-run --standalone examples/train.py --bogus-flag``: every attempt exits 2 with
argparse's error before it can report anything over the agent's channel. The job must end
within 10 s of the first failure, with that error as its last line (issue 25, fault 3; it
used to go round the crash budget for 48 s and end naming no error).

The time from the first failure is one more start-up of the script's interpreter (the second
attempt: importing torch and elastic, then argparse) plus elastic-run's own share: the crash
budget's first backoff (1 s), the world it writes for the second attempt, and the run's end.
The baseline, measured in the same run, is one start-up of the same interpreter with the same
imports (``python -c "import torch, elastic"``), so the table says how much of the time is
elastic-run's.

Usage::

    python benchmarks/early_failure.py [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GOAL_S = 10.0
_STAMP = r"^\[([\d-]+ [\d:]+,\d+)\] "


def _stamps(text: str, pattern: str) -> list[float]:
    return [datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for t in re.findall(_STAMP + pattern, text, flags=re.MULTILINE)]


def one_run() -> dict[str, Any]:
    """One standalone job with an unknown flag; when its first worker failed and it ended."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "PET_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "launch", "--standalone",
                           str(REPO / "examples" / "train.py"), "--bogus-flag"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    ended = time.time()
    out = done.stdout + done.stderr
    failures = _stamps(out, r"WARNING launch\.failure_judge: worker \S+ failed")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return {"exit_code": done.returncode, "attempts": len(failures),
            "to_end_s": round(ended - failures[0], 2) if failures else None,
            "last_line": lines[-1] if lines else ""}


def startup_s() -> float:
    """One start-up of the interpreter with the script's imports (the baseline)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch, elastic"], check=True, cwd=REPO,
                   timeout=120)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    runs, startups = [], []
    for _ in range(args.runs):
        startups.append(startup_s())
        runs.append(one_run())
    ends = [r["to_end_s"] for r in runs if r["to_end_s"] is not None]
    correct = [r for r in runs if r["exit_code"] == 1 and "unrecognized arguments: "
               "--bogus-flag" in r["last_line"] and "before its first step" in r["last_line"]]
    median_end = statistics.median(ends) if ends else None
    median_startup = statistics.median(startups)
    print("| what | median (s) | runs |")
    print("|---|---|---|")
    print(f"| first failure to the job's end (goal <= {GOAL_S:g} s) | "
          f"{median_end if median_end is not None else 'n/a'} | {len(ends)} of {len(runs)} |")
    print(f"| one interpreter start-up, `import torch, elastic` (baseline) | "
          f"{median_startup:.2f} | {len(startups)} |")
    if median_end is not None:
        print(f"| elastic-run's share: the end minus the second attempt's start-up | "
              f"{median_end - median_startup:.2f} | |")
    print(f"\nthe script's error was the last line in {len(correct)} of {len(runs)} runs; "
          f"attempts per run: {[r['attempts'] for r in runs]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "startups_s": startups},
                                              indent=2))
    return 0 if len(correct) == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
