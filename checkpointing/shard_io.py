"""DCP's file seam over :class:`Storage`: shard writes that are retried, checksummed, durable.

``torch.distributed.checkpoint`` writes through a ``FileSystemBase``. Ours differs from
torch's local and fsspec ones in four ways:

* every byte is CRC32'd and counted as it is written, so the commit record needs no second
  read of what was just written;
* local files are written with large unbuffered writes, writeback of what was written is started
  every few tens of MiB (so the disk works while serialisation goes on), and each file is
  fsynced once, after its last byte (DCP's own ``sync_files`` fsyncs before its buffer is
  flushed, and falls back to a machine-wide ``os.sync()`` on object stores);
* remote files are assembled in host buffers kept between saves (``remote_buffers``) and put
  whole under the storage retry policy, so a connection reset or an outage shorter than the
  deadline costs a re-upload, not the save (s3fs puts large objects as parallel multipart
  uploads);
* ``.metadata`` is renamed into place with the same retries on local disk, and put once under
  its final name on object stores, where a put is atomic anyway.

The files are plain DCP files: stock ``torch.distributed.checkpoint.load`` reads them.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import zlib
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, cast

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter

from checkpointing.layout import FileEntry
from checkpointing.remote_buffers import BufferPool
from checkpointing.storage import Storage, fsync_dir

#: Writes smaller than this are gathered first: torch.save emits many tiny header records.
_SMALL_WRITE = 1 << 20
#: Start writeback of local data every this many bytes.
_WRITEBACK_EVERY = 64 << 20


class _ChecksumStream(io.RawIOBase):
    """A write-only stream that CRC32s and counts its bytes, then hands them to a sink."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0
        self.crc = 0
        self.aborted = False
        #: A copy of every byte, when the caller keeps one (the memory tier's).
        self.copy: bytearray | None = None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        self.crc = zlib.crc32(mv, self.crc)
        if self.copy is not None:
            self.copy += mv
        self._accept(mv, self.size)
        self.size += n
        return n

    def _accept(self, mv: memoryview, offset: int) -> None:
        """Take the bytes ``mv`` (valid only during the call) that start at ``offset``."""
        raise NotImplementedError

    def entry(self) -> FileEntry:
        return FileEntry(size=self.size, crc32=self.crc & 0xFFFFFFFF)


class _LocalStream(_ChecksumStream):
    def __init__(self, path: str, *, sync: bool) -> None:
        super().__init__()
        self._small = bytearray()
        self._sync = sync
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._flushed_to = 0
        self._written = 0

    def _accept(self, mv: memoryview, offset: int) -> None:
        if mv.nbytes < _SMALL_WRITE:
            self._small += mv
            if len(self._small) >= _SMALL_WRITE:
                self._drain()
        else:
            self._drain()
            self._sink(mv)

    def _drain(self) -> None:
        if self._small:
            self._sink(memoryview(self._small))
            self._small = bytearray()

    def _sink(self, mv: memoryview) -> None:
        while mv.nbytes:
            done = os.write(self._fd, mv)
            mv = mv[done:]
            self._written += done
        if self._sync and self._written - self._flushed_to >= _WRITEBACK_EVERY:
            self._start_writeback()

    def _start_writeback(self) -> None:
        # Starts writeback of the written range without waiting for it (Linux, fadvise), so the
        # final fsync finds most of the file already on disk. The pages are not needed again.
        if hasattr(os, "posix_fadvise"):
            length = self._written - self._flushed_to
            os.posix_fadvise(self._fd, self._flushed_to, length, os.POSIX_FADV_DONTNEED)
        self._flushed_to = self._written

    def close(self) -> None:
        # DCP closes the stream itself after its last write: that is when the file must be
        # complete and durable. An aborted write is closed without either.
        if self._fd < 0:
            return
        fd = self._fd
        try:
            if not self.aborted:
                self._drain()
                if self._sync:
                    os.fsync(fd)
        finally:
            self._fd = -1
            os.close(fd)
            super().close()


class _MemoryStream(_ChecksumStream):
    """Assembles a remote file in a pooled buffer (see ``remote_buffers``), one copy per byte.

    The buffer keeps the length of the largest file it ever held (bytes past this file's end
    are a previous save's and are never uploaded), so a small file after a large one does not
    give the large one's memory back.
    """

    def __init__(self, pool: BufferPool) -> None:
        super().__init__()
        self._pool = pool
        self._buffer = pool.acquire()

    def _accept(self, mv: memoryview, offset: int) -> None:
        # Overwrites stale bytes in place; grows the buffer only past its end.
        self._buffer[offset:offset + mv.nbytes] = mv

    def upload(self, storage: Storage, path: str) -> None:
        """Put the file's bytes at ``path`` (retried by ``storage``)."""
        with memoryview(self._buffer)[:self.size] as data:
            storage.write_buffer(path, data)

    def recycle(self) -> None:
        """Hand the buffer back to the pool (after its upload, or after an abort)."""
        self._pool.release(self._buffer)
        self._buffer = bytearray()


