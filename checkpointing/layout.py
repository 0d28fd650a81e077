"""On-storage layout: attempt directory names, the commit record and the ``latest`` pointer.

A checkpoint attempt lives in ``<root>/step-{step:010d}_r{round:04d}/``. It is valid only when
its ``COMMIT.json`` exists, is parseable, and every file it lists has the recorded size and
CRC32. ``<root>/latest.json`` is a hint written after the commit record; readers confirm it.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from checkpointing.errors import CheckpointCorruptError, CheckpointFormatError

FORMAT_VERSION = 1
COMMIT_FILE = "COMMIT.json"
LATEST_FILE = "latest.json"

_DIR_RE = re.compile(r"^step-(\d{10})_r(\d{4})$")


def format_dir_name(step: int, round: int) -> str:
    """Return the attempt directory name for ``step`` and rendezvous ``round``.

    Args:
        step: Training step, ``0 <= step < 10**10``.
        round: Rendezvous round, ``0 <= round < 10**4``.

    Raises:
        ValueError: If a value is out of range.
    """
    if not 0 <= step < 10**10:
        raise ValueError(f"Checkpoint step ({step}) must be between 0 and 9999999999.")
    if not 0 <= round < 10**4:
        raise ValueError(f"Checkpoint round ({round}) must be between 0 and 9999.")
    return f"step-{step:010d}_r{round:04d}"


def parse_dir_name(name: str) -> tuple[int, int] | None:
    """Return ``(step, round)`` for an attempt directory name, or ``None`` for anything else."""
    match = _DIR_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def crc32(data: bytes) -> int:
    """Return the unsigned CRC32 of ``data``."""
    return zlib.crc32(data) & 0xFFFFFFFF


@dataclass(kw_only=True, slots=True, frozen=True)
class FileEntry:
    """Size and CRC32 of one file of a checkpoint."""

    size: int
    crc32: int

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"File size ({self.size}) must not be negative.")


@dataclass(kw_only=True, slots=True, frozen=True)
class CommitRecord:
    """The commit record (``COMMIT.json``) that makes a checkpoint attempt valid."""

    format_version: int = FORMAT_VERSION
    step: int
    round: int
    world_size: int
    run_id: str
    created_at: float
    files: dict[str, FileEntry]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"Commit world_size ({self.world_size}) must be at least 1.")

    def to_json(self) -> bytes:
        """Serialise to UTF-8 JSON."""
        doc = {
            "format_version": self.format_version,
            "step": self.step,
            "round": self.round,
            "world_size": self.world_size,
            "run_id": self.run_id,
            "created_at": self.created_at,
            "files": {
                k: {"size": v.size, "crc32": v.crc32} for k, v in sorted(self.files.items())
            },
            "metadata": self.metadata,
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> CommitRecord:
        """Parse a commit record.

        Args:
            data: The bytes of ``COMMIT.json``.
            where: Its path, for error messages.

        Raises:
            CheckpointFormatError: If the format version is not supported.
            CheckpointCorruptError: If the record cannot be parsed.
        """
        try:
            doc = json.loads(data)
            version = doc["format_version"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(
                f"Commit record ({where}) is not valid JSON with a format_version; "
                "the checkpoint is damaged, load another one."
            ) from exc
        if version != FORMAT_VERSION:
            raise CheckpointFormatError(
                f"Commit record ({where}) has format version ({version}) but this code reads "
                f"version ({FORMAT_VERSION}); load it with a matching elastic-run release."
            )
        try:
            files = {
                str(k): FileEntry(size=int(v["size"]), crc32=int(v["crc32"]))
                for k, v in doc["files"].items()
            }
            return cls(
                format_version=version,
                step=int(doc["step"]),
                round=int(doc["round"]),
                world_size=int(doc["world_size"]),
                run_id=str(doc["run_id"]),
                created_at=float(doc["created_at"]),
                files=files,
                metadata=dict(doc.get("metadata") or {}),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointCorruptError(
                f"Commit record ({where}) is missing or has malformed fields ({exc}); "
                "the checkpoint is damaged, load another one."
            ) from exc


def format_latest(step: int, dir_name: str) -> bytes:
    """Serialise the ``latest.json`` pointer."""
    return json.dumps({"step": step, "dir": dir_name}).encode()


def parse_latest(data: bytes) -> tuple[int, str] | None:
    """Parse ``latest.json``; return ``(step, dir)`` or ``None`` if it is unusable."""
    try:
        doc = json.loads(data)
        step, name = int(doc["step"]), str(doc["dir"])
    except (ValueError, KeyError, TypeError):
        return None
    if parse_dir_name(name) is None:
        return None
    return step, name
