"""Worker processes, one per slot (local rank), each started, watched and stopped on its own.

torch's agent starts and stops a node's workers together; elastic-run's agent manages each
slot separately, so that in place a crashed worker is restarted alone while the node's other
workers keep their processes and their place in the world.

Every worker runs under ``launch.worker_guard`` (it dies with the agent, and reports an
uncaught exception to the agent before exiting) in a session of its own, so that stopping it
also reaches its DataLoader processes. Its standard error passes through the agent (copied
line by line to the agent's own), so that a script that dies before it can report anything
(an unknown flag, an ImportError, a SyntaxError) still names its error: the last line it wrote.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from launch.standby import StandbyPool

__all__ = ["SlotProcess", "WorkerCommand"]

logger = logging.getLogger(__name__)

_REAP_POLL_S: Final = 0.02
_MAX_ERROR_LINE: Final = 500


@dataclass(frozen=True, slots=True)
class WorkerCommand:
    """What every worker process runs.

    Attributes:
        argv: The full command (``python -u -m launch.worker_guard script args...``).
        base_env: The environment every worker starts from (the agent's, minus secrets).
    """

    argv: tuple[str, ...]
    base_env: Mapping[str, str]


@dataclass
class SlotProcess:
    """One running (or finished) worker process of a slot.

    Attributes:
        local_rank: The slot.
        incarnation: Which start of the slot this is.
        proc: The process.
        started_at: ``time.monotonic()`` at start.
        stopping: Set when the agent asked it to stop (its exit is not a crash).
        last_error_line: The last non-empty line the worker wrote to its standard error.
        warm: Whether it started in a warm standby (:mod:`launch.standby`).
    """

    local_rank: int
    incarnation: int
    proc: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)
    stopping: bool = False
    last_error_line: str = ""
    warm: bool = False

    @classmethod
    def start(cls, command: WorkerCommand, local_rank: int, incarnation: int,
              env: Mapping[str, str], standby: StandbyPool | None = None) -> SlotProcess:
        """Starts the worker of ``local_rank`` with ``env`` on top of the base environment:
        in the slot's warm standby if ``standby`` has one that can take it, else cold."""
        full_env = {**command.base_env, **env}
        proc = standby.take(local_rank, full_env, command.argv) if standby is not None else None
        warm = proc is not None
        if proc is None:
            proc = subprocess.Popen(list(command.argv), env=full_env, start_new_session=True,
                                    stderr=subprocess.PIPE)
        logger.info("started worker %d.%d (pid %d%s)", local_rank, incarnation, proc.pid,
                    ", in its warm standby" if warm else "")
        started = cls(local_rank, incarnation, proc, warm=warm)
        threading.Thread(target=started._copy_stderr, name=f"elastic-stderr-{proc.pid}",
                         daemon=True).start()
        return started

    def _copy_stderr(self) -> None:
        """Copies the worker's standard error to the agent's, line by line (so that lines of
        several workers never mix), keeping the last non-empty one."""
        stream = self.proc.stderr
        assert stream is not None
        out = getattr(sys.stderr, "buffer", None)
        with contextlib.suppress(OSError, ValueError):
            for line in iter(stream.readline, b""):
                if out is not None:
                    with contextlib.suppress(OSError, ValueError):
                        out.write(line)
                        out.flush()
                text = line.decode(errors="replace").strip()
                if text:
                    self.last_error_line = text[:_MAX_ERROR_LINE]
        with contextlib.suppress(OSError):
            stream.close()

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.proc.pid

    @property
    def local_id(self) -> str:
        """``{local_rank}.{incarnation}``."""
        return f"{self.local_rank}.{self.incarnation}"

    def exit_code(self) -> int | None:
        """The exit code once it exited (``-N`` for signal N), else ``None``."""
        return self.proc.poll()

    def stopped(self) -> bool:
        """Whether the kernel reports the worker stopped by a signal (SIGSTOP: state ``T``).

        A process busy in a long step or a garbage-collection pause is running (``R``) or
        sleeping (``S``/``D``), never ``T``; a debugger's stop is ``t`` and does not count.
        """
        try:
            with open(f"/proc/{self.proc.pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] == "T"
        except (OSError, IndexError):
            return False

    def signal(self, sig: signal.Signals) -> None:
        """Sends ``sig`` to the worker's whole session (its DataLoader processes too)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def terminate(self) -> None:
        """Asks the worker to stop (SIGTERM to the worker only: a drain in progress must not
        lose its DataLoader processes)."""
        self.stopping = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Kills the worker and everything in its session at once."""
        self.stopping = True
        self.signal(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


def stop_all(processes: Sequence[SlotProcess], grace: float) -> dict[int, int | None]:
    """SIGTERMs ``processes``, waits up to ``grace`` seconds, SIGKILLs the rest.

    Returns:
        Local rank -> exit code.
    """
    for process in processes:
        if process.exit_code() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.exit_code() is None for p in processes):
        time.sleep(_REAP_POLL_S)
    for process in processes:
        if process.exit_code() is None:
            process.kill()
    codes = {}
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.proc.wait(timeout=5)
        codes[process.local_rank] = process.exit_code()
    return codes
