"""Restore from memory, not storage: checkpoint copies in the nodes' host memory.

Under elastic-run every node agent keeps a :class:`~checkpointing.memory_store.MemoryStore`
and names it to its workers (``ELASTIC_MEMORY_STORE``). A :class:`CheckpointManager` that
finds it there (its :class:`MemoryTier`) does two more things:

* **After each commit**, every rank sends the files it wrote (which it kept while writing
  them) to its own node's store and to one peer node's store: the next node, in rank order,
  of the world that saved. A node lost with its memory leaves a copy of its files on its
  peer. This runs on the checkpoint I/O thread, after the commit: a copy that fails only
  costs the next restart its memory restore.
* **On a load of the newest checkpoint**, the coordinator reads storage's newest commit
  record (small) and asks every node store of the current world what it holds of that
  directory. If the stores hold every file of it, each at the size and CRC32 of the commit
  record, the ranks read from memory instead of storage (no storage verification pass:
  every file fetched is checked against the commit record's CRC32 instead); a file that
  fails its check, or whose stores no longer answer, is read from storage and checked the
  same way. Anything less than a full, current copy loads from storage as before: memory
  holding an older step than storage's newest commit (or a newer, uncommitted one) is
  never used.

A plain ``torch.save`` script does not save through a ``CheckpointManager``, so none of this
applies to it; its restarts are cut by the warm standbys and the agent (docs/restart.md).
Outside elastic-run (plain torchrun) there is no store and nothing changes.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import socket
import threading
import zlib
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Final

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader

from checkpointing.errors import CheckpointCorruptError
from checkpointing.layout import FileEntry
from checkpointing.memory_store import recv_message, recv_payload, send_message

__all__ = ["MEMORY_STORE_ENV", "MemoryReader", "MemoryTier"]

logger = logging.getLogger(__name__)

#: The agent's store, ``host:port`` (the same name as ``elastic.env.MEMORY_STORE``).
MEMORY_STORE_ENV: Final = "ELASTIC_MEMORY_STORE"
CONNECT_TIMEOUT_S: Final = 2.0
IO_TIMEOUT_S: Final = 30.0


class MemoryTier:
    """This rank's view of the job's node memory stores (module docstring).

    Args:
        own: This node's store, ``host:port``.
        namespace: Keeps this checkpoint root's files apart from other jobs' and roots'.
    """

    def __init__(self, own: str, namespace: str) -> None:
        self.own = own
        self.namespace = namespace
        #: Every node store of the current world, in rank order (set by :meth:`bind`).
        self.endpoints: list[str] = [own]

    @classmethod
    def from_env(cls, url: str) -> MemoryTier | None:
        """The tier the node agent offers (``None`` outside elastic-run)."""
        own = os.environ.get(MEMORY_STORE_ENV, "")
        if not own:
            return None
        job = os.environ.get("TORCHELASTIC_RUN_ID", "")
        return cls(own, hashlib.sha256(f"{job}\0{url}".encode()).hexdigest()[:16])

    def bind(self, per_rank: Sequence[str | None]) -> None:
        """Learns the world's stores (every rank's ``own``, gathered in rank order)."""
        seen: dict[str, None] = {}
        for address in per_rank:
            if address:
                seen[address] = None
        self.endpoints = list(seen) or [self.own]

    def peer(self) -> str | None:
        """The store this node's copies also go to: the next node's, in rank order."""
        if self.own not in self.endpoints or len(self.endpoints) < 2:
            return None
        index = self.endpoints.index(self.own)
        return self.endpoints[(index + 1) % len(self.endpoints)]

    def _key(self, dir_name: str) -> str:
        return f"{self.namespace}/{dir_name}"

    # -- save side --------------------------------------------------------------------------

    def mirror(self, dir_name: str, files: Mapping[str, bytes | bytearray]) -> int:
        """Copies this rank's files of a committed checkpoint to its node's store and its
        peer's; returns how many stores took all of them. Never raises."""
        took = 0
        for address in filter(None, dict.fromkeys([self.own, self.peer()])):
            try:
                with _connect(address) as conn:
                    for rel, data in files.items():
                        send_message(conn, {"op": "put", "dir": self._key(dir_name),
                                            "rel": rel, "size": len(data),
                                            "crc32": zlib.crc32(data)}, data)
                        answer = recv_message(conn)
                        if not answer or not answer.get("ok"):
                            raise OSError(f"the store refused {rel}: {answer}")
                took += 1
            except (OSError, ValueError) as exc:
                logger.warning("could not copy checkpoint %s to the memory store at %s (%s); "
                               "a restart reads it from storage", dir_name, address, exc)
        return took

    # -- load side --------------------------------------------------------------------------

    def plan(self, dir_name: str, files: Mapping[str, FileEntry]) -> dict[str, list[str]] | None:
        """Which stores hold each file of ``dir_name`` at the commit record's size and CRC32;
        ``None`` unless every file is held somewhere (then the load reads storage)."""
        holders: dict[str, list[str]] = {rel: [] for rel in files}
        for address in self.endpoints:
            try:
                with _connect(address) as conn:
                    send_message(conn, {"op": "list", "dir": self._key(dir_name)})
                    answer = recv_message(conn) or {}
            except (OSError, ValueError):
                continue
            for rel, entry in dict(answer.get("files", {})).items():
                want = files.get(rel)
                if want is not None and list(entry) == [want.size, want.crc32]:
                    holders[rel].append(address)
        if not files or any(not where for where in holders.values()):
            return None
        # This node's own store first: a loopback read.
        return {rel: sorted(where, key=lambda a: a != self.own)
                for rel, where in holders.items()}

    def fetch(self, address: str, dir_name: str, rel: str) -> bytes | None:
        """One file from one store (``None`` if it does not have it or does not answer)."""
        try:
            with _connect(address) as conn:
                send_message(conn, {"op": "get", "dir": self._key(dir_name), "rel": rel})
                answer = recv_message(conn)
                if not answer or not answer.get("ok"):
                    return None
                return recv_payload(conn, int(answer["size"]))
        except (OSError, ValueError, KeyError):
            return None


