"""The checkpoint manager: stage on the training thread, persist + commit in the background.

Save protocol (ARCHITECTURE.md 4.6): every rank stages its state into reusable host buffers,
then a daemon I/O thread runs ``torch.distributed.checkpoint.save`` into a fresh attempt
directory ``step-{step:010d}_r{round:04d}`` through :class:`~checkpointing.shard_io.ShardWriter`
(retried, checksummed as written, fsynced). When DCP returns, every shard and ``.metadata`` are
durable; the coordinator gathers each rank's sizes and CRC32s, checks them against a listing,
writes ``COMMIT.json`` last and then ``latest.json``, and applies retention. A directory without
a valid commit record is never loaded.

Each rank records ``checkpoint_committed`` (with the save's durable time) or
``checkpoint_failed`` in the job event log (:mod:`elastic.eventlog`; the group's rank 0's are
kept in the log, every rank's reach its node agent's metrics).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from checkpointing.errors import (
    CheckpointCommitError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
)
from checkpointing.layout import (
    COMMIT_FILE,
    LATEST_FILE,
    CommitRecord,
    FileEntry,
    crc32,
    format_dir_name,
    format_latest,
    parse_dir_name,
    parse_latest,
)
from checkpointing.memory_tier import MemoryReader, MemoryTier
from checkpointing.remote_buffers import BufferPool
from checkpointing.retention import plan_retention
from checkpointing.shard_io import ShardWriter
from checkpointing.staging import HostStager, StagedCopy
from checkpointing.storage import STORAGE_RETRY_DEADLINE_S, Storage, is_transient
from torch_private import FsspecReader

logger = logging.getLogger(__name__)


class AsyncMode(str, enum.Enum):
    """How :meth:`CheckpointManager.save` persists."""

    DISABLED = "disabled"
    ASYNC = "async"


class EventRecorder(Protocol):
    """Takes the manager's events (``elastic.eventlog.EventLog`` is one)."""

    def record(self, event: str, *, round: int | None = None, durable: bool = True,
               **fields: Any) -> None:
        """Records one event (never raises)."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint."""

    step: int
    path: str
    world_size: int
    round: int
    created_at: float
    format_version: int
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SaveHandle:
    """Futures of one save: ``staged`` (host copy done) and ``committed`` (durable + committed).

    ``copy`` is the host copy itself (``None`` from stand-ins): with ``overlap=True`` the
    caller must :meth:`~checkpointing.staging.StagedCopy.hold` it before changing the state.
    """

    step: int
    staged: Future[None]
    committed: Future[CheckpointInfo]
    copy: StagedCopy | None = None


def _order(name: str) -> tuple[int, int]:
    return parse_dir_name(name) or (-1, -1)


def _root_causes(exc: BaseException) -> list[BaseException]:
    """The per-rank errors inside DCP's ``CheckpointException``, else ``[exc]``."""
    if isinstance(exc, CheckpointException):
        found = [pair[0] for pair in exc.failures.values() if isinstance(pair, tuple) and pair]
        return found or [exc]
    return [exc]


def _describe(causes: list[BaseException]) -> str:
    """One line naming each distinct cause (DCP's own text is a multi-line traceback)."""
    seen: dict[str, None] = {}
    for cause in causes:
        text = " ".join(str(cause).split())
        seen[f"{type(cause).__name__}: {text}" if text else type(cause).__name__] = None
    return "; ".join(seen)


@dataclass(frozen=True, slots=True)
class _SaveWorld:
    """The world a save was started in: every collective and record of that save uses it.

    A save runs on the I/O thread while training goes on, and an in-place reconfiguration
    rebinds the manager to the next world meanwhile. A save that read the manager's group at
    each collective instead would run its later collectives on the new world's group, paired
    with the new world's next save on the other ranks: its commit record would then list
    another save's files (same names and sizes, other CRC32s).
    """

    group: dist.ProcessGroup | None
    distributed: bool
    rank: int
    size: int
    round: int

    def global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


