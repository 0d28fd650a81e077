"""Making every collective of one world fail at once, from any thread.

A worker learns that a member of its world is gone from a watch thread (its node agent tells
it, a liveness probe is refused, a lease expires) while its training thread is blocked in a
collective with that member, or in the build of a world that member will never join. A
:class:`WorldAbort` is what that thread calls: it makes the training thread's collective fail
promptly and leaves the process alive to build the next world.

* **gloo** has no abort that works while the group is referenced (see
  :mod:`torch_private`). The world's TCP connections are shut down instead: those
  opened since the ``WorldAbort`` was created (before the store client and the groups were
  built), minus the fds and remote ports the owner excludes. A blocked gloo collective fails
  with "connection closed"; a blocked store wait (``init_process_group`` waiting for a member)
  fails too when the store client was connected after the snapshot. Until :meth:`built`
  freezes the set, :meth:`abort` severs whatever was opened so far, so a build is aborted too.
* **NCCL** (and other accelerator backends): the communicators are aborted with the backend's
  own ``abort()`` (``ncclCommAbort`` under the hood), called from the aborting thread; torch's
  watchdog does the same from its own thread, so this is safe while the training thread waits
  on a stream. The process-group registry (``torch.distributed``'s ``_world``) is never
  touched from here: the owner drops the groups later on its own thread
  (:func:`~elastic.inplace.groups.abort_groups`).

Both branches share the bookkeeping and the locking; only the final call differs.

With NCCL, aborting a communicator **does not raise** in the training thread for work already
queued: the stream is released and the collective's output is garbage. ``TORCH_NCCL_ASYNC_
ERROR_HANDLING=0`` (see :mod:`elastic.process_group`) keeps the watchdog from tearing the
process down, so the owner must call :meth:`WorldAbort.check` after the host has seen the
step's collectives complete and before the step counts as done: a step whose world was
aborted is abandoned, never applied. The flag is set, and the ``on_abort`` callback has run,
before any communicator is aborted, so a stream the host saw finish while the flag was clear
finished on real collectives (:mod:`~elastic.inplace.step_fence` builds on that).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import torch.distributed as dist

from torch_private import (
    abort_backends,
    accelerator_backends,
    opened_since,
    sever_sockets,
    socket_inodes,
)

__all__ = ["WorldAbort", "WorldAbortedError"]

logger = logging.getLogger(__name__)


class WorldAbortedError(dist.DistError):
    """A collective's world was aborted (a member is gone); the step must be abandoned.

    A ``DistError`` so that :func:`~elastic.inplace.controller.is_peer_failure` counts it.
    """


class WorldAbort:
    """Makes every collective of one built world fail promptly, from any thread.

    Create it just before building a world (before connecting its store client and calling
    ``init_process_group``), call :meth:`built` with the world's groups once they exist, and
    :meth:`release` just before the owner destroys them. :meth:`abort` may be called at any
    time from any thread: before, during or after the build, twice, concurrently with
    :meth:`release`, or after the groups are gone.

    Args:
        skip_ports: Remote TCP ports never to shut down (etcd, a store shared across worlds).
        skip_fds: File descriptors never to shut down (a channel to the node agent);
            consulted at each sever, so the owner may add to it later.
        name: Names the world in log lines (``"epoch 7"``).
        on_abort: Called by the first :meth:`abort` after the flag is set and before anything
            is torn down, unless the groups were released (the step fence notes then which
            queued steps had not finished); it must be quick, and it must not raise.
    """

    def __init__(self, *, skip_ports: Collection[int] = (), skip_fds: Collection[int] = (),
                 name: str = "", on_abort: Callable[[], None] | None = None) -> None:
        self.name = name
        self._on_abort = on_abort
        self._before = socket_inodes()
        self._skip_ports = frozenset(skip_ports)
        self._skip_fds = skip_fds
        self._sockets: dict[int, int] | None = None  # frozen by built()
        self._backends: list[Any] = []
        self._released = False
        self._reason: str | None = None
        self._flag_lock = threading.Lock()  # held for flag reads and writes only
        self._work_lock = threading.Lock()  # held while tearing down, freezing or releasing

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called."""
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        """The reason given to the first :meth:`abort`, ``None`` while not aborted."""
        return self._reason

    def built(self, *groups: Any) -> None:
        """Freezes the world's sockets and notes its accelerator communicators.

        Sockets opened later (by storage clients, probes) are never severed by this world.

        Args:
            groups: Every ``ProcessGroup`` of the world.

        Raises:
            WorldAbortedError: If :meth:`abort` ran during the build (the world must not be
                used; what the build opened after the abort is severed too).
        """
        with self._work_lock:
            sockets = opened_since(self._before, skip_ports=self._skip_ports,
                                   skip_fds=self._skip_fds)
            backends = [b for g in groups for b in accelerator_backends(g)]
            with self._flag_lock:
                if self._reason is None and not self._released:
                    self._sockets = sockets
                    self._backends = backends
                    return
                reason = self._reason or "released before it was built"
            self._tear_down(sockets, backends)
        raise WorldAbortedError(f"world {self.name} was aborted while it was built ({reason}).")

    def adopt(self, before: dict[int, int], *groups: Any) -> None:
        """Adds groups built after :meth:`built` to the world (a device mesh's, a sharded
        model's background group): the sockets opened since ``before`` (a
        :func:`torch_private.socket_inodes` snapshot taken just before building
        them) and their accelerator communicators are aborted with the world's.

        Raises:
            WorldAbortedError: If the world was aborted meanwhile (what they opened is
                severed at once).
        """
        with self._work_lock:
            sockets = opened_since(before, skip_ports=self._skip_ports,
                                   skip_fds=self._skip_fds)
            backends: list[Any] = []
            for backend in (b for g in groups for b in accelerator_backends(g)):
                if all(backend is not known for known in (*self._backends, *backends)):
                    backends.append(backend)
            with self._flag_lock:
                if self._reason is None and not self._released and self._sockets is not None:
                    self._sockets = {**self._sockets, **sockets}
                    self._backends = [*self._backends, *backends]
                    return
                reason = self._reason or "released, or not built yet"
            self._tear_down(sockets, backends)
        raise WorldAbortedError(f"world {self.name} was aborted while groups were added to it "
                                f"({reason}).")

    def abort(self, reason: str) -> None:
        """Makes the world's collectives fail; idempotent, thread-safe, returns promptly.

        Blocks at most for an accelerator backend's own abort (bounded by its timeout).

        Args:
            reason: Why (logged, and carried by :class:`WorldAbortedError`).
        """
        with self._flag_lock:
            if self._reason is not None:
                return
            self._reason = reason
        started = time.monotonic()
        with self._work_lock:
            if self._released:
                logger.info("world %s aborted after its groups were released (%s)",
                            self.name, reason)
                return
            if self._on_abort is not None:
                # Under the work lock: release() waits, so this never runs on the steps
                # of a later world.
                try:
                    self._on_abort()
                except Exception:
                    logger.exception("the abort callback of world %s failed", self.name)
            sockets = self._sockets
            if sockets is None:  # still building: whatever it opened so far
                sockets = opened_since(self._before, skip_ports=self._skip_ports,
                                       skip_fds=self._skip_fds)
            backends = list(self._backends)
            severed = self._tear_down(sockets, backends)
        logger.warning("world %s aborted (%s): %d communicator(s) aborted, %d connection(s) "
                       "shut down in %.3fs", self.name, reason, len(backends), severed,
                       time.monotonic() - started)

    def check(self) -> None:
        """Raises :class:`WorldAbortedError` if the world was aborted."""
        reason = self._reason
        if reason is not None:
            raise WorldAbortedError(f"world {self.name} was aborted ({reason}).")

    def release(self) -> None:
        """The owner is about to destroy the groups: :meth:`abort` must not touch them any more.

        Waits for an abort in progress to finish; a later :meth:`abort` only sets the flag.
        """
        with self._work_lock:
            with self._flag_lock:
                self._released = True
            self._sockets = {}
            self._backends = []

    @staticmethod
    def _tear_down(sockets: dict[int, int], backends: list[Any]) -> int:
        # Accelerator communicators first: ncclCommAbort closes NCCL's own sockets, so they
        # are gone (and skipped) by the time the rest of the world's connections are shut.
        if backends:
            abort_backends(backends)
        return sever_sockets(sockets)
