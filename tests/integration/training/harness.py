"""Runs the training worker under torchrun (standalone) and reads its audit logs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from elastic.permutation import epoch_permutation
from tests.integration.launcher_scripts.harness import kill, tree

WORKER = Path(__file__).with_name("worker.py")
REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Attempt:
    returncode: int
    output: str

    @property
    def resumed_from(self) -> int:
        # Workers print concurrently, so lines may interleave: search, do not split.
        found = re.search(r"\[worker\] rank=0 world=\d+ resumed_from=(\d+)", self.output)
        if found:
            return int(found.group(1))
        raise AssertionError(f"no resume line in:\n{self.output[-3000:]}")


def run_attempt(nproc: int, *args: str, timeout: float = 100) -> Attempt:
    """One launch of ``nproc`` workers (a fresh round); returns its exit code and output."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "--max-restarts=0", str(WORKER), *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            # torchrun starts its workers in sessions of their own: kill the whole tree, or
            # they outlive the test (a pytest-timeout lands here too).
            kill(tree(proc.pid))
            proc.communicate()
            raise
    return Attempt(proc.returncode, stdout + stderr)


def reference_order(dataset_size: int, seed: int, epoch: int) -> list[int]:
    """The documented per-epoch order (:func:`elastic.permutation.epoch_permutation`)."""
    return list(epoch_permutation(dataset_size, seed, epoch))


def committed_steps(audit_dir: Path) -> dict[int, list[int]]:
    """Per step, the ids trained by the last attempt that ran it (all of its ranks).

    Every attempt restarts from a checkpoint at or before the previous attempt's last step
    and redoes everything after it, so the last attempt that logged a step is the one whose
    result the final weights contain; earlier attempts of that step were rolled back.
    """
    by_attempt: dict[int, dict[int, list[dict[str, object]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for path in audit_dir.glob("attempt*.rank*.jsonl"):
        attempt = int(path.name.split(".")[0].removeprefix("attempt"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "step" not in record:
                continue  # the resume line
            by_attempt[attempt][int(record["step"])].append(record)  # type: ignore[call-overload]
    result: dict[int, list[int]] = {}
    for attempt in sorted(by_attempt):
        for step, records in by_attempt[attempt].items():
            world = int(records[0]["world"])  # type: ignore[call-overload]
            if len(records) != world:
                continue  # a step some rank never finished: it was rolled back
            result[step] = [i for r in records for i in r["ids"]]  # type: ignore[attr-defined]
    return result


@dataclass(frozen=True)
class Round:
    """What one attempt (a rendezvous round under elastic-run) did, from its audit files."""

    attempt: int
    world: int
    resumed_from: int
    last_step: int  # the last step any rank logged as completed; resumed_from - 1 if none


def rounds(audit_dir: Path) -> list[Round]:
    """Every attempt that got as far as resuming, in order."""
    resumed: dict[int, int] = {}
    world: dict[int, int] = {}
    last: dict[int, int] = defaultdict(lambda: -1)
    for path in audit_dir.glob("attempt*.rank*.jsonl"):
        attempt = int(path.name.split(".")[0].removeprefix("attempt"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "step" in record:
                last[attempt] = max(last[attempt], int(record["step"]))
            else:
                resumed[attempt] = int(record["resumed_from"])
                world[attempt] = int(record["world"])
    return [
        Round(a, world[a], resumed[a], max(last[a], resumed[a] - 1)) for a in sorted(resumed)
    ]
