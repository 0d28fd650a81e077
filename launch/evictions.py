"""Evicting peer nodes that are gone, before their lease expires.

One part of the node agent (``docs/agent.md`` has the map). It decides, from probes of the
peers' liveness ports (:mod:`membership.liveness`) and the silent-peer rule
(:mod:`membership.silent_peers`), that a peer node is gone, and removes it through the one
membership call for that, :meth:`~membership.job.RunMembership.evict`; it never writes etcd
otherwise.

* A worker whose collective failed names its world's other nodes (``suspect``). A node whose
  whole process tree died (an OOM kill, a crashed container) has nobody left to revoke its
  lease: its agent's liveness port now refuses, which is certain, so it is evicted at once
  instead of after the lease TTL. That removes its record and, if it led the run, the leader
  key too.
* A silent host answers nothing (unknown). While this node's workers wait for it in a
  collective (``stalled``), it is evicted too once etcd has had no keep-alive of its lease for
  a whole period, checked in the order :func:`~membership.silent_peers.confirmed_silent`
  gives; otherwise its lease decides.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Sequence

from elastic.contract.messages import Stalled, Suspect
from elastic.contract.records import WorldRecord
from elastic_errors import EtcdUnavailableError
from membership.job import RunMembership
from membership.liveness import ProbeBook, probe_all
from membership.silent_peers import (
    ETCD_CHECK_DEADLINE,
    SilentPeerWatch,
    confirmed_silent,
    watched_peers,
)

__all__ = ["PeerEvictor"]

logger = logging.getLogger(__name__)


class PeerEvictor:
    """Finds peer nodes that are gone and evicts them.

    Args:
        run: This node's membership of the run (``None`` before it joined).
        node: This node's id.
        ttl: The node lease TTL (a wait is no longer checked after it: by then a silent
            peer's lease has expired anyway).
    """

    def __init__(self, run: Callable[[], RunMembership | None], node: Callable[[], str],
                 ttl: float) -> None:
        self._run = run
        self._node = node
        self.probes = ProbeBook()
        self._silent = SilentPeerWatch(self._check_silent, limit=ttl + 1.0)

    def learn(self, world: WorldRecord) -> None:
        """Learns, in the background, which peers of a new world answer a probe (only a
        refusal from a peer that answered before is trusted)."""
        me = self._node()
        self.probes.learn_in_background(
            (m.addr, m.probe_port) for m in world.members if m.node != me and m.probe_port)

    def suspect(self, nodes: Sequence[str]) -> None:
        """A worker's collective failed naming ``nodes``: checks them on a thread."""
        threading.Thread(target=self.check, args=(list(nodes),), daemon=True,
                         name="elastic-suspects").start()

    def on_stalled(self, _: object, __: object, message: Stalled) -> bool:
        """A worker waits in the collective of ``message.step`` in world ``message.epoch``
        (long enough to look for a silent peer); the node record does not change."""
        self._silent.stalled(message.epoch, message.step)
        return False

    def on_suspect(self, _: object, __: object, message: Suspect) -> bool:
        """A worker's collective failed naming ``message.nodes``."""
        self.suspect(message.nodes)
        return False

    def resumed(self) -> None:
        """The step the workers waited in completed."""
        self._silent.resumed()

    def close(self) -> None:
        """Stops the silent-peer checks."""
        self._silent.close()

    def _addresses(self, nodes: Sequence[str], world: WorldRecord
                   ) -> dict[str, tuple[str, int]]:
        me = self._node()
        return {m.node: (m.addr, m.probe_port) for m in world.members
                if m.node in nodes and m.node != me and m.probe_port}

    def all_answer(self, nodes: Sequence[str], world: WorldRecord) -> bool:
        """Whether every one of ``nodes`` answers a fresh probe now."""
        addresses = self._addresses(nodes, world)
        if not addresses or len(addresses) < len([n for n in nodes if n != self._node()]):
            return False  # a node without a liveness port: unknown
        answers = probe_all(addresses.values(), self.probes.timeout)
        return all(alive is True for alive in answers.values())

    def check(self, nodes: Sequence[str], world: WorldRecord | None = None, *,
              silent: bool = False) -> bool:
        """Evicts the suspected nodes that are gone (see the module docstring).

        Args:
            nodes: The suspected nodes.
            world: The world whose records give their addresses (default: the current one).
            silent: Whether a node that answers no probe may be evicted as well.

        Returns:
            Whether any of them was found gone.
        """
        run = self._run()
        if world is None and run is not None:
            world = run.world()
        if run is None or world is None:
            return False
        addresses = self._addresses(nodes, world)
        dead, unanswered = self.probes.recheck(addresses.values())
        found = bool(dead)
        # Silent checks run while the workers are stuck: a node that cannot reach etcd at
        # once is the cut-off one, and must not sit on etcd's whole deadline.
        deadline = ETCD_CHECK_DEADLINE if silent else None
        for node, address in addresses.items():
            if address not in dead and not (silent and address in unanswered):
                continue
            with contextlib.suppress(EtcdUnavailableError):
                lease = run.peer_lease(node, deadline=deadline)
                if address in dead:
                    why = "its agent's liveness port refuses"
                elif lease is None:
                    found = True  # already gone: its lease expired meanwhile
                    continue
                elif lease and confirmed_silent(
                        functools.partial(run.lease_unrefreshed, lease,
                                          deadline=ETCD_CHECK_DEADLINE),
                        functools.partial(self._probe_unanswered, address)):
                    why = ("its host answers no probe and etcd has had no keep-alive of its "
                           "lease for over a keep-alive period")
                else:
                    continue
                run.evict(node, why, lease=lease or 0, deadline=deadline)
                found = True
        return found

    def _probe_unanswered(self, address: tuple[str, int]) -> bool:
        """Probes one peer's liveness port again: True if it refuses or answers nothing."""
        refused, unanswered = self.probes.recheck([address])
        return address in refused or address in unanswered

    def _check_silent(self, epoch: int) -> bool:
        """:class:`SilentPeerWatch`'s check: evicts the peers of world ``epoch`` that went
        silent; whether to stop checking (one went, or the world moved on)."""
        run = self._run()
        world = run.world() if run is not None else None
        if world is None or world.epoch != epoch:
            return True
        peers = watched_peers([m.node for m in world.members], self._node())
        return self.check(peers, world, silent=True)
