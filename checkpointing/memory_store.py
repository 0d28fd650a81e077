"""A node's checkpoint files in host memory, served over TCP by the node agent.

The node agent outlives its workers, so it holds, in its own memory, copies of the files of
the newest checkpoints its node's workers wrote, and of those one peer node's workers wrote
(:mod:`checkpointing.memory_tier` decides who sends what where, and when a restart may read
them). This module is the store and its wire format:

* every message is a 4-byte big-endian length and a JSON header, then, for a file, its bytes;
* ``{"op": "put", "dir", "rel", "size", "crc32"}`` + bytes stores a file (the store checks
  the size and the CRC32 it is sent, and refuses a mismatch);
* ``{"op": "get", "dir", "rel"}`` answers ``{"ok": true, "size", "crc32"}`` + bytes, or
  ``{"ok": false}``;
* ``{"op": "list", "dir"}`` answers ``{"ok": true, "files": {rel: [size, crc32]}}``.

``dir`` is ``{namespace}/{attempt directory}``: the namespace keeps jobs and checkpoint roots
apart. Per namespace the store keeps the files of the newest attempt directory only (by step,
then round) and drops older ones as newer ones arrive: copies are sent after their commit, so
an older directory is never storage's newest again, and a restore never reads it. A node thus
holds twice its share of one checkpoint (its own files and its peer's).

Like the process-group stores and gloo, it authenticates nothing: keep the training network
private (README, Security). Every socket has a timeout; the server's threads are daemons
and stop with :meth:`MemoryStore.close`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from checkpointing.layout import parse_dir_name

__all__ = ["MemoryStore", "StoredFile", "recv_message", "send_message"]

logger = logging.getLogger(__name__)

_HEADER: Final = struct.Struct(">I")
_MAX_HEADER: Final = 1 << 20
SOCKET_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class StoredFile:
    """One file held in memory."""

    data: bytes
    crc32: int


def send_message(sock: socket.socket, header: Mapping[str, Any],
                 payload: bytes | bytearray | memoryview | None = None) -> None:
    """Sends a header (and a file's bytes after it)."""
    raw = json.dumps(dict(header)).encode()
    sock.sendall(_HEADER.pack(len(raw)) + raw)
    if payload is not None:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection after {len(chunks)} of "
                                  f"{size} bytes")
        chunks += chunk
    return bytes(chunks)


def recv_message(sock: socket.socket) -> dict[str, Any] | None:
    """The next header, or ``None`` at a clean end of the connection."""
    raw = sock.recv(_HEADER.size)
    if not raw:
        return None
    if len(raw) < _HEADER.size:
        raw += _recv_exact(sock, _HEADER.size - len(raw))
    (length,) = _HEADER.unpack(raw)
    if length > _MAX_HEADER:
        raise ValueError(f"a memory-store header of {length} bytes is too large")
    header = json.loads(_recv_exact(sock, length))
    if not isinstance(header, dict):
        raise ValueError("a memory-store header must be a JSON object")
    return header


def recv_payload(sock: socket.socket, size: int) -> bytes:
    """The ``size`` bytes that follow a header."""
    return _recv_exact(sock, size)


class MemoryStore:
    """Checkpoint files in this process's memory, served on ``host`` (module docstring).

    Args:
        host: The address to serve on (the node's address peers dial).
        keep: Attempt directories kept per namespace.
    """

    def __init__(self, host: str, keep: int = 1) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._dirs: dict[str, dict[str, StoredFile]] = {}
        self._closed = threading.Event()
        self._server = socket.create_server((host, 0))
        self._server.settimeout(0.5)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, name="elastic-memory-store",
                                        daemon=True)
        self._thread.start()

    # -- the store --------------------------------------------------------------------------

    def put(self, dir_key: str, rel: str, data: bytes) -> None:
        """Stores a file (and drops directories older than the ``keep`` newest)."""
        with self._lock:
            self._dirs.setdefault(dir_key, {})[rel] = StoredFile(data, zlib.crc32(data))
            self._evict(dir_key.rpartition("/")[0])

    def get(self, dir_key: str, rel: str) -> StoredFile | None:
        """A stored file, or ``None``."""
        with self._lock:
            return self._dirs.get(dir_key, {}).get(rel)

    def listing(self, dir_key: str) -> dict[str, tuple[int, int]]:
        """``rel -> (size, crc32)`` of a directory's stored files."""
        with self._lock:
            return {rel: (len(f.data), f.crc32) for rel, f in self._dirs.get(dir_key, {}).items()}

    def held_bytes(self) -> int:
        """Bytes held in all."""
        with self._lock:
            return sum(len(f.data) for files in self._dirs.values() for f in files.values())

    def _evict(self, namespace: str) -> None:
        mine = [d for d in self._dirs if d.rpartition("/")[0] == namespace]
        mine.sort(key=lambda d: parse_dir_name(d.rpartition("/")[2]) or (-1, -1), reverse=True)
        for old in mine[self._keep:]:
            del self._dirs[old]

    # -- the server -------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(SOCKET_TIMEOUT_S)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="elastic-memory-store-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while not self._closed.is_set():
                    header = recv_message(conn)
                    if header is None:
                        return
                    self._answer(conn, header)
            except (OSError, ValueError) as exc:
                logger.debug("memory store connection ended: %s", exc)

    def _answer(self, conn: socket.socket, header: dict[str, Any]) -> None:
        op, dir_key = header.get("op"), str(header.get("dir", ""))
        if op == "put":
            size = int(header["size"])
            data = recv_payload(conn, size)
            if zlib.crc32(data) != int(header["crc32"]):
                send_message(conn, {"ok": False, "error": "CRC32 mismatch"})
                return
            self.put(dir_key, str(header["rel"]), data)
            send_message(conn, {"ok": True})
        elif op == "get":
            found = self.get(dir_key, str(header.get("rel", "")))
            if found is None:
                send_message(conn, {"ok": False})
            else:
                send_message(conn, {"ok": True, "size": len(found.data), "crc32": found.crc32},
                             found.data)
        elif op == "list":
            send_message(conn, {"ok": True, "files": {
                rel: list(entry) for rel, entry in self.listing(dir_key).items()}})
        else:
            send_message(conn, {"ok": False, "error": f"unknown op {op!r}"})

    def close(self) -> None:
        """Stops serving and forgets every file."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._server.close()
        self._thread.join(timeout=2)
        with self._lock:
            self._dirs.clear()
