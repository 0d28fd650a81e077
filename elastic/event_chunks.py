"""The job event log on any fsspec URL (``s3://...``): immutable chunks, several writers.

Object stores have no append, and a spot node's local disk dies with the node. So each writer
(one per agent incarnation) buffers its records and puts them, at least every
``flush_interval_s`` (0.5 s) while it has any, as a new object of its own::

    {root}/{job}/{writer}/c{seq:010d}.jsonl                 one flush (JSON lines)
    {root}/{job}/{writer}/s{first:010d}-{last:010d}.jsonl   chunks first..last rolled up

``writer`` is ``{host}.{pid}.{random}``, unique per incarnation, so no two writers ever put the
same name and none can lose another's records. A writer SIGKILLed (its node reclaimed) loses
only the records it had not put yet: at most its last flush interval plus one put.

Roll-up: every ``rollup`` chunks (a minute at the defaults) the writer puts one segment object
with their records, then deletes the chunks, so that a day-long job leaves about 1,500 objects
per writer rather than 170,000. A reader takes every segment and the chunks no segment covers,
so a writer that dies between the segment's put and the deletes leaves no duplicates.

Writing never blocks the caller: :meth:`ChunkWriter.write` appends to a bounded buffer (the
oldest records are dropped, and counted, if storage stays down long enough to fill it); a
daemon thread makes the puts, each retried under one tenacity policy with a deadline, on
fsspec backends that time out their own calls (s3fs: 5 s to connect, 15 s to read). A chunk
that cannot be put before the deadline is kept and tried again at the next flush under the
same name (a put that did land is overwritten with the same bytes).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

logger = logging.getLogger(__name__)

SUFFIX: Final = ".jsonl"
DEFAULT_FLUSH_INTERVAL_S: Final = 0.5
DEFAULT_ROLLUP: Final = 120
DEFAULT_MAX_BUFFERED: Final = 200_000
#: How long one put (or delete) is retried before the records wait for the next flush.
PUT_RETRY_DEADLINE_S: Final = 10.0
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_.-]+")
_CHUNK: Final = re.compile(r"c(\d{10})\.jsonl")
_SEGMENT: Final = re.compile(r"s(\d{10})-(\d{10})\.jsonl")
#: Errors that retrying cannot fix (missing bucket, denied, bad credentials).
_PERMANENT: Final = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError)
_PERMANENT_NAMES: Final = frozenset({"NoCredentialsError", "PartialCredentialsError",
                                     "SSLError"})


def safe_name(text: str) -> str:
    """``text`` as one path component (job ids may contain ``/``)."""
    return _UNSAFE.sub("_", text) or "_"


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` names remote storage (a URL other than ``file://``)."""
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, _PERMANENT) or type(exc).__name__ in _PERMANENT_NAMES:
        return False
    return isinstance(exc, Exception)


def put_retry(deadline_s: float = PUT_RETRY_DEADLINE_S) -> Retrying:
    """The retry policy of every storage call of the event log."""
    return Retrying(stop=stop_after_delay(deadline_s),
                    wait=wait_exponential(multiplier=0.1, max=2.0),
                    retry=retry_if_exception(_transient), reraise=True)


