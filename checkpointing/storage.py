"""A thin fsspec layer: resolve a URL once, then write/read/list with retries and clear errors.

Backends (s3fs, gcsfs, ...) are imported lazily by fsspec when their scheme is first used.
Transient failures (connection resets, 5xx, throttling surface as ``OSError``/``ConnectionError``/
``TimeoutError``) are retried by one tenacity policy with a deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import fsspec
from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from checkpointing.errors import CheckpointError, CheckpointNotFoundError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Deadline of the storage retry policy, in seconds.
STORAGE_RETRY_DEADLINE_S = 30.0

_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, (OSError, ConnectionError, TimeoutError)) and not isinstance(
        exc, _PERMANENT
    )


def _retrying() -> Retrying:
    """The one retry policy of the storage I/O boundary."""
    return Retrying(
        stop=stop_after_delay(STORAGE_RETRY_DEADLINE_S),
        wait=wait_exponential(multiplier=0.1, max=5.0),
        retry=retry_if_exception(_is_transient),
        before_sleep=before_sleep_log(logger, logging.WARNING),
        reraise=True,
    )


def _is_credentials_error(exc: BaseException) -> bool:
    name = type(exc).__name__
    text = str(exc)
    return name in {"NoCredentialsError", "PartialCredentialsError"} or (
        "credentials" in text.lower() and "unable to locate" in text.lower()
    )


class Storage:
    """One checkpoint root on an fsspec filesystem.

    Args:
        url: A local path, ``file://...``, ``s3://bucket/prefix`` or any fsspec URL.
        storage_options: Passed to the fsspec filesystem (endpoint, credentials, ...).

    Raises:
        ValueError: If the URL's scheme has no fsspec implementation.
        CheckpointError: If the URL names a file, or the backend cannot be imported.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = str(url)
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        try:
            fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
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
        self.root: str = str(root).rstrip("/") or "/"
        self.is_local = "file" in _protocols(fs)

    def path(self, *parts: str) -> str:
        """Join ``parts`` under the root."""
        return "/".join([self.root, *parts])

    def url_of(self, *parts: str) -> str:
        """Full URL (with protocol) of ``parts`` under the root, for DCP's fsspec writer."""
        p = self.path(*parts)
        if self.is_local:
            return p
        return str(self.fs.unstrip_protocol(p))

    def call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` under the retry policy, mapping permanent errors to clear ones."""
        try:
            return _retrying()(fn)
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

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a whole object, retrying transient errors until the deadline."""
        if self.is_local:
            parent = path.rsplit("/", 1)[0]
            self.call(path, lambda: self.fs.makedirs(parent, exist_ok=True))
        self.call(path, lambda: self.fs.pipe_file(path, data))

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


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
