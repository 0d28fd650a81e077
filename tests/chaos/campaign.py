"""A seeded random chaos campaign: faults of random kinds at random steps, run after run.

    python -m tests.chaos.campaign --seed 1234 --faults 50          # a release check
    python -m tests.chaos.campaign --seed 1234 --faults 50 --only 7 # replay run 7 of it
    python -m tests.chaos.campaign --mode inplace --seed 1234 --faults 50   # as root

The seed is printed first; the same seed draws the same faults (kinds, nodes, steps,
durations) for every run, so a failing run is replayed with ``--seed S --only I``. Faults are
spread over runs of ``--per-run`` faults each. Two modes:

* ``restart`` (the default): the restart path on 127.0.0.1 (:mod:`tests.chaos.injector`);
  every run is a fresh job on a shared 3-member etcd cluster, with S3 checkpoints whenever a
  storage outage was drawn.
* ``inplace``: elastic-run in place on a fresh cluster of network namespaces per run
  (:mod:`tests.chaos.netns_chaos`: 3-member etcd in namespaces, silent hosts, hosts that
  return, hung workers, plus the faults of the restart campaign). Needs root, ``ip`` and
  ``nft``.

Each run is checked (weights, exactly-once audit, last checkpoint, processes; see
:meth:`tests.chaos.injector.RunResult.check` and
:meth:`tests.chaos.netns_chaos.NetnsRunResult.check`); a run that does not finish within its
time budget counts as a hang. One JSON line per run goes to ``--out``; the last line printed
is the tally (with the faults injected per kind). Exit status 0 only if every run passed.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.chaos.injector import ChaosEnv, ChaosRun, JobShape, chaos_env, random_faults, summary
from tests.chaos.netns_chaos import (
    LONG_CUT_S,
    NetnsChaosRun,
    NetnsFault,
    NetnsShape,
    random_netns_faults,
    reference_weights,
)
from tests.chaos.netns_chaos import summary as netns_summary


def plan(seed: int, faults: int, per_run: int, nodes: int,
         shape: JobShape) -> list[list[Any]]:
    """The faults of every run, drawn from ``seed`` alone."""
    rng = random.Random(seed)
    runs = []
    left = faults
    while left > 0:
        count = min(per_run, left)
        runs.append(random_faults(rng, count, nodes=nodes, steps=shape.steps))
        left -= count
    return runs


def plan_inplace(seed: int, faults: int, per_run: int, nodes: int, shape: NetnsShape, *,
                 long_cuts: bool = True) -> list[list[NetnsFault]]:
    """The faults of every in-place run, drawn from ``seed`` alone."""
    rng = random.Random(seed)
    runs = []
    left = faults
    while left > 0:
        count = min(per_run, left)
        runs.append(random_netns_faults(rng, count, nodes=nodes, steps=shape.steps,
                                        long_cuts=long_cuts))
        left -= count
    return runs


def _new_tally(seed: int, mode: str) -> dict[str, Any]:
    return {"seed": seed, "mode": mode, "runs": 0, "faults": 0, "kinds": {}, "hangs": 0,
            "wrong_weights_or_samples": 0, "unloadable_checkpoints": 0, "failed": [],
            "wall_s": 0.0}


def _count(tally: dict[str, Any], kinds: list[str]) -> None:
    for kind in kinds:
        tally["kinds"][kind] = tally["kinds"].get(kind, 0) + 1
    tally["kinds"] = dict(sorted(tally["kinds"].items()))


def run_inplace_campaign(root: Path, *, seed: int, faults: int, per_run: int = 5,
                         nodes: int = 3, only: int | None = None, out: Path | None = None,
                         shape: NetnsShape | None = None,
                         long_cuts: bool = True) -> dict[str, Any]:
    """Runs the in-place campaign under ``root``; returns the tally (``failed`` lists the
    runs that failed)."""
    shape = shape or NetnsShape()
    runs = plan_inplace(seed, faults, per_run, nodes, shape, long_cuts=long_cuts)
    reference = reference_weights(root, shape)
    tally = _new_tally(seed, "inplace")
    for index, scenario in enumerate(runs):
        if only is not None and index != only:
            continue
        # The cap: startup, each fault's recovery on a loaded 2-core machine, the long cuts.
        timeout = 180.0 + 75.0 * len(scenario) + sum(
            f.duration for f in scenario if f.duration >= LONG_CUT_S)
        result = NetnsChaosRun(scenario, root=root / f"seed{seed}-run{index}",
                               reference=reference, nodes=nodes, shape=shape,
                               timeout=timeout).execute()
        error = ""
        try:
            result.check()
        except AssertionError as exc:
            error = str(exc)
            # The whole story, next to the run's logs and audit.
            (result.root / "failure.txt").write_text(f"{error}\n\n{result.logs}")
        injected = [i.fault.kind for i in result.injected if i.at is not None]
        tally["runs"] += 1
        tally["faults"] += len(injected)
        _count(tally, injected)
        tally["wall_s"] = round(tally["wall_s"] + result.wall_s, 1)
        if error:
            tally["failed"].append(index)
            kind = ("hangs" if result.hung else "startup_failures" if result.startup
                    else "bad_exits" if "exit" not in result.checks
                    else "wrong_weights_or_samples" if "audit" not in result.checks
                    else "unloadable_checkpoints" if "checkpoint" not in result.checks
                    else "left_running")
            tally[kind] = tally.get(kind, 0) + 1
        line = {"run": index, "ok": not error, **netns_summary(result),
                "error": error.splitlines()[:3]}
        _emit(line, out)
        if error:
            print(f"FAILED run {index}; replay: python -m tests.chaos.campaign --mode inplace "
                  f"--seed {seed} --faults {faults} --per-run {per_run} --nodes {nodes} "
                  f"--only {index}\n{error[-4000:]}", file=sys.stderr, flush=True)
    return tally


def _emit(line: dict[str, Any], out: Path | None) -> None:
    print(json.dumps(line), flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


def run_campaign(env: ChaosEnv, *, seed: int, faults: int, per_run: int = 5, nodes: int = 3,
                 only: int | None = None, out: Path | None = None,
                 shape: JobShape | None = None) -> dict[str, Any]:
    """Runs the campaign; returns the tally (``failed`` lists the runs that failed)."""
    shape = shape or JobShape()
    runs = plan(seed, faults, per_run, nodes, shape)
    tally = _new_tally(seed, "restart")
    for index, scenario in enumerate(runs):
        if only is not None and index != only:
            continue
        # A slow run is not a hang: the hang criterion is no step for stall_timeout seconds
        # (a loaded 2-core machine takes tens of seconds per recovery); the total is a cap.
        timeout = 120.0 + 60.0 * len(scenario)
        result = ChaosRun(env, scenario, nodes=nodes, shape=shape, timeout=timeout,
                          name=f"seed{seed}-run{index}").execute()
        error = ""
        try:
            result.check()
        except AssertionError as exc:
            error = str(exc)
        tally["runs"] += 1
        injected = [i.fault.kind for i in result.injected if i.at is not None]
        tally["faults"] += len(injected)
        _count(tally, injected)
        tally["wall_s"] = round(tally["wall_s"] + result.wall_s, 1)
        if error:
            tally["failed"].append(index)
            if result.hung:
                tally["hangs"] += 1
            elif "checkpoint" not in result.checks and "audit" in result.checks:
                tally["unloadable_checkpoints"] += 1
            elif "audit" not in result.checks:
                tally["wrong_weights_or_samples"] += 1
        line = {"run": index, "ok": not error, **summary(result),
                "error": error.splitlines()[:3]}
        _emit(line, out)
        if error:
            print(f"FAILED run {index}; replay: python -m tests.chaos.campaign --seed {seed} "
                  f"--faults {faults} --per-run {per_run} --nodes {nodes} --only {index}\n"
                  f"{error[-4000:]}", file=sys.stderr, flush=True)
    return tally


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.campaign",
                                     description="Seeded random chaos campaign.")
    parser.add_argument("--mode", choices=("restart", "inplace"), default="restart",
                        help="restart: the restart path on 127.0.0.1 (default); inplace: in "
                        "place on a cluster of network namespaces (needs root)")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed")
    parser.add_argument("--faults", type=int, default=50, help="faults in all (default 50)")
    parser.add_argument("--per-run", type=int, default=5, help="faults per job (default 5)")
    parser.add_argument("--nodes", type=int, default=3, help="nodes per job (default 3)")
    parser.add_argument("--only", type=int, default=None, help="replay only this run index")
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--root", type=Path, default=None, help="work directory")
    args = parser.parse_args(argv)
    if args.faults < 1 or args.per_run < 1 or args.nodes < 1:
        parser.error(f"--faults ({args.faults}), --per-run ({args.per_run}) and --nodes "
                     f"({args.nodes}) must be at least 1.")
    if args.mode == "inplace":
        from tests.support.netns import netns_unavailable

        reason = netns_unavailable()
        if reason is not None:
            parser.exit(2, f"{parser.prog}: error: --mode inplace runs on network namespaces, "
                           f"and {reason}\n")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"chaos campaign seed {seed} ({args.mode}, {args.faults} faults, {args.per_run} "
          f"per run, {args.nodes} nodes)", flush=True)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    root = args.root or Path(tempfile.mkdtemp(prefix=f"chaos-campaign-{seed}-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.mode == "inplace":
        tally = run_inplace_campaign(root, seed=seed, faults=args.faults,
                                     per_run=args.per_run, nodes=args.nodes, only=args.only,
                                     out=args.out)
    else:
        with chaos_env(root) as env:
            tally = run_campaign(env, seed=seed, faults=args.faults, per_run=args.per_run,
                                 nodes=args.nodes, only=args.only, out=args.out)
    tally["elapsed_s"] = round(time.monotonic() - started, 1)
    tally["root"] = str(root)
    print(json.dumps({"tally": tally}), flush=True)
    return 1 if tally["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