class ShardFileSystem(FileSystemBase):
    """A DCP ``FileSystemBase`` writing through :class:`Storage`; records what it wrote.

    On object stores a put is atomic by itself, so a file written under a temporary name
    (DCP's ``.metadata.tmp``) is held in memory and put once, under the name it is renamed to,
    instead of a put, a copy and a delete.

    Args:
        storage: The checkpoint root's storage (its retry policy and filesystem are used).
        sync: fsync local files before reporting them written.
        buffers: Where remote files are assembled; a private pool when ``None``.
        keep_copies: Also keep each written file's bytes in memory (``copies``), for the
            memory tier (:mod:`checkpointing.memory_tier`).
    """

    def __init__(
        self, storage: Storage, *, sync: bool = True, buffers: BufferPool | None = None,
        keep_copies: bool = False,
    ) -> None:
        self.storage = storage
        self.sync = sync
        self.buffers = buffers if buffers is not None else BufferPool()
        self.keep_copies = keep_copies
        self._lock = threading.Lock()
        #: Path -> size and CRC32 of every file this object wrote (renames followed).
        self.written: dict[str, FileEntry] = {}
        #: Path -> bytes of every file this object wrote, with ``keep_copies``.
        self.copies: dict[str, bytearray] = {}
        # Remote files written under a temporary name, put when renamed.
        self._held: dict[str, _MemoryStream] = {}

    @contextmanager
    def create_stream(  # type: ignore[override]
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        """See base class; only ``"wb"`` is supported (reads go through DCP's readers)."""
        p = os.fspath(path)
        if mode != "wb":
            raise ValueError(f"Stream mode ({mode}) is not supported; only 'wb' is.")
        if self.storage.is_local:
            yield from self._local_stream(p)
        else:
            yield from self._remote_stream(p)

    def _local_stream(self, p: str) -> Generator[io.IOBase, None, None]:
        stream = self.storage.call(p, lambda: _LocalStream(p, sync=self.sync))
        stream.copy = bytearray() if self.keep_copies else None
        try:
            yield stream
            stream.close()
            if self.sync:
                fsync_dir(os.path.dirname(p))
        except BaseException:
            stream.aborted = True
            stream.close()
            with contextlib.suppress(OSError):
                os.unlink(p)
            raise
        self._done(p, stream)

    def _done(self, p: str, stream: _ChecksumStream) -> None:
        with self._lock:
            self.written[p] = stream.entry()
            if stream.copy is not None:
                self.copies[p] = stream.copy

    def _remote_stream(self, p: str) -> Generator[io.IOBase, None, None]:
        stream = _MemoryStream(self.buffers)
        stream.copy = bytearray() if self.keep_copies else None
        try:
            yield stream
            stream.close()
            if p.endswith(".tmp"):
                with self._lock:
                    self._held[p] = stream
                return
            stream.upload(self.storage, p)
        except BaseException:
            stream.aborted = True
            stream.close()
            stream.recycle()
            raise
        stream.recycle()
        self._done(p, stream)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        """See base class."""
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        """See base class."""
        return os.fspath(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """See base class."""
        src, dst = os.fspath(path), os.fspath(new_path)
        with self._lock:
            held = self._held.pop(src, None)
        if held is not None:
            try:
                held.upload(self.storage, dst)
            finally:
                held.recycle()
            self._done(dst, held)
            return
        self.storage.rename(src, dst)
        with self._lock:
            if src in self.written:
                self.written[dst] = self.written.pop(src)
            if src in self.copies:
                self.copies[dst] = self.copies.pop(src)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """See base class."""
        self.storage.makedirs(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """See base class."""
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        """See base class."""
        return self.storage.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        """See base class."""
        self.storage.remove_file(os.fspath(path))


class ShardWriter(FileSystemWriter):
    """DCP's file writer, writing through :class:`ShardFileSystem`.

    Args:
        storage: The checkpoint root's storage.
        path: The attempt directory (a path inside ``storage``, no protocol).
        sync: fsync local files (durability before the commit record).
        thread_count: Files written in parallel per rank.
        buffers: Where remote files are assembled (kept between saves by the caller).
        keep_copies: Keep each written file's bytes too (:meth:`copies`).
    """

    def __init__(
        self,
        storage: Storage,
        path: str,
        *,
        sync: bool = True,
        thread_count: int = 1,
        buffers: BufferPool | None = None,
        keep_copies: bool = False,
    ) -> None:
        # DCP's own fsync is off: ShardFileSystem fsyncs after the last byte instead.
        super().__init__(path, single_file_per_rank=True, sync_files=False,
                         thread_count=thread_count, overwrite=True)
        self.shard_fs = ShardFileSystem(storage, sync=sync, buffers=buffers,
                                        keep_copies=keep_copies)
        # DCP's writer only calls through ``fs``; ``shard_fs`` keeps the precise type for us.
        self.fs = cast(Any, self.shard_fs)
        self.path = self.fs.init_path(path)

    def written(self) -> dict[str, FileEntry]:
        """Name relative to the attempt directory -> entry, for every file this rank wrote."""
        prefix = str(self.path).rstrip("/") + "/"
        return {
            (p[len(prefix):] if p.startswith(prefix) else p): e
            for p, e in self.shard_fs.written.items()
        }

    def copies(self) -> dict[str, bytearray]:
        """Name relative to the attempt directory -> bytes, with ``keep_copies``."""
        prefix = str(self.path).rstrip("/") + "/"
        return {
            (p[len(prefix):] if p.startswith(prefix) else p): data
            for p, data in self.shard_fs.copies.items()
        }
