"""Hang a worker's training step while the rest of the process lives on (test scripts only).

SIGSTOP freezes a whole process; a *hung worker* is different: its background threads (a
heartbeat, a store client, an agent channel) keep running and answering, but its training step
never reaches the next collective. Only the worker script can do that, so test scripts
cooperate through a file:

* the test sets ``ELASTIC_TEST_HANG_FILE=<path>`` in the workers' environment;
* a worker calls :func:`maybe_hang` once per step, right before its collective;
* while ``<path>`` exists and names the worker's PID (or ``*``), :func:`maybe_hang` sleeps in
  50 ms naps; while it hangs it keeps ``<path>.hung.<pid>`` in existence, so the test can wait
  until the worker really is stuck (:func:`wait_hung`);
* the file holds PIDs and ``*`` separated by blanks, commas or newlines; the test side writes
  it atomically with :func:`hang_worker`, :func:`hang_all`, :func:`release_worker` and
  :func:`release_all`.

:func:`maybe_hang` costs one dictionary lookup when the variable is unset, and at most one
``stat`` per 50 ms when it is set. It needs nothing but the standard library, so a worker
script can import it before torch (with the repository root on ``PYTHONPATH``, as the test
harnesses set it). Example (worker script)::

    from tests.support.hang import maybe_hang

    for step in range(start, steps):
        loss = compute(step)
        maybe_hang()                  # the test may hold this rank here
        dist.all_reduce(loss)

and in the test::

    hang_worker(hang_file, worker_pid)
    wait_hung(hang_file, worker_pid, timeout_s=10)
    ...                               # the other ranks block in their collective
    release_worker(hang_file, worker_pid)
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Final

HANG_FILE_ENV: Final = "ELASTIC_TEST_HANG_FILE"
#: The worker looks at the hang file at most this often, and naps this long while hung.
POLL_S: Final = 0.05
ALL: Final = "*"
_SEPARATORS: Final = re.compile(r"[\s,]+")

_next_check = 0.0


def parse_targets(text: str) -> frozenset[str]:
    """The targets a hang file names: PIDs as decimal strings, and ``*`` for every worker.

    Raises:
        ValueError: naming the first token that is neither a PID nor ``*``.
    """
    tokens = frozenset(t for t in _SEPARATORS.split(text) if t)
    for token in tokens:
        if token != ALL and not (token.isdigit() and int(token) > 0):
            raise ValueError(f"hang file token ({token!r}) is neither a PID nor '*'; "
                             "write the file with tests.support.hang helpers.")
    return tokens


def targets(path: str | Path, pid: int) -> bool:
    """True if the hang file at ``path`` exists and names ``pid`` or ``*``."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return False
    names = parse_targets(text)
    return ALL in names or str(pid) in names


def hung_marker(path: str | Path, pid: int) -> Path:
    """The file a worker keeps while :func:`maybe_hang` holds it."""
    return Path(f"{path}.hung.{pid}")


def maybe_hang() -> float:
    """Blocks while the hang file names this process; the worker's side of the convention.

    Returns:
        The seconds spent hung (0.0 when not hung).
    """
    global _next_check
    path = os.environ.get(HANG_FILE_ENV)
    if not path:
        return 0.0
    now = time.monotonic()
    if now < _next_check:
        return 0.0
    _next_check = now + POLL_S
    pid = os.getpid()
    if not targets(path, pid):
        return 0.0
    marker = hung_marker(path, pid)
    marker.touch()
    try:
        while targets(path, pid):
            time.sleep(POLL_S)
    finally:
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
    return time.monotonic() - now


def _write(path: str | Path, names: frozenset[str]) -> None:
    target = Path(path)
    if not names:
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        return
    # Write then rename, so a worker never reads half a file.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(sorted(names)) + "\n")
    os.replace(tmp, target)


def _read(path: str | Path) -> frozenset[str]:
    try:
        return parse_targets(Path(path).read_text())
    except FileNotFoundError:
        return frozenset()


def _pid_token(pid: int) -> str:
    if pid <= 0:
        raise ValueError(f"worker pid ({pid}) must be a positive process id.")
    return str(pid)


def hang_worker(path: str | Path, pid: int) -> None:
    """Adds ``pid`` to the hang file: that worker hangs at its next :func:`maybe_hang`."""
    _write(path, _read(path) | {_pid_token(pid)})


def hang_all(path: str | Path) -> None:
    """Adds ``*`` to the hang file: every worker that reads it hangs."""
    _write(path, _read(path) | {ALL})


def release_worker(path: str | Path, pid: int) -> None:
    """Removes ``pid`` from the hang file (a ``*`` stays: see :func:`release_all`)."""
    _write(path, _read(path) - {_pid_token(pid)})


def release_all(path: str | Path) -> None:
    """Removes the hang file: every hung worker goes on within :data:`POLL_S`."""
    _write(path, frozenset())


def is_hung(path: str | Path, pid: int) -> bool:
    """True while worker ``pid`` sits in :func:`maybe_hang`."""
    return hung_marker(path, pid).exists()


def wait_hung(path: str | Path, pid: int, timeout_s: float) -> None:
    """Waits until worker ``pid`` sits in :func:`maybe_hang`.

    Raises:
        TimeoutError: naming the worker, after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not is_hung(path, pid):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"worker {pid} did not reach maybe_hang() within "
                               f"{timeout_s:g} s (hang file {path}).")
        time.sleep(POLL_S / 2)
