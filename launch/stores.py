"""TCPStore servers an agent hosts for the worlds' process groups.

Each world's process groups rendezvous on a TCPStore server hosted by the agent of one of its
members, named in the world record. The agent keeps one *spare* server bound at all times and
publishes its port in its node record; the leader names a spare that no world has used, so a
server is only ever used by one world and a new world can never read an older world's keys
(the restart hang of pytorch#135712). Once a world names the spare, the agent binds a new
spare and publishes it; the servers of recent worlds stay up (a world's store may be used
until its groups are torn down), older ones are closed.

Hosting the store in the agent rather than in a worker means a worker crash never takes the
store down, and workers need no etcd access at all.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from datetime import timedelta
from typing import Final

from torch_private import TCPStore

__all__ = ["StorePool"]

logger = logging.getLogger(__name__)

_KEEP: Final = 3
_TIMEOUT: Final = timedelta(minutes=5)


class StorePool:
    """A spare TCPStore server plus the servers of recent worlds.

    Args:
        host: The address the servers listen on and workers dial.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._spare = self._bind()
        self._used: OrderedDict[int, TCPStore] = OrderedDict()

    def _bind(self) -> TCPStore:
        return TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                        timeout=_TIMEOUT, use_libuv=True)

    @property
    def spare_port(self) -> int:
        """Port of the spare server (published in the node record)."""
        with self._lock:
            return int(self._spare.port)

    def claim(self, port: int, epoch: int) -> bool:
        """A world (``epoch``) named the server on ``port``: bind a new spare.

        Returns:
            Whether the spare changed (its new port must be published).
        """
        with self._lock:
            if int(self._spare.port) != port:
                return False
            self._used[epoch] = self._spare
            self._spare = self._bind()
            while len(self._used) > _KEEP:
                old_epoch, _ = self._used.popitem(last=False)
                logger.debug("closed the store server of world epoch %d", old_epoch)
        logger.info("world epoch %d uses this node's store on port %d; new spare on port %d",
                    epoch, port, self.spare_port)
        return True

    def close(self) -> None:
        """Drops every server (their threads stop when the objects are freed)."""
        with self._lock:
            self._used.clear()
