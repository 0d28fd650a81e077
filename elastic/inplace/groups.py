"""Tear down and rebuild the process groups of a worker that stays alive.

Each world (epoch) gets fresh groups whose rendezvous runs on the TCPStore the world record
names (``PrefixStore(f"e{epoch}/", TCPStore)``): a spare store server hosted by the agent of
one of the world's nodes, never by a worker, and never handed to two worlds (an agent
replaces its spare once a world names it). So a new epoch can never read an old epoch's
addresses, a worker's death never takes the store with it, and the rendezvous of a world
costs etcd nothing (a TCPStore answers in microseconds, where each key on etcd would be a
Raft write). If the hosting node dies while the world is built, the build fails and the
leader writes the next world on another node's store. Building a 2-rank gloo world this way
takes about 30 ms on loopback.

Tear-down must not hang on a dead peer. gloo raises at once when a peer's connection resets
(a SIGKILLed process), and destroying its groups is local. NCCL communicators can block in
``destroy`` while a kernel waits for a dead peer, so :func:`abort_groups` aborts them first
(``torch.distributed.distributed_c10d._abort_process_group``, private but present since torch
2.5; the only way to cancel pending NCCL work). NCCL groups are built with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (except under ``--elastic-mode restart``, which keeps
torch's default): the watchdog never tears a survivor down, and a collective blocked on a
member that is gone is cancelled by this worker itself, from a watch thread, through the
world's :class:`~elastic.inplace.abort.WorldAbort`. The CPU tests exercise gloo; the NCCL
path has GPU tests (``tests/gpu``, marker ``gpu``) that skip where CUDA is absent.
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import Final

import torch
import torch.distributed as dist

from elastic import env
from elastic.inplace.abort import WorldAbort
from elastic.process_group import ProcessGroups, set_nccl_error_handling
from torch_private import (
    HashStore,
    PrefixStore,
    Store,
    abort_process_group,
    reset_group_names,
    set_pg_timeout,
)

__all__ = ["GLOO_CONNECT_WAIT_FACTOR", "abort_groups", "build_groups",
           "nccl_handling_in_place", "set_group_timeout", "standby_groups"]

logger = logging.getLogger(__name__)

#: How many times its timeout gloo (torch 2.13) waits for a peer that should connect to it:
#: a 4 s group waited 20 s, a 40 s group 200 s, for a peer that died after publishing its
#: address (measured here).
GLOO_CONNECT_WAIT_FACTOR: Final = 5.0
#: The timeout groups are built with once every member is known to be there (connecting
#: takes milliseconds then); a member that dies meanwhile costs at most 5x this.
_CONNECT_TIMEOUT_S: Final = 2.0


def build_groups(
    backend: str, *, store: Store, epoch: int, rank: int, world_size: int,
    device: torch.device, timeout: timedelta, world_abort: WorldAbort | None = None,
) -> ProcessGroups:
    """Initialises the default group and a gloo checkpoint group for world ``epoch``.

    Args:
        world_abort: The world's abort handle, created before the build (and before ``store``
            was connected, so that an abort during the build also severs the store
            connection); it is told the groups once they exist.

    Raises:
        torch.distributed.DistStoreError: (or another ``RuntimeError``) when a member does
            not arrive within ``timeout``.
        WorldAbortedError: When ``world_abort`` was aborted during the build.
    """
    if backend == "nccl":
        set_nccl_error_handling(in_place=nccl_handling_in_place())
    store.set_timeout(timeout)
    _reset_group_names()
    prefixed = PrefixStore(f"e{epoch}/", store)
    # gloo waits for a peer that should connect to it for GLOO_CONNECT_WAIT_FACTOR times the
    # group's timeout, and nothing can cut that wait short (it waits on no socket): a member
    # that died between publishing its address and connecting would hold this build 5x
    # longer than asked. So the members first meet on the store, which waits the whole
    # timeout and which an abort cuts short (its connection is severed); once all are there
    # the groups are built with a short timeout, then given the full one.
    _meet(prefixed, world_size, timeout)
    connect = timedelta(seconds=min(timeout.total_seconds(), _CONNECT_TIMEOUT_S))
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world_size,
        timeout=connect if backend == "gloo" else timeout,
        device_id=device if device.type == "cuda" else None,
    )
    default = dist.group.WORLD
    assert default is not None
    checkpoint = dist.new_group(backend="gloo", timeout=connect)
    set_group_timeout(timeout, default, checkpoint)
    if world_abort is not None:
        world_abort.built(default, checkpoint)
    return ProcessGroups(backend=backend, default=default, checkpoint=checkpoint)


def nccl_handling_in_place() -> bool:
    """Whether this worker's NCCL groups get the in-place error handling (``0``).

    Unless elastic-run runs the job in restart mode (``--elastic-mode restart``), where torch's
    default (``3``: a failed or timed-out collective ends the worker, and the agent restarts
    the round) is kept. In ``auto`` mode a world built before its workers declared themselves
    is upgraded to in place without being rebuilt, so its groups need ``0`` from the start.
    """
    return os.environ.get(env.MODE, "auto") != "restart"


def _meet(store: Store, world_size: int, timeout: timedelta) -> None:
    """Returns once every one of ``world_size`` members called it on ``store`` (a barrier).

    Raises:
        torch.distributed.DistStoreError: If a member did not come within ``timeout``.
    """
    if store.add("arrived", 1) == world_size:
        store.set("all_arrived", "1")
    store.wait(["all_arrived"], timeout)


def set_group_timeout(timeout: timedelta, *groups: dist.ProcessGroup) -> None:
    """Sets the collective timeout of built ``groups`` (locally: no barrier).

    Uses a private torch API (:func:`torch_private.set_pg_timeout`); without it the groups
    keep the timeout they were built with.
    """
    for group in groups:
        if not set_pg_timeout(timeout, group):
            logger.warning("torch has no _set_pg_timeout: groups keep their build timeout")
            return


def standby_groups(backend: str, device: torch.device, timeout: timedelta) -> ProcessGroups:
    """Groups of a world of this process alone, on a local store: a joiner's until admitted.

    They let ``elastic.init()`` return before the joiner is admitted (scripts may build a
    ``CheckpointManager`` on ``ctx.checkpoint_group``); admission destroys them.
    """
    return build_groups(backend, store=HashStore(), epoch=0, rank=0, world_size=1,
                        device=device, timeout=timeout)


def _reset_group_names() -> None:
    """Makes this process name its next groups "0", "1", ... again.

    torch names unnamed groups from a per-process counter and keys each group's rendezvous
    under that name. ``destroy_process_group()`` resets the counter, but a build that failed
    half-way (a member died) leaves no default group to destroy and the counter advanced: the
    next world's members would then rendezvous under different names and never meet. Every
    member builds a world's groups in the same order from a fresh counter.
    """
    reset_group_names()


def abort_groups(world_abort: WorldAbort | None = None) -> None:
    """Drops every group of this process without waiting for peers (safe with none).

    Args:
        world_abort: The groups' abort handle: released first, so that a watch thread's
            abort never runs on groups this thread is destroying.
    """
    if world_abort is not None:
        world_abort.release()
    if not (dist.is_available() and dist.is_initialized()):
        return
    backend = dist.get_backend()
    if backend == "nccl":
        # NCCL: cancel in-flight kernels first, or destroy may wait forever on a dead peer.
        with contextlib.suppress(Exception):
            if abort_process_group():
                return
    try:
        dist.destroy_process_group()
    except Exception:  # a broken group may fail to destroy cleanly; it is dropped either way
        logger.debug("destroying the old process groups failed", exc_info=True)
