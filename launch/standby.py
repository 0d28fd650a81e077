"""Warm standby workers: one started interpreter per slot, torch imported, waiting for a world.

In restart mode every membership change restarts every worker, and a cold worker pays for a
new interpreter, ``import torch`` and torch's lazy imports on first use (building the first
optimizer imports ``torch._dynamo``) before its first step: 2 to 5 s on a busy host, most of
a restart. So the agent keeps one *standby* per slot: a process started ahead of need, with
the slot's environment minus its world, that has imported those modules and waits on a
socket. Starting a worker of that slot hands the world to it instead (its full environment
and the worker command's arguments); it then runs the script as ``__main__`` exactly as
:mod:`launch.worker_guard` would, in the same process. A replacement standby starts a few
seconds later (``refill_delay``), so that its imports do not compete with the restarted
workers for the CPU; 10 s after handing over a standby that was still importing, and not
while a worker that said hello may still declare that it reconfigures in place
(:meth:`launch.supervisor.Supervisor.tick_standbys`), which drops the standbys.

What a standby holds, and what it must not:

* **Imports only**: torch and the torch modules nearly every script imports
  (``ELASTIC_STANDBY_PRELOAD`` changes the list). Never the user's script or its modules:
  those run only after the hand-over, in the world's environment.
* **No CUDA context.** Importing torch does not initialise CUDA, and nothing preloaded may:
  the environment that selects devices is applied at the hand-over. The standby checks
  ``torch.cuda.is_initialized()`` after its imports; if a preloaded module did initialise it,
  the standby tells the agent (which stops keeping standbys) and, handed a world, replaces
  itself by a cold worker (``execv``) rather than run the script in that process.
* **Its slot's static environment.** Only the variables that name the world (ranks, sizes,
  the store, the round, the incarnation; :data:`WORLD_KEYS`) may differ at the hand-over;
  if any other differs (variables read at import time, say), the agent starts that worker
  cold and replaces the standby.

A standby dies with its agent like every worker (``PR_SET_PDEATHSIG``,
:func:`launch.worker_guard.guard`) and exits when the agent closes its socket. Its
``/proc/PID/comm`` says what it is doing (tools and tests tell it from a worker by that name):
``elastic-warming`` while it imports, ``elastic-standby`` once it waits; a worker started in
it has its interpreter's name back.

Run by the agent as ``python -u -m launch.standby`` with ``ELASTIC_STANDBY_FD`` set.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from elastic import env

__all__ = ["COMM_NAME", "DEFAULT_PRELOAD", "REFILL_AFTER_IMPORTING_S", "WARMING_NAME",
           "WORLD_KEYS", "StandbyPool", "is_standby", "standby_state"]

logger = logging.getLogger(__name__)

STANDBY_MODULE: Final = "launch.standby"
GUARD_MODULE: Final = "launch.worker_guard"
#: ``/proc/PID/comm`` of a standby while it waits (15 characters: the kernel's limit).
COMM_NAME: Final = "elastic-standby"
#: ``/proc/PID/comm`` of a standby while it imports.
WARMING_NAME: Final = "elastic-warming"
#: What a standby imports while it waits (``ELASTIC_STANDBY_PRELOAD`` replaces it).
DEFAULT_PRELOAD: Final = ("torch", "torch.distributed", "torch.nn", "torch.nn.parallel",
                          "torch.optim", "torch.utils.data", "torch._dynamo")
#: The variables that name a worker's world: the only ones a hand-over may change.
WORLD_KEYS: Final = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", env.ROUND, env.START,
    env.INCARNATION, env.WORKER_ID,
})
#: Seconds after a hand-over before the slot's next standby starts.
DEFAULT_REFILL_DELAY_S: Final = 3.0
#: The refill delay after handing over a standby that was still importing.
REFILL_AFTER_IMPORTING_S: Final = 10.0
#: A standby that died before it was used is replaced after this long at the soonest.
_RESPAWN_AFTER_DEATH_S: Final = 10.0
_READY: Final = b"ready\n"
_TAINTED: Final = b"cuda\n"
_PR_SET_NAME: Final = 15
_SEND_TIMEOUT_S: Final = 5.0


def standby_state(pid: int) -> str | None:
    """``warming`` or ``ready`` if ``pid`` is a standby not handed a world yet (by its
    ``comm`` name), else ``None``."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            name = comm.read().strip()
    except OSError:
        return None
    return {WARMING_NAME: "warming", COMM_NAME: "ready"}.get(name)