def filesystem(location: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """``(fs, root)`` of ``location`` (fsspec; the backend is imported on first use)."""
    from fsspec.core import url_to_fs

    return url_to_fs(location, **dict(storage_options or {}))


def writer_name() -> str:
    """A writer id unique to this process incarnation."""
    return f"{safe_name(socket.gethostname())}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


class ChunkWriter:
    """Writes one writer's records under ``{root}/{job}/{writer}/`` (module doc).

    An event sink (:class:`elastic.eventlog.EventSink`): only durable records are written.

    Args:
        location: The events URL (``--events-dir``), e.g. ``s3://bucket/job-42/events``.
        job: The job id.
        storage_options: fsspec options (endpoint, credentials); fsspec also reads
            ``FSSPEC_S3_ENDPOINT_URL`` and the like from the environment.
        flush_interval_s: Longest time a record waits in memory while storage is up.
        rollup: Chunks per segment.
        max_buffered: Records kept in memory while storage is down.
        retry_deadline_s: How long one put is retried.

    Raises:
        ValueError, ImportError: the URL's scheme has no (installed) fsspec backend.
    """

    def __init__(
        self, location: str, job: str, *, storage_options: Mapping[str, Any] | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S, rollup: int = DEFAULT_ROLLUP,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        retry_deadline_s: float = PUT_RETRY_DEADLINE_S,
    ) -> None:
        self._fs, root = filesystem(location, storage_options)
        self.location = location
        self.writer = writer_name()
        self.directory = f"{root.rstrip('/')}/{safe_name(job)}/{self.writer}"
        self._interval = flush_interval_s
        self._rollup = max(1, rollup)
        self._retry_deadline_s = retry_deadline_s
        self._lines: collections.deque[str] = collections.deque(maxlen=max(1, max_buffered))
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._written = 0  # records accepted so far
        self._durable = 0  # records known to be in storage
        self._seq = 0
        self._pending: tuple[int, bytes, int] | None = None
        self._segment: list[tuple[int, bytes]] = []
        self._warned = False
        #: Records dropped (buffer overflow while storage was down, or a permanent error).
        self.dropped = 0
        #: Set on a permanent storage error (logged once): nothing is written any more.
        self.failed = False
        #: Objects put so far (chunks and segments).
        self.puts = 0
        if "file" in getattr(self._fs, "protocol", ()):
            self._fs.makedirs(self.directory, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="event-log-writer", daemon=True)
        self._thread.start()

    @property
    def enabled(self) -> bool:
        """Whether records are still written."""
        return not self.failed

    #: Records that are not durable never reach the log.
    takes_live: Final = False

    def write(self, record: Mapping[str, Any], durable: bool) -> None:
        """Buffers a durable record (never blocks on storage)."""
        self.write_many(((record, durable),))

    def write_many(self, items: Iterable[tuple[Mapping[str, Any], bool]]) -> None:
        """Buffers the durable records of ``items``, oldest first, under one lock."""
        if self.failed:
            return
        lines = [json.dumps(record, default=str) for record, durable in items if durable]
        if not lines:
            return
        with self._cond:
            for line in lines:
                if len(self._lines) == self._lines.maxlen:
                    self.dropped += 1
                self._lines.append(line)
            self._written += len(lines)

    def flush(self, timeout: float) -> bool:
        """Puts everything written so far; True if it is in storage within ``timeout`` s."""
        with self._cond:
            target = self._written
            self._wake.set()
            return self._cond.wait_for(
                lambda: self._durable >= target or self.failed or not self._thread.is_alive(),
                timeout) and self._durable >= target

    def close(self, timeout: float) -> None:
        """Flushes (waiting up to ``timeout`` s) and stops the writer thread."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            stopping = self._stop.is_set()
            try:
                self._flush_once()
            except Exception:  # a bug here must not end the thread silently
                logger.exception("The event log writer failed to flush; it keeps trying.")
            if stopping:
                with self._cond:
                    if self._pending is None and not self._lines:
                        return
                    if self.failed:
                        return
                # Storage is down at exit: keep trying until close()'s caller stops waiting.
                self._stop.wait(0.2)

    def _flush_once(self) -> None:
        with self._cond:
            if self._pending is None and self._lines and not self.failed:
                data = ("\n".join(self._lines) + "\n").encode()
                self._lines.clear()
                self._pending = (self._seq, data, self._written)
                self._seq += 1
            pending = self._pending
        if pending is None:
            return
        seq, data, upto = pending
        try:
            self._put(f"c{seq:010d}{SUFFIX}", data)
        except Exception as exc:
            self._failed_put(exc)
            return
        if self._warned:
            logger.warning("The event log at %s is writable again.", self.location)
            self._warned = False
        with self._cond:
            self._pending = None
            self._durable = upto
            self._cond.notify_all()
        self._segment.append((seq, data))
        if len(self._segment) >= self._rollup:
            self._roll_up()

    def _put(self, name: str, data: bytes) -> None:
        for attempt in put_retry(self._retry_deadline_s):
            with attempt:
                self._fs.pipe_file(f"{self.directory}/{name}", data)
        self.puts += 1

    def _failed_put(self, exc: Exception) -> None:
        if not _transient(exc):
            with self._cond:
                self.failed = True
                self.dropped += len(self._lines) + (1 if self._pending else 0)
                self._lines.clear()
                self._pending = None
                self._cond.notify_all()
            logger.error("Cannot write the event log at %s (%s: %s); events are off for this "
                         "process.", self.location, type(exc).__name__, exc)
            return
        if not self._warned:
            self._warned = True
            logger.warning("Cannot write the event log at %s for now (%s: %s); its records "
                           "are kept in memory and put again.", self.location,
                           type(exc).__name__, exc)

    def _roll_up(self) -> None:
        first, last = self._segment[0][0], self._segment[-1][0]
        try:
            self._put(f"s{first:010d}-{last:010d}{SUFFIX}",
                      b"".join(data for _, data in self._segment))
        except Exception as exc:  # the chunks stay and are read as they are
            logger.debug("Event log roll-up %d-%d failed (%s); trying later.", first, last, exc)
            return
        chunks = [f"{self.directory}/c{seq:010d}{SUFFIX}" for seq, _ in self._segment]
        self._segment.clear()
        try:
            for attempt in put_retry(self._retry_deadline_s):
                with attempt:
                    self._fs.rm(chunks)
        except Exception as exc:  # the segment covers them: readers skip them anyway
            logger.debug("Could not delete rolled-up event log chunks (%s).", exc)


@dataclass(frozen=True, slots=True)
class _Listing:
    legacy: list[str]
    chunked: list[str]


def _select(fs: Any, root: str) -> _Listing:
    """The objects to read under ``root``: flat per-process files and, per writer, every
    segment plus the chunks that no segment covers."""
    root = root.rstrip("/")
    legacy: list[str] = []
    segments: dict[str, list[tuple[int, int, str]]] = collections.defaultdict(list)
    chunks: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for path in fs.find(root, maxdepth=3):
        rel = path[len(root):].lstrip("/") if path.startswith(root) else path
        parts = rel.split("/")
        if len(parts) == 1 and parts[0].endswith(SUFFIX):
            legacy.append(path)
        elif len(parts) == 3:
            writer = f"{parts[0]}/{parts[1]}"
            if m := _SEGMENT.fullmatch(parts[2]):
                segments[writer].append((int(m[1]), int(m[2]), path))
            elif m := _CHUNK.fullmatch(parts[2]):
                chunks[writer].append((int(m[1]), path))
    chunked: list[str] = []
    for writer in sorted(set(segments) | set(chunks)):
        covered = segments.get(writer, [])
        chunked += [p for _, _, p in sorted(covered)]
        chunked += [p for seq, p in sorted(chunks.get(writer, []))
                    if not any(a <= seq <= b for a, b, _ in covered)]
    return _Listing(sorted(legacy), chunked)


def read_texts(location: str | os.PathLike[str],
               storage_options: Mapping[str, Any] | None = None) -> Iterator[tuple[str, str]]:
    """``(path, text)`` of every event object under ``location``, in either layout.

    An object deleted between the listing and the read (a writer rolled it up) makes the
    listing start again, up to three times.
    """
    fs, root = filesystem(os.fspath(location), storage_options)
    for attempt in range(3):
        fs.invalidate_cache()  # fsspec caches listings per instance: a log keeps growing
        listing = _select(fs, root)
        paths = listing.legacy + listing.chunked
        if not paths:
            return
        try:
            contents = fs.cat(paths, on_error="omit")
        except FileNotFoundError:
            contents = {}
        if not isinstance(contents, dict):  # one path: fsspec returns its bytes
            contents = {paths[0]: contents}
        missing = [p for p in listing.chunked if p not in contents]
        if missing and attempt < 2:
            continue
        for path in paths:
            data = contents.get(path)
            if data is None:
                if path in listing.legacy:
                    logger.warning("Skipping the unreadable event log %s.", path)
                continue
            yield path, data.decode("utf-8", errors="replace")
        return
