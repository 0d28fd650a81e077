"""Process groups of one elastic round: the training group and a gloo group for checkpoints.

Timeouts matter more than usual here: a peer that died must surface as an error within
seconds, not after torch's 10-minute default, so that the agent can start the next round.
Initialisation gets a long timeout (all ranks of a round start at different speeds); once the
first step has run on every rank, :func:`lower_timeouts` shortens it for training collectives
(torchtitan's ``set_pg_timeouts`` pattern: barrier first so no slow rank trips the new value).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from torch_private import set_pg_timeout

__all__ = [
    "NCCL_ASYNC_ERROR_HANDLING_ENV",
    "ProcessGroups",
    "build_process_groups",
    "destroy_process_groups",
    "lower_timeouts",
    "set_nccl_error_handling",
]

logger = logging.getLogger(__name__)

NCCL_ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""What ProcessGroupNCCL's watchdog does when a collective fails or times out: ``0`` nothing,
``1`` abort the communicators and tear the process down, ``2`` abort the communicators only,
``3`` (torch's default) tear the process down without aborting them. Read when a group is
constructed."""

# Restart mode: a failed collective ends the worker and the agent restarts every worker of the
# round anyway; 3 skips ncclCommAbort, which can itself hang on a broken communicator.
_RESTART_ERROR_HANDLING = "3"
# In place: the worker aborts its own communicators (elastic.inplace.abort). torch documents
# _abort_process_group for 0 only; 1 and 3 would tear a survivor down, and 2 would abort
# behind the back of WorldAbort, so that a step computed on garbage could count as done.
_INPLACE_ERROR_HANDLING = "0"


def set_nccl_error_handling(*, in_place: bool) -> None:
    """Sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` for the NCCL groups this process builds next.

    Restart mode keeps a value the user set. In place the value is forced to ``0``, with a
    warning if the user set another: with any other value a survivor could be torn down by the
    watchdog, or its step applied on an aborted collective's output.
    """
    if not in_place:
        os.environ.setdefault(NCCL_ASYNC_ERROR_HANDLING_ENV, _RESTART_ERROR_HANDLING)
        return
    current = os.environ.get(NCCL_ASYNC_ERROR_HANDLING_ENV)
    if current not in (None, _INPLACE_ERROR_HANDLING):
        logger.warning("%s=%s ignored: in-place workers abort their own NCCL communicators "
                       "and need %s", NCCL_ASYNC_ERROR_HANDLING_ENV, current,
                       _INPLACE_ERROR_HANDLING)
    os.environ[NCCL_ASYNC_ERROR_HANDLING_ENV] = _INPLACE_ERROR_HANDLING


@dataclass(kw_only=True, slots=True, frozen=True)
class ProcessGroups:
    """The groups of one round.

    Attributes:
        backend: Backend of the training group (``"nccl"`` or ``"gloo"``).
        default: The default (training) process group.
        checkpoint: A gloo group for checkpoint collectives, off the training stream.
    """

    backend: str
    default: dist.ProcessGroup
    checkpoint: dist.ProcessGroup


def build_process_groups(
    backend: str, *, rank: int, world_size: int, device: torch.device, init_timeout: timedelta
) -> ProcessGroups:
    """Initialises the default group from torchrun's ``env://`` and a gloo checkpoint group."""
    if backend == "nccl":
        set_nccl_error_handling(in_place=False)
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world_size,
        timeout=init_timeout, device_id=device if device.type == "cuda" else None,
    )
    default = dist.group.WORLD
    assert default is not None
    # Always a second group, even under gloo: DCP's collectives run on the checkpoint I/O
    # thread and must not interleave with the training thread's on one communicator.
    checkpoint = dist.new_group(backend="gloo", timeout=init_timeout)
    return ProcessGroups(backend=backend, default=default, checkpoint=checkpoint)


def lower_timeouts(groups: ProcessGroups, timeout: timedelta) -> None:
    """Shortens the training group's timeout after a barrier (so slow starters do not trip it)."""
    dist.barrier(group=groups.default)
    if not set_pg_timeout(timeout, groups.default):
        logger.warning("this torch cannot lower process-group timeouts; keeping the init value")


def destroy_process_groups() -> None:
    """Destroys every group of this process (safe to call twice or with none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
