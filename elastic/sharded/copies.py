"""Redundancy for sharded state without replicas: each rank's shard also lives in a peer's
host memory, refreshed asynchronously.

Every so often (:meth:`ShardCopies.due`), at the same step boundary on every rank, each rank

1. copies its own shard (parameters and optimizer moments) and the small replicated state
   (loop step, data cursor, RNG, optimizer step counts, scheduler) into host buffers kept
   between refreshes: its **own snapshot**, the point it can roll back to; then
2. on background threads, sends that snapshot to its *holder* (a rank on another node,
   :func:`~elastic.sharded.plan.copy_holders`) and receives its *owner*'s snapshot into the
   **copy** it keeps.

When a rank is lost, its shard at the snapshot's step survives in its holder's copy, and
every survivor rolls back to that step from its own snapshot (a survivor whose live state
is at that step keeps it): at most the steps since the snapshot are lost, and the data
cursor rolls back with the weights, so every sample is still trained exactly once.

**Two versions of each, and a confirmation.** A refresh overwrites the *older* of the two
own snapshots and the older of the two copies, so while it is in flight the previous one is
whole everywhere: a rank lost in the middle of its send, or a whole node lost in the middle
of a refresh, rolls the job back to the previous refresh instead of to storage. Its
transfers overlap the next step's compute, and before that step's optimizer step every rank
confirms them (:meth:`ShardCopies.confirm`: one small all-reduce per refresh): no rank's
state moves past a refresh before every copy of it is whole. So a loss costs at most ``K``
steps (``K`` the steps between refreshes), wherever it strikes.

**Memory:** four shard-sized host buffers per rank (two own snapshots, two copies of the
owner's shard: about ``4 x`` the rank's share of parameters and optimizer state), plus the
small state. :class:`ShardCopies` refuses to start (in the job's first world; later worlds go
without copies) when the node's available host memory cannot hold them for all its workers.

**Cadence:** ``every=K`` refreshes after every ``K``-th step. The default (``None``) chooses
it from measurement: a rank asks for a refresh once the time since the last one is at least
100 times what the last one cost (its blocking copy and confirmation plus its background
transfer), so the refreshes take at most 1 % of the training time, whatever the model and
the machine; the ranks agree on it at a step boundary (:mod:`~elastic.loop.agreement`), and
a refresh happens only when every rank finds it due.
"""

from __future__ import annotations

import copy as copy_module
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist

from elastic.inplace.heal import GlooLink, receive_state, send_state
from elastic_errors import ConfigError

__all__ = ["DEFAULT_BUDGET", "VERSIONS", "ShardCopies", "Snapshot", "available_host_memory",
           "clone_tree"]

logger = logging.getLogger(__name__)

#: The share of training time refreshes may take when their cadence is automatic.
DEFAULT_BUDGET: Final = 0.01
#: Host memory left free when checking that the copies fit.
_HEADROOM: Final = 0.9
#: Versions of the own snapshot and of the copy kept: a refresh overwrites the older, so the
#: newer stays whole while the refresh is in flight.
VERSIONS: Final = 2


@dataclass(slots=True)
class Snapshot:
    """One shard of the state at one step, in host memory.

    Attributes:
        step: Completed steps of the state.
        shards: Shards of the world it was cut in.
        index: Which shard.
        tensors: The shard's sharded tensors by name (``"p:<fqn>"``, ``"o:<fqn>:<key>"``).
        small: The replicated state at that step.
    """

    step: int
    shards: int
    index: int
    tensors: dict[str, torch.Tensor]
    small: dict[str, Any]

    @property
    def nbytes(self) -> int:
        """Bytes of its sharded tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def clone_tree(value: Any) -> Any:
    """A deep copy of a state tree whose tensors are cloned (on their own device)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: clone_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(clone_tree(v) for v in value)
    return copy_module.deepcopy(value)


def available_host_memory() -> int:
    """Bytes of host memory available for new allocations (``MemAvailable``)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _Lane:
    """A daemon thread running submitted calls in order (a queue with a sentinel)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((call, future))
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            call, future = job
            # The call (and what it refers to: a process group) is dropped before the owner
            # is told: a process group released by this thread while the interpreter exits
            # aborts the process (pybind11 releases the GIL to destroy it).
            del job
            try:
                result = call()
            except BaseException as exc:  # reported through the future, never fatal here
                del call
                future.set_exception(exc)
                continue
            del call
            future.set_result(result)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5.0)


