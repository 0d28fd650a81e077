"""``ElasticRendezvousHandler``: torch's dynamic rendezvous plus lease-based failure detection.

It delegates every rendezvous decision to torch's ``DynamicRendezvousHandler`` and adds one
thing: after each completed round the node registers a member key on a short etcd lease
(:mod:`elastic.membership`). ``num_nodes_waiting()`` counts members of the current round whose
lease has expired as waiting nodes, so torch's agent restarts into a new round within about
one lease TTL of a node's death, answered from memory in the agent's monitor loop.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from elastic.membership import MembershipRegistry

logger = logging.getLogger(__name__)


class ElasticRendezvousHandler(RendezvousHandler):
    """Wraps a rendezvous handler with membership leases.

    Args:
        inner: torch's dynamic rendezvous handler over the etcd backend.
        registry: this node's membership registry.
    """

    def __init__(self, inner: RendezvousHandler, registry: MembershipRegistry) -> None:
        self._inner = inner
        self._registry = registry

    @property
    def round(self) -> int:
        """The round this node last joined."""
        return self._registry.round

    def lost_members(self) -> frozenset[int]:
        """Group ranks of the current round whose etcd lease expired."""
        return self._registry.lost_members()

    def get_backend(self) -> str:
        """See base class."""
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        """See base class."""
        return bool(self._inner.use_agent_store)

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        info = self._inner.next_rendezvous()
        state: Any = getattr(getattr(self._inner, "_state_holder", None), "state", None)
        round_ = getattr(state, "round", None)
        if not isinstance(round_, int):
            round_ = self._registry.round + 1
        self._registry.register(round_, info.rank, info.world_size)
        return info

    def is_closed(self) -> bool:
        """See base class."""
        return self._inner.is_closed()

    def set_closed(self) -> None:
        """See base class."""
        self._inner.set_closed()  # type: ignore[no-untyped-call]

    def num_nodes_waiting(self) -> int:
        """See base class; members lost from the current round count as waiting."""
        return self._inner.num_nodes_waiting() + len(self._registry.lost_members())

    def get_run_id(self) -> str:
        """See base class."""
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        """See base class; also revokes the membership lease so peers see the exit at once."""
        try:
            return self._inner.shutdown()
        finally:
            self._registry.close()
