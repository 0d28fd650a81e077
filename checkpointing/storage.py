"""A thin fsspec layer: resolve a URL once, then write/read/list with retries and clear errors.

Backends (s3fs, gcsfs, ...) are imported lazily by fsspec when their scheme is first used.
Transient failures are retried by one tenacity policy with a deadline: ``OSError``,
``ConnectionError`` and ``TimeoutError`` (s3fs turns 5xx and throttling answers into
``OSError``), and the transport errors botocore and aiohttp raise on their own classes
(connection refused or reset, read timeouts). Permanent ones (missing, denied, disk full) are
not retried.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import fsspec
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from checkpointing.errors import CheckpointError, CheckpointNotFoundError
from checkpointing.remote_buffers import BufferBody

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Default deadline of the storage retry policy, in seconds.
STORAGE_RETRY_DEADLINE_S = 30.0

_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)
# Local-disk conditions that waiting does not fix.
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.ENAMETOOLONG, errno.EINVAL}
_PERMANENT_NAMES = {"SSLError", "NoCredentialsError", "PartialCredentialsError"}


@functools.cache
def _transport_errors() -> tuple[type[BaseException], ...]:
    """botocore's and aiohttp's connection-level errors, which are not ``OSError``s."""
    found: list[type[BaseException]] = []
    try:
        from botocore import exceptions as boto
    except ImportError:
        pass
    else:
        # HTTPClientError: resets, read timeouts; ConnectionError: refused, connect timeouts.
        found += [boto.HTTPClientError, boto.ConnectionError]
    try:
        import aiohttp
    except ImportError:
        pass
    else:
        found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    return tuple(found)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the storage call that raised ``exc`` can succeed."""
    if isinstance(exc, CheckpointError) or type(exc).__name__ in _PERMANENT_NAMES:
        return False
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return False
    return isinstance(exc, (OSError, ConnectionError, TimeoutError, *_transport_errors()))


def _is_credentials_error(exc: BaseException) -> bool:
    name = type(exc).__name__
    text = str(exc)
    return name in {"NoCredentialsError", "PartialCredentialsError"} or (
        "credentials" in text.lower() and "unable to locate" in text.lower()
    )


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new, renamed files) durable; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; their renames are durable anyway
    finally:
        os.close(fd)


