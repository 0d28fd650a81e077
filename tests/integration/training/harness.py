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

import torch

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
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
        start_new_session=True,
    )
    return Attempt(result.returncode, result.stdout + result.stderr)


def reference_order(dataset_size: int, seed: int, epoch: int) -> list[int]:
    """The documented per-epoch order, computed independently of the sampler."""
    order: list[int] = torch.randperm(
        dataset_size, generator=torch.Generator().manual_seed(seed + epoch)
    ).tolist()
    return order


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
            by_attempt[attempt][int(record["step"])].append(record)  # type: ignore[call-overload]
    result: dict[int, list[int]] = {}
    for attempt in sorted(by_attempt):
        for step, records in by_attempt[attempt].items():
            world = int(records[0]["world"])  # type: ignore[call-overload]
            if len(records) != world:
                continue  # a step some rank never finished: it was rolled back
            result[step] = [i for r in records for i in r["ids"]]  # type: ignore[attr-defined]
    return result
