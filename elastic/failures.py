"""Which exceptions a peer's failure can cause (the type half of telling failures apart).

A collective that fails because a peer died raises one of a few types: gloo reports a reset
or closed connection as a plain ``RuntimeError``, NCCL and stores raise ``DistError``
subclasses. Whether such a failure *was* a peer's is then decided by membership evidence
(:meth:`elastic.inplace.controller.InPlaceController.confirm_peer_failure`), never by the
message's text. Out-of-memory errors (also ``RuntimeError``s), a script's own ``RuntimeError``
subclasses, and every other type are the script's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["is_peer_failure_type"]


def is_peer_failure_type(exc: BaseException) -> bool:
    """Whether ``exc`` is of a type a dead peer can cause in a collective."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    return isinstance(exc, dist.DistError) or type(exc) is RuntimeError
