"""torchrun's plugin: torch's public ``RendezvousHandler`` over elastic-run's protocol.

``torchrun --rdzv-backend etcd-v3`` (or ``elastic-etcd-v3``) gets the same JSON node records,
world record and leader as ``elastic-run`` (see :mod:`membership`); nothing is pickled and no
private torch hook is used. torch's agent restarts its workers on every membership change
(restart mode); for in-place reconfiguration use ``elastic-run``.

Each call of :meth:`~EtcdV3RendezvousHandler.next_rendezvous` publishes the node with a new
incarnation and returns once a world includes it: the node's rank is its place in the world,
the world size the number of nodes (torch's agent assigns worker ranks itself, through the
returned store). :meth:`~EtcdV3RendezvousHandler.num_nodes_waiting` reports a newer world
than the one returned (a node lost or joining), which makes torch's agent restart its workers
and rendezvous again.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from elastic.contract.records import EndRecord, NodeRecord, WorkerSlot, WorldRecord
from elastic_errors import EtcdUnavailableError
from membership.address import registered_address
from membership.config import RdzvConf
from membership.decide import RunLimits
from membership.etcd import EtcdClient
from membership.generation import open_run
from membership.job import RunMembership, new_node_id
from membership.keys import JobKeys, validate_job_id
from membership.store import EtcdV3Store

__all__ = ["EtcdV3RendezvousHandler"]

logger = logging.getLogger(__name__)


class EtcdV3RendezvousHandler(RendezvousHandler):
    """See the module docstring.

    Args:
        params: torch's rendezvous parameters (``backend`` is the name this handler reports,
            so that aliases pass torch's registry check).
        client: The etcd client.
        conf: The parsed ``--rdzv-conf``.

    Raises:
        RendezvousClosedError: If the job id's run just ended.
        RendezvousConnectionError: If etcd cannot be reached.
    """

    def __init__(self, params: RendezvousParameters, client: EtcdClient,
                 conf: RdzvConf) -> None:
        self._backend = params.backend
        self._run_id = validate_job_id(params.run_id)
        self._client = client
        self._conf = conf
        self._local_addr = registered_address(params.local_addr, params.endpoint)
        try:
            opened = open_run(client, JobKeys(conf.key_prefix, params.run_id),
                              linger=conf.linger)
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if opened.ended is not None:
            raise RendezvousClosedError(
                f"job {params.run_id} already ended ({opened.ended.outcome}: "
                f"{opened.ended.reason})")
        self._keys = opened.keys
        self._run = RunMembership(
            client, opened.keys, limits=RunLimits(params.min_nodes, params.max_nodes,
                                                   conf.last_call_timeout),
            ttl=conf.member_ttl, linger=conf.linger)
        self._node = new_node_id()
        self._incarnation = 0
        self._joined = False
        self._world: WorldRecord | None = None

    def __repr__(self) -> str:
        return f"EtcdV3RendezvousHandler(run_id={self._run_id!r}, node={self._node!r})"

    def _record(self) -> NodeRecord:
        return NodeRecord(
            node=self._node, host=socket.gethostname(), addr=self._local_addr,
            agent_pid=os.getpid(), store_port=0,
            workers=(WorkerSlot(0, self._incarnation, True, False, 0),))

    def get_backend(self) -> str:
        """See base class."""
        return self._backend

    @property
    def use_agent_store(self) -> bool:
        """See base class: the rank-0 worker hosts a fresh store every round."""
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        self._incarnation += 1
        local_id = f"0.{self._incarnation}"
        try:
            if self._joined:
                self._run.update(workers=self._record().workers)
            else:
                self._run.join(self._record())
                self._joined = True
            me = f"{self._node}/{local_id}"
            found = self._run.wait(
                lambda v: v.end() is not None
                or ((w := v.world()) is not None and me in w.ranks()),
                self._conf.join_timeout)
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        end = self._run.view.end()
        if end is not None:
            raise RendezvousClosedError(f"the rendezvous is closed ({end.reason})")
        world = self._run.world()
        if not found or world is None:
            raise RendezvousTimeoutError(
                f"no world included this node within {self._conf.join_timeout:g} s; check "
                "that --nnodes MIN nodes are running.")
        self._world = world
        rank = world.node_rank(self._node)
        store = EtcdV3Store(self._client, f"{self._keys.store}e{world.epoch}/",
                            timeout=timedelta(seconds=self._conf.join_timeout))
        bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self._local_addr)
        logger.info("rendezvous epoch %d: node %d of %d", world.epoch, rank,
                    len(world.members))
        return RendezvousInfo(store, rank, len(world.members), bootstrap)

    def is_closed(self) -> bool:
        """See base class."""
        return self._run.view.end() is not None

    def set_closed(self) -> None:
        """See base class: ends the run, naming this node."""
        self._run.end(EndRecord("failed", f"torchrun's agent on node {self._node} closed the "
                                "rendezvous (its workers failed and its restarts are used "
                                "up)"))

    def num_nodes_waiting(self) -> int:
        """See base class: 1 once a world newer than the one returned exists."""
        current, returned = self._run.world(), self._world
        if current is None or returned is None:
            return 0
        return 1 if current.epoch > returned.epoch else 0

    def get_run_id(self) -> str:
        """See base class."""
        return self._run_id

    def shutdown(self) -> bool:
        """See base class: ends the run (whoever shuts down first) and leaves."""
        try:
            self._run.end(EndRecord("finished", f"torchrun's agent on node {self._node} shut "
                                    "the rendezvous down"))
            return True
        except EtcdUnavailableError as exc:
            logger.warning("could not close the rendezvous (%s)", exc)
            return False
        finally:
            self._run.leave()
