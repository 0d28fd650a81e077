"""Severing a broken world's gloo connections, so that peers blocked on this process fail now.

gloo has no working abort: ``ProcessGroupGloo.abort()``, ``shutdown()`` and
``destroy_process_group()`` leave its TCP connections open for as long as any Python object
still references the group (a ``DistributedDataParallel`` in the training script's frame, an
in-flight checkpoint). A survivor that abandons a step because one peer died therefore keeps
the *other* peers blocked: one waiting in a collective for data from this survivor (a ring
all-reduce reads from one neighbour only) never sees the dead peer's reset, and waits out the
collective timeout while the survivor waits for it to build the next world.

So when a world is built, the sockets it opened are noted (``/proc/self/fd`` before and after,
minus connections to etcd), and when this worker abandons that world after a failure it shuts
them down (``shutdown(2)``, not ``close``: the fds stay gloo's to close). Every peer reading from
or writing to this worker fails at once with "connection closed by peer" and reconfigures too.
Only failure paths sever: on a planned change every rank leaves the world at the same agreed
boundary and its groups are destroyed normally.

Only connected TCP sockets are ever touched: never a listener (gloo's accept thread treats an
error on its listener as fatal and aborts the whole process), never a Unix socket (a worker's
channel to its agent). A noted socket is shut down through a duplicate of its fd whose inode is
checked *after* duplicating, so a socket that gloo closed meanwhile (and whose fd number was
reused by something else) is never hit, even while another thread destroys the groups.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Collection, Mapping

__all__ = ["WorldSockets", "opened_since", "sever_sockets", "socket_inodes"]

logger = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def socket_inodes() -> dict[int, int]:
    """This process's socket file descriptors and their inodes (empty where /proc is absent)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            found[int(name)] = int(target[len("socket:["):-1])
    return found


def _peer_port(fd: int) -> int | None:
    """The remote port of a connected TCP socket, ``None`` for anything else."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                      socket.AF_INET6):
                return None
            try:
                return int(sock.getpeername()[1])
            except OSError:
                # Not connected: gloo's listener. Never shut it down: its accept thread
                # treats the error as fatal and aborts the whole process.
                return None
    except OSError:
        return None


def opened_since(before: Mapping[int, int], *, skip_ports: Collection[int] = (),
                 skip_fds: Collection[int] = ()) -> dict[int, int]:
    """The connected TCP sockets opened since ``before`` (a :func:`socket_inodes` snapshot).

    Args:
        before: The snapshot taken before the world's groups (and store client) were built.
        skip_ports: Remote ports never to touch (etcd's, a store shared across worlds).
        skip_fds: File descriptors never to touch (a channel to the node agent).

    Returns:
        fd -> inode of every socket to shut down if the world breaks.
    """
    found: dict[int, int] = {}
    for fd, inode in socket_inodes().items():
        if before.get(fd) == inode or fd in skip_fds:
            continue
        port = _peer_port(fd)
        if port is None or port in skip_ports:
            continue
        found[fd] = inode
    return found


def sever_sockets(sockets: Mapping[int, int]) -> int:
    """Shuts down every socket of ``sockets`` (fd -> inode) that is still the same one.

    Returns:
        How many were shut down.
    """
    severed = 0
    for fd, inode in sockets.items():
        try:
            dup = os.dup(fd)
        except OSError:  # closed since
            continue
        # Checked on the duplicate: from here on the socket cannot be closed and replaced
        # under us, so a reused fd number is never mistaken for the noted socket.
        with socket.socket(fileno=dup) as sock:
            try:
                same = os.fstat(dup).st_ino == inode
            except OSError:
                same = False
            if not same:
                continue
            with contextlib.suppress(OSError):  # already shut down or reset by the peer
                sock.shutdown(socket.SHUT_RDWR)
                severed += 1
    return severed


class WorldSockets:
    """The TCP sockets one world's process groups opened, to shut down if it breaks.

    Args:
        before: :func:`socket_inodes` just before the groups were built.
        after: :func:`socket_inodes` just after.
        skip_ports: Remote ports never to touch (etcd's: the store the groups met on).
    """

    def __init__(self, before: dict[int, int], after: dict[int, int],
                 skip_ports: Collection[int] = ()) -> None:
        self._sockets: dict[int, int] = {}
        for fd, inode in after.items():
            if before.get(fd) == inode:
                continue
            port = _peer_port(fd)
            if port is None or port in skip_ports:
                continue
            self._sockets[fd] = inode

    def __len__(self) -> int:
        return len(self._sockets)

    def sever(self) -> int:
        """Shuts down every noted socket that is still the same one; returns how many."""
        severed = sever_sockets(self._sockets)
        self._sockets.clear()
        return severed
