"""Host buffers for remote shard files, reused between saves, and an upload body over them.

A remote shard file is assembled in memory before it is put whole (see ``shard_io``). Fresh
memory for it would be faulted in page by page at every save, which costs more than the copy
itself (about 2 GB/s against 10 here), so each buffer is a ``bytearray`` kept between saves
at the length of the largest file it held: the next file overwrites it in place, on pages that
are already resident, and only the part of a file past the buffer's end grows it.

Uploading must not copy it again either. botocore turns a ``bytes`` body into ``BytesIO``, and
aiohttp then asks for its buffer, which un-shares the ``BytesIO`` (a full copy into fresh
memory); a ``bytearray`` body takes aiohttp's one-shot path, which joins headers and body (also
a full copy). :class:`BufferBody` is a read-only ``BytesIO`` over the buffer's memory: the
HTTP stack reads it in chunks and nothing is copied whole. Measured on moto (4 x 75 MiB in
parallel): 1.02 s against 1.23 s for the same bytes as ``bytes``.
"""

from __future__ import annotations

import io
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)


class BufferBody(io.BytesIO):
    """A read-only, seekable file object over a buffer's bytes that copies nothing up front.

    It is a ``BytesIO`` so that HTTP stacks take their in-memory streaming path; every method
    they use (``read``, ``readinto``, ``seek``, ``tell``, ``getbuffer``) is served from the
    wrapped memory, and ``len()`` and slicing work as on ``bytes`` (s3fs needs both).

    Args:
        data: The bytes to serve (``bytes``, ``bytearray`` or ``memoryview``).
    """

    def __init__(self, data: Any) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def __len__(self) -> int:
        return self._view.nbytes

    def __getitem__(self, key: slice) -> BufferBody:
        return BufferBody(self._view[key])

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._view.nbytes
        if size is not None and size >= 0:
            end = min(end, self._pos + size)
        start, self._pos = self._pos, max(self._pos, end)
        return bytes(self._view[start:end])

    def read1(self, size: int | None = -1) -> bytes:
        return self.read(size)

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        n = max(0, min(target.nbytes, self._view.nbytes - self._pos))
        target[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def getbuffer(self) -> memoryview:
        return self._view[:]

    def getvalue(self) -> bytes:
        return bytes(self._view)

    def write(self, data: Any) -> int:
        raise io.UnsupportedOperation("BufferBody is read-only.")

    def close(self) -> None:
        """Release the view, so that the buffer under it can be resized again."""
        self._view.release()
        super().close()


class BufferPool:
    """Free ``bytearray`` buffers, handed out one per remote file being assembled.

    The pool keeps as many buffers as files were assembled at once (the I/O threads), each as
    large as the largest file it held, so it holds about one more copy of the rank's shard
    between saves; :meth:`clear` gives that memory back.
    """

    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def acquire(self) -> bytearray:
        """A buffer to assemble one file in (empty or holding stale bytes to overwrite)."""
        with self._lock:
            return self._free.pop() if self._free else bytearray()

    def release(self, buf: bytearray) -> None:
        """Give ``buf`` back; it is dropped if something still holds a view of its memory."""
        try:
            # Resizing is refused while a view exists; a buffer some view outlived must not be
            # written into again (the view's holder would see the next save's bytes).
            buf.append(0)
            del buf[-1]
        except BufferError:
            logger.debug("upload buffer still viewed after its upload; dropping it")
            return
        with self._lock:
            self._free.append(buf)

    def clear(self) -> None:
        """Drop every free buffer."""
        with self._lock:
            self._free.clear()

    @property
    def retained_bytes(self) -> int:
        """Bytes held by free buffers (their lengths; capacity may be a little more)."""
        with self._lock:
            return sum(len(b) for b in self._free)