def is_standby(pid: int) -> bool:
    """Whether ``pid`` is a standby not handed a world yet."""
    return standby_state(pid) is not None


# --------------------------------------------------------------------------------------------
# The agent's side


@dataclass
class _Standby:
    local_rank: int
    proc: subprocess.Popen[bytes]
    link: socket.socket
    env: dict[str, str]
    started_at: float
    answer: bytes = b""

    def poll_answer(self) -> bytes:
        """What the standby said so far (``ready``, or ``cuda`` if its imports initialised
        CUDA), without blocking."""
        if not self.answer.endswith(b"\n"):
            with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
                self.answer += self.link.recv(64)
        return self.answer


class StandbyPool:
    """One warm standby per worker slot of an agent (module docstring).

    Args:
        python: The interpreter the workers run.
        slots: How many worker slots the node has.
        env_of: The environment a worker of a slot would start with now (the agent's base
            environment and the slot's variables; the world's variables are dropped).
        refill_delay: Seconds after a hand-over before the slot's next standby starts.
        preload: The modules a standby imports (default: ``ELASTIC_STANDBY_PRELOAD``, else
            :data:`DEFAULT_PRELOAD`).
    """

    def __init__(self, python: str, slots: int, env_of: Callable[[int], Mapping[str, str]],
                 refill_delay: float = DEFAULT_REFILL_DELAY_S,
                 preload: Sequence[str] | None = None) -> None:
        self._python = python
        self._env_of = env_of
        self._refill_delay = refill_delay
        self._preload = preload
        self._standbys: dict[int, _Standby] = {}
        self._due = dict.fromkeys(range(slots), 0.0)
        self._disabled: str | None = None
        #: Hand-overs made (tests and the log read it).
        self.handed_over = 0

    @staticmethod
    def supports(argv: Sequence[str]) -> bool:
        """Whether a standby can run the worker command ``argv`` (a Python target under
        ``launch.worker_guard``, not ``--exec``)."""
        return bool(argv) and _guard_args(argv, argv[0]) is not None

    @property
    def disabled(self) -> str | None:
        """Why the pool stopped keeping standbys, or ``None``."""
        return self._disabled

    def pids(self) -> list[int]:
        """The standbys' process ids."""
        return [s.proc.pid for s in self._standbys.values()]

    def tick(self, now: float | None = None, hold: Collection[int] = ()) -> None:
        """Reaps standbys that died and starts those that are due (the agent's main loop),
        except those of the slots in ``hold``."""
        now = time.monotonic() if now is None else now
        for local_rank, standby in list(self._standbys.items()):
            code = standby.proc.poll()
            if standby.poll_answer().startswith(_TAINTED):
                self._disable("a preloaded module initialised CUDA (set "
                              f"{env.STANDBY_PRELOAD} to modules that do not)")
            if code is not None:
                logger.warning("warm standby of worker slot %d (pid %d) exited with code %s "
                               "before it was used", local_rank, standby.proc.pid, code)
                self._drop(local_rank)
                self._due[local_rank] = now + max(self._refill_delay, _RESPAWN_AFTER_DEATH_S)
        if self._disabled is not None:
            return
        for local_rank, due in self._due.items():
            if local_rank not in self._standbys and now >= due and local_rank not in hold:
                self._spawn(local_rank, now)

    def take(self, local_rank: int, full_env: Mapping[str, str],
             argv: Sequence[str]) -> subprocess.Popen[bytes] | None:
        """Hands a world to the slot's standby, which becomes the worker.

        Args:
            local_rank: The slot.
            full_env: The worker's whole environment.
            argv: The worker command (``python -u -m launch.worker_guard ...``).

        Returns:
            The standby's process, now the worker's; ``None`` if there is no live standby
            for the slot or it cannot take this worker (the caller starts it cold).
        """
        standby = self._standbys.get(local_rank)
        target = _guard_args(argv, self._python)
        if standby is None or target is None or standby.proc.poll() is not None:
            return None
        static = _static(full_env)
        if static != standby.env:
            changed = sorted(k for k in static.keys() | standby.env.keys()
                             if static.get(k) != standby.env.get(k))
            logger.info("worker slot %d starts cold: its environment changed since its "
                        "standby started (%s)", local_rank, ", ".join(changed))
            self._drop(local_rank)
            self._due[local_rank] = 0.0
            return None
        # Read now, while the socket does not block: the answer may not have been read yet.
        ready = standby.poll_answer() == _READY
        message = json.dumps({"env": dict(full_env), "argv": target,
                              "sent_at": time.time()}).encode() + b"\n"
        try:
            standby.link.settimeout(_SEND_TIMEOUT_S)
            standby.link.sendall(message)
        except OSError as exc:
            logger.warning("could not hand a world to the standby of slot %d (%s); "
                           "starting the worker cold", local_rank, exc)
            self._drop(local_rank)
            return None
        standby.link.close()
        del self._standbys[local_rank]
        # A standby still importing (a node's first start) becomes a worker that says hello,
        # and may declare in place, only once its imports are done: its slot's next standby
        # waits longer, so that it is not started just to be dropped then.
        self._due[local_rank] = time.monotonic() + (
            self._refill_delay if ready else max(self._refill_delay, REFILL_AFTER_IMPORTING_S))
        self.handed_over += 1
        logger.info("worker slot %d starts in its warm standby (pid %d, %s)", local_rank,
                    standby.proc.pid, "ready" if ready else "still importing")
        return standby.proc

    def close(self) -> None:
        """Kills every standby (the agent is leaving)."""
        self._disable("the agent is stopping")
        for local_rank in list(self._standbys):
            self._drop(local_rank)

    # -- internals --------------------------------------------------------------------------

    def _spawn(self, local_rank: int, now: float) -> None:
        static = _static(self._env_of(local_rank))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child_env = dict(static)
        child_env[env.STANDBY_FD] = str(theirs.fileno())
        if self._preload is not None:
            child_env[env.STANDBY_PRELOAD] = ",".join(self._preload)
        try:
            # Its standard error is piped like a worker's: the slot copies it once the
            # standby is its worker (launch/slots.py).
            proc = subprocess.Popen([self._python, "-u", "-m", STANDBY_MODULE], env=child_env,
                                    pass_fds=(theirs.fileno(),), start_new_session=True,
                                    stderr=subprocess.PIPE)
        except OSError as exc:
            ours.close()
            self._disable(f"a standby could not start ({exc})")
            return
        finally:
            theirs.close()
        ours.setblocking(False)
        self._standbys[local_rank] = _Standby(local_rank, proc, ours, static, now)
        logger.debug("started the warm standby of worker slot %d (pid %d)", local_rank,
                     proc.pid)

    def _drop(self, local_rank: int) -> None:
        standby = self._standbys.pop(local_rank, None)
        if standby is None:
            return
        standby.link.close()
        if standby.proc.stderr is not None:
            standby.proc.stderr.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(standby.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            standby.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            standby.proc.wait(timeout=5)

    def _disable(self, why: str) -> None:
        if self._disabled is None:
            self._disabled = why
            if why != "the agent is stopping":
                logger.warning("no more warm standbys on this node: %s; workers start cold",
                               why)


def _static(full_env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in full_env.items() if k not in WORLD_KEYS and k != env.STANDBY_FD}


def _guard_args(argv: Sequence[str], python: str) -> list[str] | None:
    """The ``launch.worker_guard`` arguments of a worker command, if a standby can run it
    (a Python target: not ``--exec``)."""
    args = list(argv)
    if args[:4] != [python, "-u", "-m", GUARD_MODULE] or "--exec" in args[4:5]:
        return None
    return args[4:]


# --------------------------------------------------------------------------------------------
# The standby process


def _set_comm(name: str) -> None:
    """Sets this process's ``/proc/PID/comm`` (what ``ps -o comm`` shows)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def _comm() -> str:
    try:
        with open("/proc/self/comm") as comm:
            return comm.read().strip()
    except OSError:
        return "python"


def preload(modules: Sequence[str], stop: Callable[[], bool] = lambda: False) -> list[str]:
    """Imports ``modules`` until ``stop()`` (checked between two); returns those that could
    not be imported (they are skipped)."""
    missing = []
    for name in modules:
        if stop():
            break
        try:
            importlib.import_module(name)
        except Exception:  # a module this torch build lacks: the script imports it itself
            missing.append(name)
    return missing


def cuda_initialised() -> bool:
    """Whether CUDA was initialised in this process (never by importing torch alone)."""
    torch: Any = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


class _Called:
    """Gives the process its interpreter's name back as soon as a world arrives, even while
    the main thread still imports: from then on it is a worker, whatever it is doing."""

    def __init__(self, link: socket.socket, name: str) -> None:
        self._link = link
        self._name = name
        self._main = threading.get_native_id()
        self._lock = threading.Lock()
        self._called = False
        threading.Thread(target=self._wait, name="elastic-standby-call", daemon=True).start()

    def _wait(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            select.select([self._link], [], [])
        with self._lock:
            self._called = True
            # prctl names only the calling thread: write the main thread's name instead.
            with contextlib.suppress(OSError), \
                    open(f"/proc/self/task/{self._main}/comm", "w") as comm:
                comm.write(self._name)

    def is_called(self) -> bool:
        """Whether a world (or the end) has come."""
        with self._lock:
            return self._called

    def ready(self) -> None:
        """The imports are done: named ``elastic-standby`` unless a world already came."""
        with self._lock:
            if not self._called:
                _set_comm(COMM_NAME)


def _preload_list() -> list[str]:
    raw = os.environ.get(env.STANDBY_PRELOAD)
    if raw is None:
        return list(DEFAULT_PRELOAD)
    return [m.strip() for m in raw.split(",") if m.strip()]


def _read_message(link: socket.socket) -> dict[str, Any] | None:
    """The hand-over message (one JSON line), or ``None`` if the agent closed the link."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = link.recv(1 << 16)
        if not chunk:
            return None
        data += chunk
    message = json.loads(data)
    return message if isinstance(message, dict) else None


def _apply_env(new: Mapping[str, str]) -> None:
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ.clear()
    os.environ.update(new)
    torch: Any = sys.modules.get("torch")
    wanted = new.get("OMP_NUM_THREADS")
    if torch is not None and wanted != threads and wanted and wanted.isdigit():
        torch.set_num_threads(int(wanted))  # torch read the old value at import


def main() -> int:
    """The standby: guard, import, wait for a world, then become the worker."""
    from launch.worker_guard import guard, parse_target, run_target

    raw_fd = os.environ.pop(env.STANDBY_FD, "")
    if not raw_fd.isdigit():
        sys.stderr.write(f"launch.standby: run by the node agent only ({env.STANDBY_FD} "
                         "is not set)\n")
        return 2
    link = socket.socket(fileno=int(raw_fd))
    guard()
    name = _comm()
    _set_comm(WARMING_NAME)
    called = _Called(link, name)
    # A world handed over mid-import stops the rest: the script imports what it needs itself,
    # so a standby still warming up is never slower than a cold start.
    preload(_preload_list(), stop=called.is_called)
    tainted = cuda_initialised()
    called.ready()
    with contextlib.suppress(OSError):
        link.sendall(_TAINTED if tainted else _READY)
    try:
        message = _read_message(link)
    except (OSError, ValueError):
        message = None
    link.close()
    if message is None:
        return 0  # discarded by the agent
    argv = [str(a) for a in message.get("argv", ())]
    new_env = {str(k): str(v) for k, v in dict(message.get("env", {})).items()}
    target = parse_target(argv)
    if target is None:
        return 2
    if tainted:
        # This process has a CUDA context made before the world was known: run the worker in
        # a fresh image of this process instead (same pid, the parent-death signal kept).
        os.execve(sys.executable, [sys.executable, "-u", "-m", GUARD_MODULE, *argv], new_env)
    _apply_env(new_env)
    _set_comm(name)  # the call's thread did too, unless the link closed under it
    return run_target(*target)


if __name__ == "__main__":
    sys.exit(main())
