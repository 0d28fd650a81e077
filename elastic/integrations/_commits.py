"""Commit markers: which of a framework's checkpoints are complete.

A framework writes its checkpoint (Lightning: one ``.ckpt`` file; Hugging Face: a
``checkpoint-N`` directory) with no sign of when it is done, and its own "latest checkpoint"
lookups take whatever is there, a half-written one included. The integrations therefore
*commit* each checkpoint once every rank has written its part: global rank 0 makes the files
durable (fsync on local disk; an object store's completed put already is), then writes a small
JSON marker, atomically and last::

    DIR/.elastic-commits/NAME.json
    {"format": "elastic-run/commit/1", "name": NAME, "step": 40, "files": {"rel/path": size, ...},
     "meta": {...}, "time": 1717171717.2}

A checkpoint counts as committed only while its marker parses and every file it lists is
there with the listed size, so one deleted or cut short after its commit (a rotation, a
crash while it was being rewritten) no longer counts. Before a checkpoint of the same name
is written again, its marker is removed first.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from checkpointing.storage import Storage, fsync_dir

__all__ = ["MARKER_DIR", "CommitLog", "Committed"]

logger = logging.getLogger(__name__)

MARKER_DIR: Final = ".elastic-commits"
FORMAT: Final = "elastic-run/commit/1"


@dataclass(frozen=True, slots=True)
class Committed:
    """One committed checkpoint.

    Attributes:
        name: Its file or directory name in the checkpoint directory.
        step: The optimizer steps it holds.
        path: Its full path (or URL).
        meta: What the integration recorded with it (global batch, data order, world).
    """

    name: str
    step: int
    path: str
    meta: Mapping[str, Any]


class CommitLog:
    """The commit markers of the checkpoints in one directory (a local path or fsspec URL).

    Args:
        directory: Where the framework writes its checkpoints.
        storage_options: fsspec options for a URL.
    """

    def __init__(self, directory: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage = Storage(directory, storage_options)
        self.directory = directory

    def path_of(self, name: str) -> str:
        """The full path (or URL) of checkpoint ``name``."""
        if self.storage.is_local:
            return self.storage.path(name)
        return str(self.storage.url_of(name))

    def _marker(self, name: str) -> str:
        return self.storage.path(MARKER_DIR, f"{name}.json")

    # -- writing (global rank 0) --------------------------------------------------------------

    def invalidate(self, name: str) -> None:
        """Removes ``name``'s marker before the checkpoint is written again (if it has one)."""
        marker = self._marker(name)
        if self.storage.exists(marker):
            self.storage.remove_file(marker)

    def commit(self, name: str, step: int, meta: Mapping[str, Any]) -> Committed:
        """Makes checkpoint ``name`` durable and writes its marker (last).

        Raises:
            FileNotFoundError: If the checkpoint is not there.
        """
        files = self._files(name)
        if not files:
            raise FileNotFoundError(f"checkpoint {self.path_of(name)} has no files to commit")
        if self.storage.is_local:
            _fsync_tree(self.storage.path(name))
        record = {"format": FORMAT, "name": name, "step": int(step), "files": files,
                  "meta": dict(meta), "time": round(time.time(), 3)}
        self.storage.makedirs(self.storage.path(MARKER_DIR))
        self.storage.write_bytes(self._marker(name), json.dumps(record, sort_keys=True).encode())
        return Committed(name, int(step), self.path_of(name), dict(meta))

    def remove(self, name: str) -> None:
        """Deletes a checkpoint: its marker first, so that it never counts half deleted."""
        self.invalidate(name)
        path = self.storage.path(name)
        if self.storage.exists(path):
            self.storage.remove_tree(path)

    def forget_missing(self) -> None:
        """Removes the markers of checkpoints that are gone (a framework's own rotation
        deletes old checkpoints without knowing of their markers)."""
        for marker_name in self.storage.list_names(self.storage.path(MARKER_DIR)):
            name = marker_name.removesuffix(".json")
            if marker_name.endswith(".json") and not self.storage.exists(self.storage.path(name)):
                self.storage.remove_file(self._marker(name))

    # -- reading ----------------------------------------------------------------------------

    def committed(self) -> list[Committed]:
        """Every committed checkpoint whose files are all there, oldest step first."""
        out = []
        for marker_name in self.storage.list_names(self.storage.path(MARKER_DIR)):
            if not marker_name.endswith(".json"):
                continue
            found = self._verified(marker_name.removesuffix(".json"))
            if found is not None:
                out.append(found)
        return sorted(out, key=lambda c: (c.step, c.name))

    def newest(self) -> Committed | None:
        """The committed checkpoint of the highest step, or ``None``."""
        found = self.committed()
        return found[-1] if found else None

    def _verified(self, name: str) -> Committed | None:
        try:
            record = json.loads(self.storage.read_bytes(self._marker(name)))
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the commit marker of %s (%s)", name, exc)
            return None
        if (not isinstance(record, dict) or record.get("format") != FORMAT
                or record.get("name") != name or not isinstance(record.get("files"), dict)
                or not isinstance(record.get("step"), int)):
            logger.warning("ignoring the commit marker of %s: not one elastic-run wrote", name)
            return None
        try:
            present = self._files(name)
        except OSError:
            present = {}
        expected = {str(k): int(v) for k, v in record["files"].items()}
        if any(present.get(rel) != size for rel, size in expected.items()):
            logger.warning("checkpoint %s was committed but its files are no longer complete; "
                           "not resuming from it", self.path_of(name))
            return None
        meta = record.get("meta")
        return Committed(name, int(record["step"]), self.path_of(name),
                         meta if isinstance(meta, dict) else {})

    def _files(self, name: str) -> dict[str, int]:
        """Relative path -> size of checkpoint ``name``'s files (``""`` for a single file)."""
        path = self.storage.path(name)
        if not self.storage.exists(path):
            return {}
        fs = self.storage.fs
        if fs.isfile(path):
            return {"": int(fs.size(path))}
        return self.storage.list_files(path)


def _fsync_tree(path: str) -> None:
    """fsyncs a local file, or every file below a local directory (and the directories)."""
    if os.path.isfile(path):
        _fsync_file(path)
        fsync_dir(os.path.dirname(path) or ".")
        return
    for parent, _dirs, names in os.walk(path):
        for name in names:
            _fsync_file(os.path.join(parent, name))
        fsync_dir(parent)
    fsync_dir(os.path.dirname(path.rstrip("/")) or ".")


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
