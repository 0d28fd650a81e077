"""Runs ``elastic-run status`` as an operator would, in a subprocess, and parses its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

from tests.integration.launcher_scripts.harness import REPO

_HEADING = re.compile(r"^job (\S+): round (\d+), world size (\d+)")
_PID = re.compile(r"\bpid=(\d+)\b")


@dataclass(frozen=True)
class StatusOutput:
    """What one ``elastic-run status`` call printed and returned."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def round(self) -> int:
        return int(self._heading().group(2))

    @property
    def world_size(self) -> int:
        return int(self._heading().group(3))

    @property
    def member_pids(self) -> set[int]:
        """Agent pids of the listed members."""
        return {int(m.group(1)) for m in _PID.finditer(self.stdout)}

    def _heading(self) -> re.Match[str]:
        match = _HEADING.match(self.stdout)
        assert match, f"no status heading in {self.stdout!r} (stderr {self.stderr!r})"
        return match


def run_status(endpoint: str, job_id: str, *extra: str,
               env: dict[str, str] | None = None) -> StatusOutput:
    """``python -m launch status --etcd ENDPOINT --job-id JOB_ID [EXTRA]``; 30 s hang guard."""
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), child_env.get("PYTHONPATH")])
    )
    child_env.pop("ELASTIC_ETCD_ENDPOINTS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "status", "--etcd", endpoint, "--job-id", job_id,
         *extra],
        capture_output=True, text=True, timeout=30, env=child_env, cwd=REPO,
    )
    return StatusOutput(proc.returncode, proc.stdout, proc.stderr)