class ShardCopies:
    """This rank's own snapshots and the copies of its owner's shard (see the module doc).

    Args:
        every: Refresh after every this many steps (``None``: automatic, see the module doc).
        budget: The share of training time automatic refreshes may take.
        chunk_bytes: Largest message of a transfer.

    Raises:
        ConfigError: On invalid values.
    """

    def __init__(self, *, every: int | None = None, budget: float = DEFAULT_BUDGET,
                 chunk_bytes: int = 32 << 20) -> None:
        if every is not None and every < 1:
            raise ConfigError(f"snapshot_every ({every}) must be at least 1, or None to "
                              "choose it from measurement.")
        if not 0 < budget < 1:
            raise ConfigError(f"the refresh budget ({budget}) must be between 0 and 1.")
        self.every = every
        self.budget = budget
        self.chunk_bytes = chunk_bytes
        #: The own snapshots, oldest first (at most :data:`VERSIONS`).
        self.own: list[Snapshot] = []
        #: The copies of the owner's shard, oldest first (at most :data:`VERSIONS`).
        self.copies: list[Snapshot] = []
        self._group: dist.ProcessGroup | None = None
        self._holder = self._owner = -1
        self._layout = (1, 0)
        self._local_workers = 1
        self._strict = True  # the first world refuses copies that do not fit; later ones skip
        self._skipped = False
        self._announced = False
        self._lanes: tuple[_Lane, _Lane] | None = None
        self._pending: list[Future[Any]] = []
        self._unconfirmed: int | None = None  # the step of a refresh not yet confirmed
        self._lock = threading.Lock()
        self._last_take = -float("inf")
        #: Seconds the last refresh blocked training (its copy into host memory).
        self.blocking_s = 0.0
        #: Seconds the last refresh's background transfer took (the refresh window).
        self.exchange_s = 0.0
        #: Refreshes taken in this process.
        self.refreshes = 0

    @property
    def enabled(self) -> bool:
        """Whether this world refreshes copies (it has a holder and they fit)."""
        return self._group is not None and self._holder >= 0 and not self._skipped

    def configure(self, group: dist.ProcessGroup | None, *, holder: int, owner: int,
                  shards: int, index: int, local_workers: int) -> None:
        """Enters a new world: whom this rank's snapshots go to and whose it keeps.

        Snapshots and copies of older worlds stay valid holdings until refreshed.

        Args:
            group: A gloo group of the world for the transfers (``None``: no copies).
            holder: The rank that keeps this rank's copy (``-1``: none).
            owner: The rank whose copy this rank keeps (``-1``: none).
            shards: Shards of this world.
            index: This rank's shard.
            local_workers: Workers on this node (they share its host memory).
        """
        self.settle()
        if self._group is not None:
            self._strict = False
        self._group, self._holder, self._owner = group, holder, owner
        self._layout = (shards, index)
        self._local_workers = max(1, local_workers)
        self._skipped = False
        self._announced = False
        self._unconfirmed = None  # the previous world's group is gone

    def due(self, step: int) -> bool:
        """Whether this rank wants a refresh after ``step`` completed steps."""
        if not self.enabled:
            return False
        if self.every is not None:
            return step % self.every == 0
        if not self.own or (self.own[-1].shards, self.own[-1].index) != self._layout:
            return True
        cost = self.blocking_s + self.exchange_s
        return time.monotonic() - self._last_take >= cost / self.budget

    def take(self, step: int, tensors: Mapping[str, torch.Tensor],
             small: Mapping[str, Any]) -> None:
        """Refreshes: the own snapshot now (over the older of the two kept), the transfers in
        the background.

        Args:
            step: Completed steps of the state.
            tensors: This rank's live shards by name.
            small: The replicated state (copied here).

        Raises:
            ConfigError: If the copies do not fit in host memory in the job's first world
                (later worlds log it and go without copies).
        """
        if not self.enabled:
            return
        started = time.monotonic()
        # The previous refresh's transfers, on both ends of both pairs, are complete before
        # anything of it is overwritten: the versions kept are always whole.
        self.settle()
        if not self._fits(tensors):
            return
        with self._lock:
            reuse = self.own.pop(0) if len(self.own) >= VERSIONS else None
        own = self._stage(step, tensors, clone_tree(small), reuse)
        with self._lock:
            self.own.append(own)
        self.blocking_s = time.monotonic() - started
        self._last_take = started
        self.refreshes += 1
        self._exchange(own)
        self._unconfirmed = step
        if not self._announced:
            self._announced = True
            logger.info("shard copies: snapshot of step %d (%d bytes, %.1f ms) goes to rank %d; "
                        "this rank keeps rank %d's (cadence: %s)", step, own.nbytes,
                        self.blocking_s * 1e3, self._holder, self._owner,
                        f"every {self.every} steps" if self.every else
                        f"{self.budget:.0%} of training time")

    def _fits(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        if self.own and all(s.tensors.keys() == tensors.keys() and
                            all(s.tensors[n].shape == t.shape for n, t in tensors.items())
                            for s in self.own):
            return True  # the buffers exist already
        needed = 2 * VERSIONS * sum(t.numel() * t.element_size() for t in tensors.values())
        available = available_host_memory()
        if needed * self._local_workers <= _HEADROOM * available:
            return True
        message = (
            f"redundancy=1 keeps {2 * VERSIONS} shard-sized buffers per worker in host memory "
            f"({needed / 2**30:.2f} GiB for each of this node's {self._local_workers} "
            f"workers) but only {available / 2**30:.2f} GiB is available; pass redundancy=0 "
            "(storage only) or give the node more host memory."
        )
        if self._strict:
            raise ConfigError(message)
        logger.warning("no shard copies in this world: %s", message)
        self._skipped = True
        return False

    def _stage(self, step: int, tensors: Mapping[str, torch.Tensor],
               small: dict[str, Any], reuse: Snapshot | None) -> Snapshot:
        old = reuse.tensors if reuse is not None else {}
        buffers: dict[str, torch.Tensor] = {}
        devices: set[torch.device] = set()
        for name, tensor in tensors.items():
            buf = old.get(name)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                  pin_memory=tensor.device.type == "cuda")
            asynchronous = tensor.device.type == "cuda"
            buf.copy_(tensor.detach(), non_blocking=asynchronous)
            if asynchronous:
                devices.add(tensor.device)
            buffers[name] = buf
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        shards, index = self._layout
        return Snapshot(step=step, shards=shards, index=index, tensors=buffers, small=small)

    def _exchange(self, own: Snapshot) -> None:
        group = self._group
        assert group is not None
        if self._lanes is None:
            self._lanes = (_Lane("shard-copy-send"), _Lane("shard-copy-receive"))
        sender, receiver = self._lanes
        link = GlooLink(group)
        holder, owner, chunk = self._holder, self._owner, self.chunk_bytes
        payload = {"snapshot": {"step": own.step, "shards": own.shards, "index": own.index,
                                "tensors": own.tensors, "small": own.small}}
        began = time.monotonic()

        def send() -> float:
            send_state(link, [holder], payload, chunk_bytes=chunk)
            return time.monotonic() - began

        with self._lock:
            # Received over the older copy's buffers (shapes permitting); the newer one
            # stays whole meanwhile, so an owner lost mid-send still has a copy here.
            spare = self.copies.pop(0) if len(self.copies) >= VERSIONS else None
        incoming: dict[str, Any] = {} if spare is None else {
            "step": spare.step, "shards": spare.shards, "index": spare.index,
            "tensors": spare.tensors, "small": spare.small}

        def receive() -> float:
            target = {"snapshot": incoming}
            receive_state(link, owner, target, device=torch.device("cpu"),
                          chunk_bytes=chunk, mark_torn=False)
            got = target["snapshot"]
            with self._lock:
                self.copies.append(Snapshot(
                    step=int(got["step"]), shards=int(got["shards"]), index=int(got["index"]),
                    tensors=dict(got["tensors"]), small=got["small"]))
            return time.monotonic() - began

        self._pending = [sender.submit(send)]
        if owner >= 0:
            self._pending.append(receiver.submit(receive))

    def settle(self) -> int:
        """Waits for the transfers in flight (they fail promptly once the world is
        aborted); a failed receive leaves the copies kept before it.

        Returns:
            How many of them failed.
        """
        pending, self._pending = self._pending, []
        durations = []
        failed = 0
        for future in pending:
            error = future.exception()
            if error is not None:
                failed += 1
                logger.warning("a shard copy transfer failed (%s); the copy is dropped",
                               str(error).splitlines()[0][:200] if str(error) else
                               type(error).__name__)
                continue
            durations.append(float(future.result()))
        if durations:
            self.exchange_s = max(durations)
        return failed

    def confirm(self) -> None:
        """Before an optimizer step: the last refresh's transfers are whole on every rank.

        Waits for this rank's, then all-reduces whether any rank's failed (one collective
        per refresh, on the copies' group). A refresh that failed while every rank is alive
        (a transfer error, not a loss) is dropped everywhere, and the one before stays.

        Raises:
            RuntimeError: (gloo's, or ``DistError``) when a member is gone: the step must
                not be applied, and the loop abandons it (a peer's failure).
        """
        step, self._unconfirmed = self._unconfirmed, None
        group = self._group
        if step is None or group is None:
            return
        started = time.monotonic()
        failed = torch.tensor([self.settle()], dtype=torch.int64)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        self.blocking_s += time.monotonic() - started
        if failed.item():
            logger.warning("the shard copies of step %d are not whole on every rank; they are "
                           "dropped (the previous refresh stays)", step)
            with self._lock:
                self.own = [s for s in self.own if s.step != step]
                self.copies = [s for s in self.copies if s.step != step]

    def discard_after(self, step: int) -> None:
        """Drops snapshots of steps after ``step`` (the state went back to ``step``: they
        belong to a history that will not happen again)."""
        with self._lock:
            self.own = [s for s in self.own if s.step <= step]
            self.copies = [s for s in self.copies if s.step <= step]

    def holdings(self) -> tuple[list[Snapshot], list[Snapshot]]:
        """The own snapshots and the complete copies, oldest first."""
        with self._lock:
            return list(self.own), list(self.copies)

    def close(self) -> None:
        """Waits for the transfers in flight and stops the background threads."""
        self.settle()
        if self._lanes is not None:
            for lane in self._lanes:
                lane.close()
            self._lanes = None
