"""``ElasticRendezvousHandler``: torch's dynamic rendezvous plus lease-based failure detection.

It delegates every rendezvous decision to torch's ``DynamicRendezvousHandler`` and adds one
thing: after each completed round the node registers a member key on a short etcd lease
(:mod:`elastic.membership`). ``num_nodes_waiting()`` counts members of the current round whose
lease has expired as waiting nodes, so torch's agent restarts into a new round within about
one lease TTL of a node's death, answered from memory in the agent's monitor loop.

The round number is read from torch's private ``_state_holder.state.round`` (the one value all
nodes agree on); a unit test pins that hook.

A node told it will be preempted announces it (:meth:`ElasticRendezvousHandler.announce_departure`)
and, once its workers are done, leaves without closing the rendezvous
(:meth:`ElasticRendezvousHandler.leave`): it removes itself from torch's participants and revokes
its member lease, so the survivors form the next round at once instead of waiting for torch's
heartbeat timeout or the lease TTL. ``shutdown()`` would instead close the rendezvous for everyone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Protocol

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
)

from elastic.errors import EtcdUnavailableError
from elastic.membership import MembershipRegistry

logger = logging.getLogger(__name__)


class _Closeable(Protocol):
    def close(self) -> None: ...


def _agreed_round(inner: RendezvousHandler) -> int | None:
    state: Any = getattr(getattr(inner, "_state_holder", None), "state", None)
    round_ = getattr(state, "round", None)
    return round_ if isinstance(round_, int) else None


def _exit_torch_round(inner: RendezvousHandler, timeout: timedelta) -> None:
    # torch's DynamicRendezvousHandler has no public "leave": next_rendezvous runs the same
    # private exit operation before joining again (a unit test pins these names).
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    stop: Any = getattr(inner, "_stop_heartbeats", None)
    executor: Any = getattr(inner, "_op_executor", None)
    if stop is None or executor is None:
        return  # not torch's dynamic handler: nothing to leave but the member lease
    stop()
    lock: Any = getattr(inner, "_heartbeat_lock", None)
    deadline = time.monotonic() + timeout.total_seconds()
    if lock is None:
        executor.run(_RendezvousExitOp(), deadline)
        return
    # The heartbeat thread is stopped; the lock only guards against a late keep-alive.
    if not lock.acquire(timeout=timeout.total_seconds()):
        raise TimeoutError(f"torch's heartbeat lock was busy for {timeout}")
    try:
        executor.run(_RendezvousExitOp(), deadline)
    finally:
        lock.release()


class ElasticRendezvousHandler(RendezvousHandler):
    """Wraps a rendezvous handler with membership leases.

    Args:
        inner: torch's dynamic rendezvous handler over the etcd backend.
        registry: this node's membership registry.
        backend: closed (its state lease is no longer refreshed) on :meth:`shutdown`.
    """

    def __init__(
        self, inner: RendezvousHandler, registry: MembershipRegistry,
        *, backend: _Closeable | None = None,
    ) -> None:
        self._inner = inner
        self._registry = registry
        self._backend = backend

    def __repr__(self) -> str:
        return f"ElasticRendezvousHandler(run_id={self.get_run_id()!r}, round={self.round})"

    @property
    def inner(self) -> RendezvousHandler:
        """The wrapped torch handler."""
        return self._inner

    @property
    def registry(self) -> MembershipRegistry:
        """This node's membership registry."""
        return self._registry

    @property
    def round(self) -> int:
        """The round this node last joined (-1 before the first)."""
        return self._registry.round

    def lost_members(self) -> frozenset[int]:
        """Group ranks of the current round whose etcd lease expired (from memory)."""
        return self._registry.lost_members()

    def membership_changed(self) -> bool:
        """Whether the current round lost a member, this node included (from memory)."""
        return self._registry.membership_changed()

    def departing_members(self) -> frozenset[int]:
        """Group ranks of the current round that announced a planned departure (from memory)."""
        return self._registry.departing_members()

    @property
    def member_ttl(self) -> int:
        """TTL in seconds of the member leases (how long a silent loss takes to notice)."""
        return self._registry.member_ttl

    def announce_departure(self, note: Mapping[str, Any]) -> bool:
        """Tells the other nodes that this one will leave (see ``MembershipRegistry``).

        Raises:
            EtcdUnavailableError: when etcd cannot be reached within the deadline.
        """
        return self._registry.announce_departure(note)

    def leave(
        self, timeout: timedelta = timedelta(seconds=10), *, lease_only: bool = False
    ) -> None:
        """Leaves the rendezvous for good without closing it, so the others go on at once.

        Stops torch's heartbeats, removes this node from the current round's participants
        (torch's exit operation: the round advances as soon as every participant has left or
        restarted) and revokes the member lease. Best effort within ``timeout``: whatever is not
        undone here expires by itself (heartbeat timeout, lease TTL).

        Args:
            timeout: Budget for torch's exit operation.
            lease_only: Only revoke the member lease (from a thread other than the one that
                may be inside a rendezvous operation).
        """
        try:
            if not lease_only:
                _exit_torch_round(self._inner, timeout)
        except Exception as exc:  # the lease revocation below still tells the others at once
            logger.warning("Could not leave torch's rendezvous round cleanly (%s); the others "
                           "drop this node after their heartbeat timeout.", exc)
        finally:
            self._registry.close()
            if self._backend is not None:
                self._backend.close()

    def get_backend(self) -> str:
        """See base class."""
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        """See base class."""
        return bool(self._inner.use_agent_store)

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class; then registers this node as a member of the new round."""
        info = self._inner.next_rendezvous()
        round_ = _agreed_round(self._inner)
        if round_ is None:
            round_ = self._registry.round + 1
        try:
            self._registry.register(round_, info.rank, info.world_size)
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        return info

    def is_closed(self) -> bool:
        """See base class."""
        return self._inner.is_closed()

    def set_closed(self) -> None:
        """See base class."""
        self._inner.set_closed()  # type: ignore[no-untyped-call]

    def num_nodes_waiting(self) -> int:
        """See base class; members lost from the current round (this node too) count as waiting."""
        waiting = self._inner.num_nodes_waiting()
        lost = len(self._registry.lost_members()) + int(self._registry.own_lease_lost())
        return waiting + lost

    def get_run_id(self) -> str:
        """See base class."""
        return self._inner.get_run_id()

    def mark_finished(self, note: Mapping[str, Any]) -> None:
        """Records that the job finished, before :meth:`shutdown` closes the rendezvous.

        A node that arrives later (a replacement an autoscaler started as the job ended)
        finds the rendezvous closed; :meth:`finished` tells it that the job succeeded.
        """
        self._registry.mark_finished(note)

    def finished(self) -> dict[str, Any] | None:
        """The note of a job that finished, or ``None``."""
        return self._registry.finished()

    def shutdown(self) -> bool:
        """See base class; also revokes the membership lease so peers see the exit at once."""
        try:
            return self._inner.shutdown()
        finally:
            self._registry.close()
            if self._backend is not None:
                self._backend.close()
