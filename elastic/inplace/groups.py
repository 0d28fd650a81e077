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
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: the watchdog never tears a survivor down, and a
collective blocked on a member that is gone is cancelled by this worker itself, from a watch
thread, through the world's :class:`~elastic.inplace.abort.WorldAbort`. Only gloo on CPU is
exercised by this repository's tests; the NCCL path is written but has not been run on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, Store

from elastic.inplace.abort import WorldAbort
from elastic.process_group import ProcessGroups, set_nccl_error_handling

__all__ = ["abort_groups", "build_groups", "standby_groups"]

logger = logging.getLogger(__name__)


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
        set_nccl_error_handling(in_place=True)
    store.set_timeout(timeout)
    _reset_group_names()
    prefixed = PrefixStore(f"e{epoch}/", store)
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    default = dist.group.WORLD
    assert default is not None
    checkpoint = dist.new_group(backend="gloo", timeout=timeout)
    if world_abort is not None:
        world_abort.built(default, checkpoint)
    return ProcessGroups(backend=backend, default=default, checkpoint=checkpoint)


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
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0


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
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            with contextlib.suppress(Exception):
                abort()
                return
    try:
        dist.destroy_process_group()
    except Exception:  # a broken group may fail to destroy cleanly; it is dropped either way
        logger.debug("destroying the old process groups failed", exc_info=True)