class Storage:
    """One checkpoint root on an fsspec filesystem.

    Args:
        url: A local path, ``file://...``, ``s3://bucket/prefix`` or any fsspec URL.
        storage_options: Passed to the fsspec filesystem (endpoint, credentials, ...).
        retry_deadline_s: How long transient errors of one call are retried, in seconds.

    Attributes:
        retries: How many times a call was retried so far (a health metric).

    Raises:
        ValueError: If the URL's scheme has no fsspec implementation.
        CheckpointError: If the URL names a file, or the backend cannot be imported.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry_deadline_s: float = STORAGE_RETRY_DEADLINE_S,
    ) -> None:
        if not retry_deadline_s > 0:
            raise ValueError(
                f"Storage retry deadline ({retry_deadline_s}) must be a positive number of "
                f"seconds; pass e.g. retry_deadline_s={STORAGE_RETRY_DEADLINE_S}."
            )
        self.url = str(url)
        self.retry_deadline_s = float(retry_deadline_s)
        self.retries = 0
        self._retries_lock = threading.Lock()
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        try:
            options = _own_options(self.url, self.storage_options)
            fs, root = fsspec.core.url_to_fs(self.url, **options)
        except ValueError as exc:
            raise CheckpointError(
                f"Checkpoint URL ({self.url}) has a scheme fsspec does not know ({exc}); "
                "use a local path, file://, s3:// or another installed fsspec protocol."
            ) from exc
        except ImportError as exc:
            raise CheckpointError(
                f"Checkpoint URL ({self.url}) needs a storage backend that is not installed "
                f"({exc}); install it (for s3:// that is s3fs)."
            ) from exc
        self.fs: Any = fs
        if _S3 & set(_protocols(fs)):
            # s3fs's own retry loop (5 tries) would nest around botocore's (5 attempts) and
            # multiply every read timeout by 25, far past this policy's deadline. This
            # instance is ours alone (skip_instance_cache), so readers built from the same
            # options keep s3fs's retries.
            fs.retries = 1
        self.root: str = str(root).rstrip("/") or "/"
        self.is_local = "file" in _protocols(fs)
        # s3fs hands a put's body to botocore as is, and botocore takes file objects.
        self._streams_file_bodies = bool(_S3 & set(_protocols(fs)))

    def path(self, *parts: str) -> str:
        """Join ``parts`` under the root."""
        return "/".join([self.root, *parts])

    def url_of(self, *parts: str) -> str:
        """Full URL (with protocol) of ``parts`` under the root, for DCP's fsspec writer."""
        p = self.path(*parts)
        if self.is_local:
            return p
        return str(self.fs.unstrip_protocol(p))

    def _retrying(self, what: str) -> Retrying:
        """The one retry policy of the storage I/O boundary."""

        def before_sleep(state: RetryCallState) -> None:
            with self._retries_lock:
                self.retries += 1
            exc = state.outcome.exception() if state.outcome is not None else None
            logger.warning(
                "storage.retry %s under %s (attempt %d, %.1f s of %.0f s): %s: %s",
                what, self.url, state.attempt_number, state.seconds_since_start,
                self.retry_deadline_s, type(exc).__name__, exc,
            )

        return Retrying(
            stop=stop_after_delay(self.retry_deadline_s),
            wait=wait_exponential(multiplier=0.1, max=5.0),
            retry=retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )

    def call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` under the retry policy, mapping permanent errors to clear ones.

        Args:
            what: The path or object the call works on, for logs and error messages.
            fn: The call; it must be safe to repeat.

        Raises:
            CheckpointError: A permanent failure, in one sentence naming the value.
            Exception: The last transient error once the deadline has passed.
        """
        try:
            return self._retrying(what)(fn)
        except Exception as exc:
            raise self._translate(what, exc) from exc

    def _translate(self, what: str, exc: Exception) -> Exception:
        if isinstance(exc, CheckpointError):
            return exc
        if _is_credentials_error(exc):
            return CheckpointError(
                f"Storage credentials for ({self.url}) are missing ({exc}); set them in "
                "storage_options or the environment (for S3: AWS_ACCESS_KEY_ID/SECRET)."
            )
        if isinstance(exc, FileNotFoundError):
            return CheckpointNotFoundError(
                f"Storage path ({what}) under ({self.url}) does not exist ({exc}); check the "
                "bucket and prefix, and create the bucket first."
            )
        if isinstance(exc, PermissionError):
            return CheckpointError(
                f"Access to ({what}) under ({self.url}) was denied ({exc}); check credentials "
                "and permissions."
            )
        return exc

    def check_root(self) -> None:
        """Fail early with one clear sentence if the root cannot hold checkpoints.

        Raises:
            CheckpointError: The root is an existing file, or credentials are missing.
            CheckpointNotFoundError: The bucket does not exist.
        """
        try:
            if _BUCKETED & set(_protocols(self.fs)):
                bucket = self.root.split("/", 1)[0]
                try:
                    # info() raises the backend's real error; exists() swallows credentials ones.
                    self.fs.info(bucket)
                except FileNotFoundError:
                    raise CheckpointNotFoundError(
                        f"Bucket ({bucket}) of checkpoint URL ({self.url}) does not exist; "
                        "create it or fix the URL."
                    ) from None
            if self.fs.isfile(self.root):
                raise CheckpointError(
                    f"Checkpoint URL ({self.url}) is a file, not a directory; "
                    "pass a directory or prefix instead."
                )
            if self.is_local:
                self.fs.makedirs(self.root, exist_ok=True)
        except CheckpointError:
            raise
        except Exception as exc:
            translated = self._translate(self.root, exc)
            if translated is exc:
                raise CheckpointError(
                    f"Checkpoint storage ({self.url}) cannot be reached ({exc}); "
                    "check the URL, endpoint and network."
                ) from exc
            raise translated from exc

    def write_bytes(self, path: str, data: bytes | bytearray) -> None:
        """Write a whole object durably and atomically, retrying transient errors.

        On local disk the bytes go to a temporary file that is fsynced and then renamed over
        ``path`` (and the directory fsynced), so a crash leaves the old or the new content,
        never a torn one. Object stores make a completed put durable and atomic by themselves.
        """
        if self.is_local:
            self.call(path, lambda: _write_local_atomic(path, data))
        else:
            self.call(path, lambda: self.fs.pipe_file(path, data))

    def write_buffer(self, path: str, data: memoryview) -> None:
        """Like :meth:`write_bytes`, without copying ``data`` whole where the backend allows.

        s3fs is handed a :class:`~checkpointing.remote_buffers.BufferBody` over the bytes (a
        fresh one per try, so a retry starts from the first byte); local disk and other object
        stores get a ``bytes`` copy, which every fsspec backend accepts.
        """
        if not self._streams_file_bodies:
            self.write_bytes(path, bytes(data))
            return

        def put() -> None:
            body = BufferBody(data)
            try:
                self.fs.pipe_file(path, body)
            finally:
                body.close()

        self.call(path, put)

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` (on object stores a copy and a delete), retrying."""

        def move() -> None:
            try:
                self.fs.mv(src, dst)
            except FileNotFoundError:
                # A retried move whose first try did land: the source is gone, dst is there.
                self.fs.invalidate_cache(dst)
                if not self.fs.exists(dst):
                    raise
            if self.is_local:
                fsync_dir(os.path.dirname(dst))

        self.call(src, move)

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents (object stores have no directories: a no-op)."""
        self.call(path, lambda: self.fs.makedirs(path, exist_ok=True))

    def remove_file(self, path: str) -> None:
        """Delete one file."""
        self.call(path, lambda: self.fs.rm_file(path))

    def read_bytes(self, path: str) -> bytes:
        """Read a whole object, retrying transient errors until the deadline."""
        return bytes(self.call(path, lambda: self.fs.cat_file(path)))

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return bool(self.call(path, lambda: self.fs.exists(path)))

    def list_names(self, path: str) -> list[str]:
        """Base names of the entries directly under ``path`` (empty when it is missing)."""
        self.fs.invalidate_cache(path)
        try:
            entries = self.call(path, lambda: self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def list_files(self, path: str) -> dict[str, int]:
        """Relative path -> size of every file below ``path``."""
        self.fs.invalidate_cache(path)
        found = self.call(path, lambda: self.fs.find(path, detail=True))
        prefix = path.rstrip("/") + "/"
        out: dict[str, int] = {}
        for name, info in found.items():
            if info.get("type") == "directory":
                continue
            rel = str(name)[len(prefix):] if str(name).startswith(prefix) else str(name)
            out[rel] = int(info["size"])
        return out

    def remove_tree(self, path: str) -> None:
        """Delete ``path`` recursively."""
        self.call(path, lambda: self.fs.rm(path, recursive=True))


_BUCKETED = {"s3", "s3a", "gs", "gcs", "az", "abfs", "adl"}
_S3 = {"s3", "s3a"}
#: botocore settings for our own S3 client unless the caller sets them: bounded waits, and no
#: retries below ours, so one storage call takes about ``read_timeout`` per attempt and the
#: tenacity deadline is what bounds an outage.
S3_CONFIG_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 15,
    "retries": {"total_max_attempts": 1},
}


def _own_options(url: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """fsspec options for this Storage's private filesystem instance."""
    out = dict(options)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in _S3:
        config = dict(S3_CONFIG_DEFAULTS)
        config.update(out.get("config_kwargs") or {})
        out["config_kwargs"] = config
        out["skip_instance_cache"] = True
    return out


def _write_local_atomic(path: str, data: bytes | bytearray) -> None:
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(parent)


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