@contextmanager
def _connect(address: str) -> Generator[socket.socket, None, None]:
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    try:
        conn.settimeout(IO_TIMEOUT_S)
        yield conn
    finally:
        conn.close()


class _MemoryFiles(FileSystemBase):
    """DCP's read seam: each file from a memory store, else from storage, CRC-checked."""

    def __init__(self, tier: MemoryTier, dir_name: str, plan: Mapping[str, list[str]],
                 files: Mapping[str, FileEntry], from_storage: Callable[[str], bytes],
                 where: str) -> None:
        self._tier = tier
        self._dir = dir_name
        self._plan = plan
        self._files = files
        self._from_storage = from_storage
        self._where = where
        self._cache: dict[str, bytes] = {}
        self._lock = threading.Lock()
        #: Files read from storage after memory failed them (tests and the log read it).
        self.fallbacks: list[str] = []

    def _read(self, rel: str) -> bytes:
        with self._lock:
            hit = self._cache.get(rel)
        if hit is not None:
            return hit
        want = self._files.get(rel)
        data = None
        for address in self._plan.get(rel, ()):
            got = self._tier.fetch(address, self._dir, rel)
            if got is not None and want is not None and len(got) == want.size \
                    and zlib.crc32(got) == want.crc32:
                data = got
                break
            logger.warning("memory copy of %s/%s at %s is %s; trying elsewhere", self._dir, rel,
                           address, "missing" if got is None else "damaged")
        if data is None:
            self.fallbacks.append(rel)
            data = self._from_storage(rel)
            if want is not None and zlib.crc32(data) != want.crc32:
                raise CheckpointCorruptError(
                    f"Checkpoint file ({self._where}/{rel}) has CRC32 "
                    f"({zlib.crc32(data):#010x}) but its commit record says "
                    f"({want.crc32:#010x}), and no memory copy is good either; the checkpoint "
                    "is damaged, load another one.")
        with self._lock:
            self._cache[rel] = data
        return data

    @contextmanager
    def create_stream(  # type: ignore[override]
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        """See base class; reads only."""
        if mode != "rb":
            raise ValueError(f"Stream mode ({mode}) is not supported; only 'rb' is.")
        rel = os.fspath(path).rsplit("/", 1)[-1]
        with io.BytesIO(self._read(rel)) as stream:
            yield stream

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        """See base class."""
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        """See base class."""
        return os.fspath(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """See base class (never called by a reader)."""
        raise NotImplementedError

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """See base class (never called by a reader)."""
        raise NotImplementedError

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """See base class."""
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        """See base class."""
        return os.fspath(path).rsplit("/", 1)[-1] in self._files

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        """See base class (never called by a reader)."""
        raise NotImplementedError


class MemoryReader(FileSystemReader):
    """DCP's file reader over the memory stores (storage for what they fail).

    Args:
        tier: This rank's memory tier.
        dir_name: The checkpoint's attempt directory.
        plan: :meth:`MemoryTier.plan`'s answer.
        files: The commit record's files (sizes and CRC32s).
        from_storage: Reads one file (by name) from storage.
        where: The checkpoint's URL (for messages).
    """

    def __init__(self, tier: MemoryTier, dir_name: str, plan: Mapping[str, list[str]],
                 files: Mapping[str, FileEntry], from_storage: Callable[[str], bytes],
                 where: str) -> None:
        super().__init__(where)
        self.memory_files = _MemoryFiles(tier, dir_name, plan, files, from_storage, where)
        self.fs: Any = self.memory_files
        self.path = where
