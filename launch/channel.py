"""The agent's end of the local channel to its workers (the worker's end: ``elastic.agent_link``).

Workers never talk to etcd: everything they need about membership comes from their node's
agent over a Unix stream socket in a directory only the agent's user can enter (mode 0700),
named to them by ``ELASTIC_AGENT_SOCKET``. The kernel tells the agent who connected
(``SO_PEERCRED``): a connection from a process that is not one of this agent's workers is
closed unread. So no credential, and no etcd endpoint, ever reaches a worker.

Messages are the typed messages of :mod:`elastic.contract.messages`, one JSON object per line.
Workers say ``hello`` first (their local rank and incarnation), then ``heartbeat`` about twice
a second from a thread of their own (a stopped process falls silent: that is how a frozen
worker is noticed), and report what the agent needs. The agent sends each new ``world``, the
node's ``lease`` state, the run's ``end``, ``gone`` (local peers that died) and ``evict``.
Sends never block the agent for long: a worker that does not read (stopped, hung) has its
messages dropped after a short timeout, and the heartbeat rule decides its fate.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from elastic.agent_link import send_all
from elastic.contract.messages import (
    AgentMessage,
    Heartbeat,
    Hello,
    MessageError,
    WorkerMessage,
    decode_worker_message,
    encode,
)
from launch.socket_dirs import private_socket_dir

__all__ = ["ChannelServer", "WorkerConnection"]

logger = logging.getLogger(__name__)

_SEND_TIMEOUT_S: Final = 0.5
_MAX_LINE: Final = 1 << 20
_PEERCRED: Final = struct.Struct("3i")


@dataclass
class WorkerConnection:
    """One connected worker process.

    Attributes:
        local_rank: Its slot on the node.
        incarnation: Which start of that slot it is.
        pid: Its process id (from the kernel, not from the worker's word).
        last_heard: ``time.monotonic()`` of its last message.
        exiting: It said its interpreter is shutting down (its heartbeat thread stops
            before the process ends).
    """

    local_rank: int
    incarnation: int
    pid: int
    sock: socket.socket
    last_heard: float = field(default_factory=time.monotonic)
    closed: bool = False
    exiting: bool = False
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: AgentMessage) -> bool:
        """Sends one message; returns ``False`` if the worker did not take it in time.

        A worker whose socket buffer stays full for the send timeout is not reading (stopped
        or hung); a message cut in half would corrupt the stream, so the connection is
        closed then, and the worker's heartbeat timeout decides what happens to it.
        """
        data = encode(message)
        with self.send_lock:
            if self.closed:
                return False
            if send_all(self.sock, data, _SEND_TIMEOUT_S):
                return True
        self.close()
        return False

    def close(self) -> None:
        """Closes the connection (the worker's reader sees end of file)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


MessageHandler = Callable[[WorkerConnection, WorkerMessage], None]


class ChannelServer:
    """Listens for this agent's workers and dispatches their messages.

    Args:
        on_message: Called (from the connection's reader thread) with every message after
            ``hello``; must not block for long.
        on_disconnect: Called once when a worker's connection ends.
        accept: Whether a connecting process (by pid) is one of this agent's workers.
    """

    def __init__(self, on_message: MessageHandler,
                 on_disconnect: Callable[[WorkerConnection], None],
                 accept: Callable[[int], bool]) -> None:
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        self._accept_pid = accept
        self._dir = private_socket_dir("elastic-agent-", "agent.sock")
        self.path = os.path.join(self._dir, "agent.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(socket.SOMAXCONN)
        self._lock = threading.Lock()
        self._connections: dict[int, WorkerConnection] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="elastic-channel",
                                        daemon=True)
        self._thread.start()

    @property
    def directory(self) -> str:
        """The private directory that holds the socket."""
        return self._dir

    def connections(self) -> list[WorkerConnection]:
        """The connected workers."""
        with self._lock:
            return [c for c in self._connections.values() if not c.closed]

    def connection(self, local_rank: int) -> WorkerConnection | None:
        """The connected worker of slot ``local_rank``, if any."""
        with self._lock:
            found = self._connections.get(local_rank)
        return found if found is not None and not found.closed else None

    def broadcast(self, message: AgentMessage) -> None:
        """Sends ``message`` to every connected worker (never blocks for long)."""
        for connection in self.connections():
            connection.send(message)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="elastic-channel-conn",
                             daemon=True).start()

    def _peer_pid(self, sock: socket.socket) -> int:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid, uid, _gid = _PEERCRED.unpack(raw)
        return pid if uid == os.getuid() else -1

    def _serve(self, sock: socket.socket) -> None:
        try:
            pid = self._peer_pid(sock)
        except OSError:
            pid = -1
        if pid <= 0 or not self._accept_pid(pid):
            logger.warning("refused a channel connection from pid %d: not a worker of this "
                           "agent", pid)
            sock.close()
            return
        reader = sock.makefile("rb")
        connection: WorkerConnection | None = None
        try:
            while not self._closed:
                line = reader.readline(_MAX_LINE)
                if not line:
                    return
                try:
                    raw = json.loads(line)
                    if not isinstance(raw, dict):
                        raise MessageError("a channel message must be a JSON object")
                    message = decode_worker_message(raw)
                except (ValueError, MessageError) as exc:
                    logger.warning("ignoring a channel message from pid %d (%s)", pid, exc)
                    continue
                if connection is None:
                    connection = self._hello(sock, pid, message)
                    if connection is None:
                        return
                    continue
                connection.last_heard = time.monotonic()
                if not isinstance(message, Heartbeat):
                    self._on_message(connection, message)
        except OSError:
            return
        finally:
            reader.close()
            if connection is not None:
                connection.close()
                with self._lock:
                    if self._connections.get(connection.local_rank) is connection:
                        del self._connections[connection.local_rank]
                self._on_disconnect(connection)
            else:
                sock.close()

    def _hello(self, sock: socket.socket, pid: int,
               message: WorkerMessage) -> WorkerConnection | None:
        if not isinstance(message, Hello):
            logger.warning("channel: pid %d spoke before saying hello; closing", pid)
            return None
        connection = WorkerConnection(message.local_rank, message.incarnation, pid, sock)
        with self._lock:
            old = self._connections.get(connection.local_rank)
            self._connections[connection.local_rank] = connection
        if old is not None and old is not connection:
            old.close()
        self._on_message(connection, message)
        return connection

    def close(self) -> None:
        """Stops listening, closes every connection and removes the socket's directory."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        for connection in self.connections():
            connection.close()
        shutil.rmtree(self._dir, ignore_errors=True)
