"""Every private or undocumented torch (and gloo) API elastic-run relies on, in one place.

Each is wrapped here and nowhere else, and each is pinned by
``tests/unit/test_torch_private_apis.py``: when a torch upgrade renames or changes one, that
test fails naming the use and what breaks, instead of a fallback quietly costing a feature.
``docs/rendezvous.md`` lists them with the reason for each and any public alternative.

* c10d's store classes, imported from ``torch._C._distributed_c10d`` only because torch's type
  stubs do not re-export them (they are the public ``torch.distributed`` classes).
* ``distributed_c10d._set_pg_timeout``: a generous timeout to build a world, then the short
  training one (:func:`set_pg_timeout`).
* ``distributed_c10d._abort_process_group``: cancels NCCL work blocked on a dead peer before a
  world is dropped (:func:`abort_process_group`).
* ``distributed_c10d._world.group_count``: torch's group-name counter, reset after a build
  that failed half-way (:func:`reset_group_names`).
* ``ProcessGroup._device_types`` / ``_get_backend``: a group's NCCL communicators, to abort
  them from a watch thread (:func:`accelerator_backends`), and ``Backend._group_start`` /
  ``_group_end`` around several aborts (:func:`abort_backends`).
* gloo's connections: plain TCP sockets of this process, which it neither aborts nor closes
  while its group is referenced (:func:`sever_sockets` and its helpers).
* DCP's ``FsspecReader`` (not exported by ``torch.distributed.checkpoint``) and
  ``DTensor._spec`` (:func:`dtensor_spec`).
* DTensor's sharding-propagation caches (``DTensor._op_dispatcher.sharding_propagator`` and
  ``torch._C._clear_DTensor_sharding_propagator_cache``): cleared when a sharded model moves
  to a new world (:func:`clear_dtensor_caches`).

**gloo's sockets.** gloo has no working abort: ``ProcessGroupGloo.abort()``, ``shutdown()`` and
``destroy_process_group()`` leave its TCP connections open for as long as any Python object
still references the group (a ``DistributedDataParallel`` in the training script's frame, an
in-flight checkpoint). A survivor that abandons a step because one peer died therefore keeps
the *other* peers blocked: one waiting in a collective for data from this survivor (a ring
all-reduce reads from one neighbour only) never sees the dead peer's reset, and waits out the
collective timeout while the survivor waits for it to build the next world.

So when a world is built, the sockets it opened are noted (``/proc/self/fd`` before and after,
minus connections to etcd), and when a worker abandons that world after a failure it shuts
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
from collections.abc import Collection, Iterator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, Store, TCPStore

if TYPE_CHECKING:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

__all__ = [
    "FsspecReader", "HashStore", "PrefixStore", "Store", "TCPStore", "WorldSockets",
    "abort_backends", "abort_process_group", "accelerator_backends", "clear_dtensor_caches",
    "dtensor_spec",
    "nccl_group", "opened_since", "reset_group_names", "set_pg_timeout", "sever_sockets",
    "socket_inodes",
]

logger = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    """Imports DCP's ``FsspecReader`` on first use: DCP pulls in DTensor, about 1.3
    CPU-seconds per process, and the agents and the torchrun plugin import this module for
    the stores alone."""
    if name == "FsspecReader":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- c10d ------------------------------------------------------------------------------------


def set_pg_timeout(timeout: timedelta, group: Any) -> bool:
    """Sets a built group's collective timeout locally (no barrier); returns whether this
    torch can (``distributed_c10d._set_pg_timeout``, present since torch 2.2; torchtitan
    uses the same seam)."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return False
    set_timeout(timeout, group)
    return True


def abort_process_group() -> bool:
    """Aborts every group of this process, cancelling NCCL work blocked on a dead peer (the
    only way: ``destroy`` may wait forever); returns whether this torch can
    (``distributed_c10d._abort_process_group``, present since torch 2.5)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return False
    abort()
    return True


def reset_group_names() -> None:
    """Makes this process name its next unnamed groups "0", "1", ... again (torch keys each
    group's rendezvous under that name; ``distributed_c10d._world.group_count``)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0


def accelerator_backends(group: Any) -> list[Any]:
    """The backends of ``group`` that own accelerator communicators (NCCL, XCCL...), not gloo.

    Args:
        group: A ``torch.distributed.ProcessGroup`` (or an object with its
            ``_device_types``/``_get_backend`` interface).
    """
    found: list[Any] = []
    for device_type in getattr(group, "_device_types", ()):
        kind = getattr(device_type, "type", str(device_type))
        if kind == "cpu":
            continue
        try:
            backend = group._get_backend(torch.device(kind))
        except RuntimeError:  # no backend for this device type
            continue
        name = str(backend.name()).lower()
        if name != "gloo" and all(backend is not b for b in found):
            found.append(backend)
    return found


@contextlib.contextmanager
def nccl_group(backends: list[Any]) -> Iterator[None]:
    """Runs the block inside one NCCL group (``Backend._group_start``/``_group_end``) when
    there are several backends, so that calls on their communicators cannot deadlock each
    other (pytorch#119797); a failing group end is logged, not raised."""
    grouped = len(backends) > 1 and hasattr(backends[0], "_group_start")
    if grouped:
        backends[0]._group_start()
    try:
        yield
    finally:
        if grouped:
            try:
                backends[0]._group_end()
            except Exception:
                logger.debug("ending the NCCL group failed", exc_info=True)


def abort_backends(backends: list[Any]) -> None:
    """Aborts accelerator communicators (``ncclCommAbort``), the way
    ``_abort_process_group`` does for a world, inside one NCCL group."""
    with nccl_group(backends):
        for backend in backends:
            try:
                backend.abort()
            except Exception:  # already aborted or shut down: nothing left to cancel
                logger.debug("aborting backend %r failed", backend, exc_info=True)


# -- DCP and DTensor -------------------------------------------------------------------------


def dtensor_spec(tensor: Any) -> Any:
    """A DTensor's placement spec (``DTensor._spec``): what DCP's own staging builds a host
    copy from without ``from_local()`` moving the shard back to the device."""
    return tensor._spec


def clear_dtensor_caches() -> list[str]:
    """Clears DTensor's sharding-propagation caches (the Python ones and the C++ dispatch fast
    path's); returns the names of those this torch lacks.

    torch compares device meshes by value (ranks, layout, device type, names), so a mesh of a
    new world equals one of an earlier world of the same size, and a cached propagation
    result (an output spec holding the *old* mesh object) would be reused: the new world's
    tensors would carry a mesh whose coordinate is this process's rank in the old world.
    Within one process torch assumes a rank never changes; in place it does.
    """
    # Imported here: DTensor pulls in sympy and torch.fx, about 0.7 CPU-seconds per
    # process, and every agent imports this module (for its TCPStore) without needing it.
    from torch.distributed.tensor import DTensor

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None),
                         "sharding_propagator", None)
    clears = {name: getattr(getattr(propagator, name, None), "cache_clear", None)
              for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached")}
    clears["_clear_DTensor_sharding_propagator_cache"] = getattr(
        torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    missing = []
    for name, clear in clears.items():
        if clear is None:
            missing.append(name)
        else:
            clear()
    return missing


# -- gloo's sockets (see the module docstring) -----------------------------------------------

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
