"""``ElasticRendezvousHandler``: torch's dynamic rendezvous plus lease-based failure detection.

It delegates every rendezvous decision to torch's ``DynamicRendezvousHandler`` and adds one
thing: after each completed round the node registers a member key on a short etcd lease
(:mod:`elastic.membership`). ``num_nodes_waiting()`` counts members of the current round whose
lease has expired as waiting nodes, so torch's agent restarts into a new round within about
one lease TTL of a node's death, answered from memory in the agent's monitor loop.

The round number is read from torch's private ``_state_holder.state.round`` (the one value all
nodes agree on); a unit test pins that hook.
"""

from __future__ import annotations

import logging
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

    def shutdown(self) -> bool:
        """See base class; also revokes the membership lease so peers see the exit at once."""
        try:
            return self._inner.shutdown()
        finally:
            self._registry.close()
            if self._backend is not None:
                self._backend.close()
