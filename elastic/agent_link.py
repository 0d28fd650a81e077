"""A worker's end of the local channel to its node agent (the agent's end: ``launch.channel``).

The worker learns everything about membership here, never from etcd: the current world, the
node's lease state, the run's end, local peers that died, its own eviction. Two daemon
threads serve it: a reader that applies the agent's messages and runs the listeners (the
in-place controller's abort logic lives in one), and a heartbeat that tells the agent this
process still runs (a SIGSTOPped worker falls silent) and runs periodic checks (the progress
rule). Sending never blocks for long; a dead agent ends the link (and the worker dies with
its agent anyway: ``launch.worker_guard``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Final

from elastic import env
from elastic.contract.messages import (
    AgentMessage,
    End,
    Evict,
    Exiting,
    Failure,
    Gone,
    Heartbeat,
    Hello,
    Lease,
    MessageError,
    StallRule,
    Welcome,
    WorkerMessage,
    World,
    decode_agent_message,
    encode,
)
from elastic.contract.records import WorldRecord
from elastic_errors import ConfigError, JobFatalError

__all__ = ["AgentLink", "current_link", "describe", "link_from_env", "report_failure", "send_all"]

logger = logging.getLogger(__name__)

HEARTBEAT_S: Final = 0.5
_SEND_TIMEOUT_S: Final = 1.0
_CONNECT_TIMEOUT_S: Final = 10.0


def send_all(sock: socket.socket, data: bytes, timeout: float) -> bool:
    """Sends ``data`` without blocking longer than ``timeout``; returns whether all went.

    The socket stays in blocking mode for its reader thread (a timeout on it would break a
    buffered ``readline``), so sends poll for room instead.
    """
    deadline = time.monotonic() + timeout
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view, socket.MSG_DONTWAIT)
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([], [sock], [], left)
            continue
        except OSError:
            return False
        view = view[sent:]
    return True


class AgentLink:
    """The connection to the node agent, and what it said last.

    Args:
        path: The agent's socket (``ELASTIC_AGENT_SOCKET``).
        local_rank: This worker's slot on the node.
        incarnation: Which start of that slot this process is.

    Raises:
        ConnectionError: If the agent cannot be reached within 10 s.
    """

    def __init__(self, path: str, *, local_rank: int, incarnation: int) -> None:
        self.local_rank = local_rank
        self.incarnation = incarnation
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._listeners: list[Callable[[AgentMessage], None]] = []
        self._tickers: list[Callable[[], None]] = []
        self._closed = False
        #: The newest world the agent reported.
        self.world: WorldRecord | None = None
        #: Whether the node's lease is fresh (a member that may commit checkpoints).
        self.lease_ok = True
        #: How the run ended, once it has.
        self.end: End | None = None
        #: Why the agent evicted this worker, once it has.
        self.evicted: str | None = None
        #: Job-wide ids of workers known dead (local peers the agent saw exit).
        self.gone: set[str] = set()
        #: This node's id and this worker's job-wide id (from the agent's welcome).
        self.node = ""
        self.me = ""
        #: When to report a stalled collective (from the agent's welcome).
        self.stall: StallRule | None = None
        #: The training step this worker is at (reported with a failure).
        self.step = -1
        #: Decides whether an exception a worker dies of was caused by a peer's failure
        #: (set by the in-place controller, which has the membership evidence).
        self.peer_check: Callable[[BaseException], bool] | None = None
        self.lost = threading.Event()
        self._sock = self._connect(path)
        self._reader = self._sock.makefile("rb")
        self.send(Hello(local_rank, incarnation, os.getpid()))
        self._read_welcome()
        threading.Thread(target=self._read_loop, name="elastic-agent-link", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="elastic-heartbeat",
                         daemon=True).start()

    @staticmethod
    def _connect(path: str) -> socket.socket:
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return sock
            except OSError as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"could not reach the node agent at {path} ({exc}); start the script "
                        "with elastic-run."
                    ) from exc
                time.sleep(0.05)

    def _read_welcome(self) -> None:
        line = self._reader.readline()
        if not line:
            raise ConnectionError("the node agent closed the channel before welcoming us")
        message = self._parse(line)
        if not isinstance(message, Welcome):
            raise ConnectionError("the node agent did not welcome this worker; the agent and "
                                  "its workers must run the same elastic-run")
        self._apply(message)

    @property
    def fileno(self) -> int:
        """The channel's file descriptor (never severed with a world's connections)."""
        return self._sock.fileno()

    # -- sending ----------------------------------------------------------------------------

    def send(self, message: WorkerMessage) -> bool:
        """Sends a message to the agent; returns ``False`` if it could not be delivered."""
        data = encode(message)
        with self._send_lock:
            if self._closed:
                return False
            return send_all(self._sock, data, _SEND_TIMEOUT_S)

    # -- receiving --------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[AgentMessage], None]) -> None:
        """Calls ``listener(message)`` (on the reader thread) after each message is applied."""
        self._listeners.append(listener)

    def add_ticker(self, ticker: Callable[[], None]) -> None:
        """Calls ``ticker()`` about every 0.5 s from the heartbeat thread."""
        self._tickers.append(ticker)

    @staticmethod
    def _parse(line: bytes) -> AgentMessage | None:
        try:
            raw = json.loads(line)
            return decode_agent_message(raw) if isinstance(raw, dict) else None
        except (ValueError, MessageError) as exc:
            logger.error("ignoring a channel message from the agent (%s)", exc)
            return None

    def _apply(self, message: AgentMessage) -> None:
        with self._cond:
            world = None
            if isinstance(message, Welcome):
                self.node, self.me, self.stall = message.node, message.worker, message.stall
                world, self.lease_ok = message.world, message.lease_ok
                self.end = message.end or self.end
            elif isinstance(message, World):
                world = message.world
            elif isinstance(message, Lease):
                self.lease_ok = message.lease_ok
            elif isinstance(message, End):
                self.end = message
            elif isinstance(message, Gone):
                self.gone.update(message.workers)
            elif isinstance(message, Evict):
                self.evicted = message.reason
            if world is not None and (self.world is None
                                      or world.revision >= self.world.revision):
                self.world = world
            self._cond.notify_all()

    def _read_loop(self) -> None:
        try:
            while True:
                line = self._reader.readline()
                if not line:
                    break
                message = self._parse(line)
                if message is None:
                    continue
                self._apply(message)
                for listener in list(self._listeners):
                    try:
                        listener(message)
                    except Exception:  # a listener must never end the link
                        logger.exception("agent link listener failed")
        except OSError:
            pass
        finally:
            if not self._closed:
                logger.warning("the node agent closed the channel")
            self.lost.set()
            with self._cond:
                self._cond.notify_all()

    def _heartbeat_loop(self) -> None:
        while not self._closed and not self.lost.is_set():
            self.send(Heartbeat())
            for ticker in list(self._tickers):
                try:
                    ticker()
                except Exception:
                    logger.exception("agent link ticker failed")
            time.sleep(HEARTBEAT_S)

    def wait(self, predicate: Callable[[AgentLink], bool], timeout: float) -> bool:
        """Waits until ``predicate(self)`` holds (or the link is lost); returns whether it did."""
        with self._cond:
            self._cond.wait_for(lambda: predicate(self) or self.lost.is_set(),
                                max(0.0, timeout))
            return predicate(self)

    def close(self) -> None:
        """Closes the channel (the agent sees this worker disconnect)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