def _info(rec: CommitRecord, path: str) -> CheckpointInfo:
    return CheckpointInfo(
        step=rec.step,
        path=path,
        world_size=rec.world_size,
        round=rec.round,
        created_at=rec.created_at,
        format_version=rec.format_version,
        metadata=dict(rec.metadata),
    )


class CheckpointManager:
    """Asynchronous, atomic, sharded checkpoints on any fsspec URL.

    Every rank of ``process_group`` must call :meth:`save` and :meth:`load` with the same steps.

    Host memory: each rank keeps a copy of its state in staging buffers between saves and, on
    remote storage, the files it writes (its share of the state) in upload buffers, where
    each is assembled before it is put. Both are reused because freshly allocated memory
    takes longer to fill than the copy itself; :meth:`close` gives the upload buffers back.

    Args:
        url: Checkpoint root: a local path, ``file://``, ``s3://bucket/prefix``, any fsspec URL.
        keep_last: Committed checkpoints to keep (at least 1).
        async_mode: ``"async"`` (persist in the background) or ``"disabled"`` (inline).
        process_group: Group for DCP's collectives; a dedicated gloo group is best. ``None``
            creates one when ``torch.distributed`` is initialised, else runs single-process.
        storage_options: fsspec options (endpoint, credentials, ...).
        run_id: Recorded in each commit record; random when ``None``.
        round: Rendezvous round, part of each attempt directory name.
        keep_every: Keep committed steps divisible by this for good.
        retry_deadline: How long one storage call's transient errors (connection resets, 5xx,
            throttling, an outage) are retried before that save fails.
        io_threads: Shard files each rank writes in parallel; ``None``: 1 on local disk
            (one sequential stream is fastest there), 4 on remote storage.

    Raises:
        ValueError: If an argument is invalid.
        CheckpointError: If the storage location is unusable (see :class:`Storage`).
    """

    def __init__(
        self,
        url: str,
        *,
        keep_last: int = 3,
        async_mode: AsyncMode | str = AsyncMode.ASYNC,
        process_group: dist.ProcessGroup | None = None,
        storage_options: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        round: int = 0,
        keep_every: int | None = None,
        retry_deadline: timedelta = timedelta(seconds=STORAGE_RETRY_DEADLINE_S),
        io_threads: int | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last ({keep_last}) must be at least 1; pass 1 or more.")
        try:
            self.async_mode = AsyncMode(async_mode)
        except ValueError:
            raise ValueError(
                f"async_mode ({async_mode!r}) is not one of 'disabled' or 'async'."
            ) from None
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.round = round
        self.run_id = run_id or uuid.uuid4().hex
        if io_threads is not None and io_threads < 1:
            raise ValueError(f"io_threads ({io_threads}) must be at least 1 or None.")
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed and process_group is None:
            # DCP's collectives run on the I/O thread; sharing the training group would let
            # them interleave with the training thread's collectives.
            process_group = dist.new_group(backend="gloo")
        self._pg = process_group
        self._rank = dist.get_rank(self._pg) if self._distributed else 0
        self._world = dist.get_world_size(self._pg) if self._distributed else 1
        #: Copies of each committed save in the nodes' host memory, and restores from them
        #: (under elastic-run; ``None`` elsewhere): :mod:`checkpointing.memory_tier`.
        self.memory: MemoryTier | None = MemoryTier.from_env(url)
        #: Where the last :meth:`load` read the checkpoint: ``memory``, ``storage``, or
        #: ``mixed`` (memory, and storage for files whose memory copies failed their check).
        self.last_load_source: str | None = None
        self.storage = self._open_storage(url, storage_options, retry_deadline)
        self.io_threads = io_threads or (1 if self.storage.is_local else 4)
        self._stager = HostStager()
        # Remote shard files are assembled here; kept between saves like the staging buffers.
        self._upload_buffers = BufferPool()
        # The last save's files, kept for the memory tier until they are copied there.
        self._copies: dict[str, bytearray] = {}
        self._inflight: SaveHandle | None = None
        self._inflight_dir: str | None = None
        # Set when the in-flight save's job has finished, retention included.
        self._inflight_done = threading.Event()
        self._inflight_done.set()
        self._closed = False
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._run_jobs, name="checkpoint-io", daemon=True
        )
        self._thread.start()
        #: Asked right before a commit record is written (rank 0): ``False`` refuses the
        #: commit. The in-place loop sets it so that a worker cut off from its job (its
        #: node's lease not fresh, its world aborted) never commits a checkpoint.
        self.commit_fence: Callable[[], bool] | None = None
        #: Seconds the last save waited for the previous one (admission).
        self.last_blocked_s = 0.0
        #: Seconds the last save spent staging on the calling thread.
        self.last_stage_s = 0.0
        #: Where ``checkpoint_committed``/``checkpoint_failed`` events go (``None``: nowhere);
        #: ``ElasticLoop`` sets its event log here, so every rank's reach its agent's metrics
        #: and the group's rank 0's the job event log.
        self.events: EventRecorder | None = None

    def _open_storage(self, url: str, storage_options: Mapping[str, Any] | None,
                      retry_deadline: timedelta) -> Storage:
        """Opens the storage and checks its root (rank 0 alone asks the storage); a failure
        is raised by every rank of the group at once.

        Every rank must fail the same way and at the same moment: a job whose ranks all die
        of one error ends at once with it, while a rank that fails alone, or first, looks
        like a crash that restarts would cure (and in restart mode its peers are restarted
        before they can fail too).
        """
        storage: Storage | None = None
        failure: CheckpointError | None = None
        try:
            storage = Storage(url, storage_options,
                              retry_deadline_s=retry_deadline.total_seconds())
            if self._rank == 0:
                storage.check_root()
        except CheckpointError as exc:
            failure = exc
        if self._world > 1:
            mine = None if failure is None else (
                isinstance(failure, CheckpointNotFoundError), str(failure))
            everyone: list[Any] = [None] * self._world
            # Each rank's memory store travels in the same collective (one, not two).
            own = self.memory.own if self.memory is not None else None
            dist.all_gather_object(everyone, (mine, own), group=self._pg)
            if self.memory is not None:
                self.memory.bind([address for _, address in everyone])
            first = next((f for f, _ in everyone if f is not None), None)
            if failure is None and first is not None:
                not_found, message = first
                failure = (CheckpointNotFoundError if not_found else CheckpointError)(message)
        if failure is not None:
            raise failure
        assert storage is not None
        return storage

    def _record(self, event: str, saved_in: _SaveWorld | None = None, **fields: Any) -> None:
        events = self.events
        if events is not None:
            round_, rank = ((saved_in.round, saved_in.rank) if saved_in
                            else (self.round, self._rank))
            events.record(event, round=round_, durable=rank == 0, **fields)

    def _save_world(self) -> _SaveWorld:
        return _SaveWorld(self._pg, self._distributed, self._rank, self._world, self.round)

    # ----------------------------------------------------------------------------- save path
    def rebind(self, process_group: dist.ProcessGroup, round: int) -> None:
        """Moves this manager to a new world (in-place reconfiguration).

        Later saves and loads run their collectives on ``process_group``, and ``round`` names
        the directory every rank writes its shards into, so all ranks of one world must pass
        the same value (a survivor's manager was built in an older world than a newcomer's).
        A save in flight stays on the group it started on (the old world's, aborted or about
        to be) and is not committed: the new world's next save is.

        Args:
            process_group: The new world's checkpoint group (gloo).
            round: The new world's round (its epoch), shared by all of its ranks.
        """
        self.round = round
        self._distributed = True
        self._pg = process_group
        self._rank = dist.get_rank(process_group)
        self._world = dist.get_world_size(process_group)
        if self.memory is not None:
            # The peer store was the old world's next node, which may be the one that was
            # lost: copies would wait out its connect timeout on every save. In place, a
            # restart from memory is the exception (a whole job restarted), so copies go
            # to this node's own store until the next load binds the world's stores again.
            self.memory.bind([self.memory.own])

    def reserve(self, state: Mapping[str, Any]) -> int:
        """Allocates the host buffers that saving ``state`` needs, on a background thread,
        so that the first save finds them (pinning memory for a CUDA state takes about a
        second per 2 GB). Call it once the state exists (an optimizer's state appears at its
        first step).

        Returns:
            Bytes being allocated (0: every buffer exists).
        """
        return self._stager.reserve(state)

    def busy(self) -> str | None:
        """Why a :meth:`save` now would wait (``None``: it would not): the previous save is
        still being written, or the staging buffers are still being allocated."""
        previous = self._inflight
        if previous is not None and not previous.committed.done():
            return f"the save of step {previous.step} is still being written"
        if self._stager.reserving:
            return "the staging buffers are still being allocated"
        return None

    def save(
        self, step: int, state: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None,
        overlap: bool = False, after_copy: Callable[[], None] | None = None,
    ) -> SaveHandle:
        """Checkpoint ``state`` at ``step``; returns once the state is copied to host memory
        (with ``overlap``: once the copy is queued).

        Args:
            step: Training step (directory and commit record key).
            state: Tensors, nested dicts and ``Stateful`` objects.
            metadata: JSON-serialisable user metadata stored in the commit record.
            overlap: Copy CUDA tensors on a side stream and return at once; the caller must
                call ``handle.copy.hold()`` before queueing anything that writes a saved
                tensor (:mod:`checkpointing.staging`).
            after_copy: Called once the copy is complete, before anything is written; if it
                raises, the save fails with that error (the step fence's check that the
                state is the step's).

        Returns:
            A :class:`SaveHandle`; ``committed`` fails with :class:`CheckpointCommitError`
            when persisting or committing fails (training is not interrupted).
        """
        if self._closed:
            raise CheckpointError(f"CheckpointManager ({self.storage.url}) is closed.")
        world = self._save_world()
        dir_name = format_dir_name(step, world.round)
        started = time.monotonic()
        previous = self._inflight
        if previous is not None and not previous.committed.done():
            logger.info("checkpoint save at step %d waits for step %d", step, previous.step)
            try:
                previous.committed.exception()
            finally:
                self.last_blocked_s = time.monotonic() - started
                logger.info("checkpoint.blocked_ms=%.1f", self.last_blocked_s * 1e3)
        else:
            self.last_blocked_s = 0.0
        staged: Future[None] = Future()
        committed: Future[CheckpointInfo] = Future()
        t0 = time.monotonic()
        try:
            copied = self._stager.stage_async(state, overlap=overlap)
        except BaseException as exc:
            staged.set_exception(exc)
            committed.set_exception(exc)
            raise
        self.last_stage_s = time.monotonic() - t0
        host_state = copied.host_state
        handle = SaveHandle(step=step, staged=staged, committed=committed, copy=copied)
        if not copied.overlapped and after_copy is None:
            staged.set_result(None)
        self._inflight = handle
        self._inflight_dir = dir_name
        done = self._inflight_done = threading.Event()
        user_meta = dict(metadata or {})

        def job() -> None:
            try:
                persist_and_commit()
            finally:
                done.set()

        def persist_and_commit() -> None:
            try:
                if not staged.done():
                    copied.wait()  # the writer reads the buffers only once they hold the step
                    if after_copy is not None:
                        after_copy()
                    staged.set_result(None)
                info = self._persist_and_commit(step, dir_name, host_state, user_meta, world)
            except BaseException as exc:
                if not staged.done():
                    staged.set_exception(exc)
                logger.error("checkpoint.failed step=%d: %s", step, exc, exc_info=exc)
                causes = _root_causes(exc)
                if len(causes) == 1 and isinstance(causes[0], CheckpointError):
                    err: BaseException = causes[0]
                else:
                    retried = (
                        f" after storage retries for up to {self.storage.retry_deadline_s:g} s"
                        if any(is_transient(c) for c in causes) else ""
                    )
                    err = CheckpointCommitError(
                        f"Checkpoint at step ({step}) in ({self.storage.url}) was not committed"
                        f"{retried} ({_describe(causes)}); the previous checkpoint stays valid "
                        "and the next save tries again."
                    )
                    err.__cause__ = exc
                committed.set_exception(err)
                self._copies = {}  # never sent: only committed checkpoints go to memory
                self._record("checkpoint_failed", saved_in=world, step=step,
                             error=str(err).splitlines()[0][:300])
                return
            committed.set_result(info)
            self._record("checkpoint_committed", saved_in=world, step=step,
                         durable_s=round(time.monotonic() - t0, 4), world=world.size)
            self._mirror(dir_name)
            if world.rank == 0:
                self._apply_retention(in_flight=None)

        if self.async_mode is AsyncMode.ASYNC:
            self._jobs.put(job)
        else:
            job()
        return handle

    def _persist_and_commit(
        self, step: int, dir_name: str, host_state: dict[str, Any], user_meta: dict[str, Any],
        world: _SaveWorld,
    ) -> CheckpointInfo:
        t0 = time.monotonic()
        dir_path = self.storage.path(dir_name)
        writer = ShardWriter(
            self.storage, dir_path, sync=True, thread_count=self.io_threads,
            buffers=self._upload_buffers, keep_copies=self.memory is not None,
        )
        dcp_save(host_state, storage_writer=writer, process_group=world.group)
        self._copies = writer.copies()
        persist_s = time.monotonic() - t0
        # Each rank checksummed the files it wrote while writing them; the coordinator
        # gathers the entries and checks them against what the storage lists.
        entries = writer.written()
        gathered: list[dict[str, FileEntry] | None] = [entries]
        if world.distributed:
            gathered = [None] * world.size if world.rank == 0 else []
            dist.gather_object(
                entries, gathered if world.rank == 0 else None, dst=world.global_rank(0),
                group=world.group,
            )
        outcome: list[Any] = [None]
        if world.rank == 0:
            try:
                files: dict[str, FileEntry] = {}
                for part in gathered:
                    files.update(part or {})
                self._check_listing(dir_name, files)
                if self.round != world.round:
                    raise CheckpointCommitError(
                        f"the world that saved step ({step}) (round {world.round}) was "
                        f"replaced by round {self.round} before the commit; the new world's "
                        "next save commits instead."
                    )
                fence = self.commit_fence
                if fence is not None and not fence():
                    raise CheckpointCommitError(
                        f"this worker's world is no longer the job's (cut off from it, or "
                        f"aborted), so step ({step}) was not committed; the job's own "
                        "checkpoints go on without it."
                    )
                rec = CommitRecord(
                    step=step, round=world.round, world_size=world.size, run_id=self.run_id,
                    created_at=time.time(), files=files, metadata=user_meta,
                )
                self.storage.write_bytes(f"{dir_path}/{COMMIT_FILE}", rec.to_json())
                self.storage.write_bytes(
                    self.storage.path(LATEST_FILE), format_latest(step, dir_name)
                )
                outcome = [_info(rec, self.storage.url_of(dir_name))]
                logger.info(
                    "checkpoint.committed step=%d persist_ms=%.1f bytes=%d",
                    step, persist_s * 1e3, sum(f.size for f in files.values()),
                )
            except Exception as exc:
                outcome = [f"{type(exc).__name__}: {exc}"]
        if world.distributed:
            dist.broadcast_object_list(outcome, src=world.global_rank(0), group=world.group)
        result = outcome[0]
        if not isinstance(result, CheckpointInfo):
            raise CheckpointCommitError(
                f"Commit of checkpoint at step ({step}) in ({self.storage.url}) failed "
                f"({result}); the previous checkpoint stays valid."
            )
        return result

    def _mirror(self, dir_name: str) -> None:
        """After a commit: this rank's files to its node's memory store and its peer's."""
        copies, self._copies = self._copies, {}
        if self.memory is not None and copies:
            self.memory.mirror(dir_name, copies)

    def _check_listing(self, dir_name: str, files: Mapping[str, FileEntry]) -> None:
        """Fail unless the storage lists exactly the written files, each at its written size."""
        listed = {
            rel: size for rel, size in self.storage.list_files(self.storage.path(dir_name)).items()
            if rel != COMMIT_FILE
        }
        if ".metadata" not in files:
            raise CheckpointCommitError(
                f"Checkpoint ({self.storage.url_of(dir_name)}) has no DCP .metadata among its "
                "written files; the save did not finish, the next save tries again."
            )
        for rel, entry in sorted(files.items()):
            if listed.get(rel) != entry.size:
                raise CheckpointCommitError(
                    f"Checkpoint file ({self.storage.url_of(dir_name, rel)}) is listed with size "
                    f"({listed.get(rel)}) but ({entry.size}) bytes were written; the storage "
                    "lost a write, the next save tries again."
                )

    def _apply_retention(self, in_flight: str | None) -> None:
        try:
            committed, uncommitted = self._scan()
            doomed = plan_retention(
                [n for n, _ in committed], uncommitted, keep_last=self.keep_last,
                in_flight=in_flight, keep_every=self.keep_every,
            )
        except Exception as exc:
            logger.warning("checkpoint retention scan failed: %s", exc)
            return
        for name in doomed:
            try:
                self.storage.remove_tree(self.storage.path(name))
                logger.info("checkpoint retention deleted %s", name)
            except Exception as exc:
                logger.warning("checkpoint retention could not delete %s: %s", name, exc)

    def _run_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    # ----------------------------------------------------------------------------- read path
    def _read_commit(self, name: str) -> CommitRecord | None:
        path = self.storage.path(name, COMMIT_FILE)
        try:
            data = self.storage.read_bytes(path)
        except (FileNotFoundError, NotADirectoryError):
            # A stray file with an attempt name (NotADirectory) is no checkpoint either.
            return None
        return CommitRecord.from_json(data, where=self.storage.url_of(name, COMMIT_FILE))

    def _scan(self) -> tuple[list[tuple[str, CommitRecord]], list[str]]:
        """Committed ``(name, record)`` newest first, and uncommitted attempt names."""
        names = [n for n in self.storage.list_names(self.storage.root) if parse_dir_name(n)]
        names.sort(key=lambda n: parse_dir_name(n) or (0, 0), reverse=True)
        committed: list[tuple[str, CommitRecord]] = []
        uncommitted: list[str] = []
        for name in names:
            try:
                rec = self._read_commit(name)
            except CheckpointCorruptError as exc:
                logger.warning("ignoring checkpoint with a damaged commit record: %s", exc)
                rec = None
            if rec is None:
                uncommitted.append(name)
            else:
                committed.append((name, rec))
        return committed, uncommitted

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint with a valid commit record, or ``None`` (fresh start)."""
        pointer = None
        with contextlib.suppress(FileNotFoundError):
            pointer = parse_latest(self.storage.read_bytes(self.storage.path(LATEST_FILE)))
        if pointer is not None:
            step, name = pointer
            try:
                rec = self._read_commit(name)
            except CheckpointCorruptError:
                rec = None
            if rec is not None and rec.step == step:
                newest = self._scan()[0]
                # A newer commit can exist if latest.json's write was lost to a crash.
                if not newest or _order(newest[0][0]) <= _order(name):
                    return _info(rec, self.storage.url_of(name))
        committed, _ = self._scan()
        if not committed:
            return None
        name, rec = committed[0]
        return _info(rec, self.storage.url_of(name))

    def verify(self, info: CheckpointInfo) -> None:
        """Check the commit record and every listed file's size and CRC32.

        Raises:
            CheckpointCorruptError: If anything does not match.
        """
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        rec = self._read_commit(name)
        if rec is None:
            raise CheckpointCorruptError(
                f"Checkpoint ({info.path}) has no commit record; it was never committed."
            )
        dir_path = self.storage.path(name)
        sizes = self.storage.list_files(dir_path)
        for rel, entry in sorted(rec.files.items()):
            where = f"{info.path}/{rel}"
            if sizes.get(rel) != entry.size:
                raise CheckpointCorruptError(
                    f"Checkpoint file ({where}) has size ({sizes.get(rel)}) but its commit "
                    f"record says ({entry.size}); the checkpoint is damaged, load another one."
                )
            got = crc32(self.storage.read_bytes(f"{dir_path}/{rel}"))
            if got != entry.crc32:
                raise CheckpointCorruptError(
                    f"Checkpoint file ({where}) has CRC32 ({got:#010x}) but its commit record "
                    f"says ({entry.crc32:#010x}); the checkpoint is damaged, load another one."
                )

    def _choose(self, step: int | None) -> CheckpointInfo | str | None:
        """Coordinator: pick and verify the checkpoint to load (or an error sentence)."""
        committed, _ = self._scan()
        if step is not None:
            matches = [(n, r) for n, r in committed if r.step == step]
            if not matches:
                return (
                    f"NotFound:No committed checkpoint at step ({step}) in "
                    f"({self.storage.url}); list them with latest() or pass another step."
                )
            name, rec = matches[0]
            info = _info(rec, self.storage.url_of(name))
            try:
                self.verify(info)
            except CheckpointCorruptError as exc:
                return f"Corrupt:{exc}"
            return info
        first = self.latest()
        ordered = [(n, r) for n, r in committed]
        if first is not None:
            first_name = first.path.rstrip("/").rsplit("/", 1)[-1]
            ordered.sort(key=lambda nr: nr[0] != first_name)
        for name, rec in ordered:
            info = _info(rec, self.storage.url_of(name))
            try:
                self.verify(info)
            except CheckpointCorruptError as exc:
                logger.warning("skipping damaged checkpoint, falling back: %s", exc)
                continue
            return info
        return None

    def load(self, state: Mapping[str, Any], *, step: int | None = None) -> CheckpointInfo | None:
        """Load a verified checkpoint into ``state`` in place (re-sharding as needed).

        Args:
            state: The same structure as saved (tensors, dicts, ``Stateful`` objects).
            step: A specific step; ``None`` loads the newest good checkpoint.

        Returns:
            What was loaded, or ``None`` when there is no committed checkpoint (fresh start).

        Raises:
            CheckpointNotFoundError: ``step`` has no committed checkpoint.
            CheckpointCorruptError: ``step`` was given and its checkpoint is damaged.
            CheckpointFormatError: A commit record has a format version this code cannot read.
        """
        return self._load(state, step, memory=self.memory is not None and step is None)

    def _load(self, state: Mapping[str, Any], step: int | None, *,
              memory: bool) -> CheckpointInfo | None:
        self.wait()
        choice: list[Any] = [None]
        if self._rank == 0:
            try:
                choice = [self._choose_memory() if memory else None]
                choice = [choice[0] or self._choose(step)]
            except CheckpointFormatError as exc:
                # Not damage: a newer (or older) release wrote it, so do not fall back past it.
                choice = [f"Format:{exc}"]
            except Exception as exc:
                choice = [f"Error:{type(exc).__name__}: {exc}"]
        if self._distributed:
            dist.broadcast_object_list(choice, src=self._save_world().global_rank(0),
                                       group=self._pg)
        picked = choice[0]
        if isinstance(picked, tuple):
            try:
                return self._load_from_memory(state, *picked)
            except CheckpointCorruptError as exc:
                # Every rank gets it (DCP gathers the ranks' errors): all go to storage's
                # verified path, which falls back to the newest good checkpoint.
                logger.warning("%s; loading through storage's verified path instead", exc)
                return self._load(state, step, memory=False)
        self.last_load_source = "storage"
        if picked is None:
            logger.info("no committed checkpoint in %s: fresh start", self.storage.url)
            return None
        if isinstance(picked, str):
            kind, _, message = picked.partition(":")
            if kind == "NotFound":
                raise CheckpointNotFoundError(message)
            if kind == "Corrupt":
                raise CheckpointCorruptError(message)
            if kind == "Format":
                raise CheckpointFormatError(message)
            raise CheckpointError(
                f"Loading from ({self.storage.url}) failed ({message}); check the storage."
            )
        info: CheckpointInfo = picked
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        reader: FileSystemReader | FsspecReader
        if self.storage.is_local:
            reader = FileSystemReader(self.storage.path(name))
        else:
            reader = FsspecReader(info.path, **self.storage.storage_options)
        dcp_load(dict(state), storage_reader=reader, process_group=self._pg)
        logger.info("checkpoint loaded step=%d from %s", info.step, info.path)
        return info

    def _choose_memory(self) -> tuple[CheckpointInfo, dict[str, list[str]],
                                      dict[str, FileEntry]] | None:
        """Coordinator: storage's newest commit, if the memory stores hold all of it (as
        ``(info, plan, files)``); else ``None`` (load from storage)."""
        if self.memory is None:
            return None
        info = self.latest()
        if info is None:
            return None
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        try:
            rec = self._read_commit(name)
        except CheckpointCorruptError:
            return None
        if rec is None:
            return None
        plan = self.memory.plan(name, rec.files)
        return (info, plan, dict(rec.files)) if plan is not None else None

    def _load_from_memory(self, state: Mapping[str, Any], info: CheckpointInfo,
                          plan: dict[str, list[str]], files: dict[str, FileEntry]
                          ) -> CheckpointInfo:
        """Every rank: loads storage's newest checkpoint from the memory stores (storage
        for a file that fails its CRC32 there)."""
        assert self.memory is not None
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        dir_path = self.storage.path(name)
        reader = MemoryReader(self.memory, name, plan, files,
                              lambda rel: self.storage.read_bytes(f"{dir_path}/{rel}"),
                              info.path)
        try:
            dcp_load(dict(state), storage_reader=reader, process_group=self._pg)
        except CheckpointException as exc:
            corrupt = [c for c in _root_causes(exc) if isinstance(c, CheckpointCorruptError)]
            if corrupt:
                raise corrupt[0] from exc
            raise
        fallbacks = reader.memory_files.fallbacks
        self.last_load_source = "mixed" if fallbacks else "memory"
        logger.info("checkpoint loaded step=%d from memory (%s)%s", info.step, info.path,
                    f"; from storage: {', '.join(sorted(set(fallbacks)))}" if fallbacks else "")
        return info

    # ----------------------------------------------------------------------------- lifecycle
    def wait(self, timeout: timedelta | None = None) -> CheckpointInfo | None:
        """Wait for the in-flight save and its retention pass; return its info, or ``None``.

        ``None`` means there was no save or it failed.

        Raises:
            TimeoutError: If ``timeout`` passes first.
        """
        handle = self._inflight
        if handle is None:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        exc = handle.committed.exception(
            timeout=None if deadline is None else max(0.0, deadline - time.monotonic())
        )
        # Retention runs after the commit on the I/O thread; waiting for it too means a
        # caller that loads or lists next does not race its deletions.
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._inflight_done.wait(left):
            raise TimeoutError(
                f"Checkpoint retention after step ({handle.step}) did not finish in time."
            )
        return None if exc is not None else handle.committed.result()

    def close(self, wait: bool = True) -> None:
        """Stop the I/O thread, first waiting for the in-flight save when ``wait``."""
        if self._closed:
            return
        self._closed = True
        self._stager.join_reserve()
        if wait:
            self.wait()
        self._jobs.put(None)
        if wait:
            self._thread.join(timeout=60)
        self._upload_buffers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(wait=True)