_active: AgentLink | None = None


def current_link() -> AgentLink | None:
    """The link ``elastic.init()`` opened, if this worker runs under elastic-run."""
    return _active


def describe(exc: BaseException) -> str:
    """One line naming an exception: ``Type: first line of its message``."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def report_failure(exc: BaseException) -> None:
    """Tells this worker's agent what it is dying of (never raises).

    The agent charges the crash to its node's budget unless a peer's failure caused it, and
    ends the job at once with this error when every worker dies of the same one at the same
    step (the script's own bug), or when it is a verdict on the whole job
    (:class:`~elastic_errors.JobFatalError`).
    """
    link = _active
    try:
        if link is None or link.lost.is_set():
            link = link_from_env(register=False)
        if link is None:
            return
        peer = False
        if link.peer_check is not None:
            try:
                peer = link.peer_check(exc)
            except Exception:
                peer = False
        from elastic.failures import is_peer_failure_type

        link.send(Failure(describe(exc), link.step, peer=peer,
                          peer_type=is_peer_failure_type(exc),
                          fatal=isinstance(exc, JobFatalError)))
    except Exception:  # dying anyway: the exit code still tells the agent it failed
        logger.debug("could not report the failure to the agent", exc_info=True)


def link_from_env(*, register: bool = True) -> AgentLink | None:
    """The link named by the environment elastic-run's agent sets, or ``None`` outside it.

    Args:
        register: Make it the link :func:`report_failure` uses.

    Raises:
        ConfigError: If the variables are malformed.
        ConnectionError: If the agent cannot be reached.
    """
    path = os.environ.get(env.AGENT_SOCKET, "")
    if not path:
        return None
    raw_rank = os.environ.get("LOCAL_RANK", "0")
    raw_inc = os.environ.get(env.INCARNATION, "0")
    try:
        local_rank, incarnation = int(raw_rank), int(raw_inc)
    except ValueError:
        raise ConfigError(
            f"LOCAL_RANK ({raw_rank!r}) and {env.INCARNATION} ({raw_inc!r}) must be integers; "
            "start the script with elastic-run."
        ) from None
    link = AgentLink(path, local_rank=local_rank, incarnation=incarnation)
    if register:
        global _active
        _active = link
        # Before the interpreter's teardown stops the heartbeat thread (see the agent's
        # heartbeat rule): atexit handlers run first, in the reverse order of registration.
        atexit.register(link.send, Exiting())
    return link
