"""``elastic.init()``: one call that turns elastic-run's (or torchrun's) environment into a
ready worker: its world, its device and its process groups.

Under elastic-run the world comes from the node agent (:mod:`elastic.agent_link`) and the
worker may reconfigure in place later (:mod:`elastic.inplace`); under plain torchrun the
groups are built from ``env://`` once.
"""

from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta

import torch

from elastic import env
from elastic.context import ElasticContext, World
from elastic.process_group import build_process_groups
from elastic_errors import ConfigError

__all__ = ["init"]

logger = logging.getLogger(__name__)


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"backend ({backend!r}) must be 'nccl', 'gloo' or None (auto).")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "backend ('nccl') needs CUDA, which is not available; pass None or 'gloo'."
        )
    return backend


def init(
    backend: str | None = None,
    *,
    init_timeout: timedelta = timedelta(minutes=10),
    train_timeout: timedelta | None = timedelta(seconds=60),
    inplace: bool = False,
) -> ElasticContext:
    """Joins the current round: reads the environment, sets the device, builds the groups.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or ``None`` (NCCL when CUDA is available, else gloo).
        init_timeout: Timeout of process-group creation and of collectives until the first
            step has completed on every rank.
        train_timeout: Timeout of training collectives after the first step, so that a dead
            peer surfaces as an error within this time rather than a hang (gloo notices a
            closed connection at once; NCCL relies on this timeout). ``None`` keeps
            ``init_timeout``.
        inplace: Declare in-place capability at once. Not needed with ``ElasticLoop``, which
            declares it when it is built: under elastic-run's default mode (``auto``) every
            ``ElasticLoop`` script runs in place and other scripts restart;
            ``--elastic-mode inplace`` declares every script at ``init``, ``restart`` none.

    Returns:
        The context; its groups are destroyed at interpreter exit (or by ``close()``).

    Raises:
        ConfigError: If the backend or the environment is invalid.
    """
    if init_timeout <= timedelta(0) or (
        train_timeout is not None and train_timeout <= timedelta(0)
    ):
        raise ConfigError(
            f"timeouts (init {init_timeout}, train {train_timeout}) must be positive."
        )
    chosen = _pick_backend(backend)
    world = World.from_env()
    if chosen == "nccl":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    from elastic.agent_link import link_from_env

    link = link_from_env()
    if link is not None:
        # Under elastic-run: the world comes from the node agent, never from etcd.
        from elastic.inplace.controller import init_inplace

        mode = os.environ.get(env.MODE, "auto")
        ctx = init_inplace(link, chosen, device, init_timeout=init_timeout,
                           train_timeout=train_timeout,
                           declare=mode == "inplace" or (mode == "auto" and inplace))
        atexit.register(ctx.close)
        return ctx
    groups = build_process_groups(
        chosen, rank=world.rank, world_size=world.world_size, device=device,
        init_timeout=init_timeout,
    )
    ctx = ElasticContext(world, groups, device, train_timeout=train_timeout)
    atexit.register(ctx.close)
    logger.info(
        "joined round %d of run %s as rank %d of %d (backend %s, restart %d)",
        world.round, world.run_id, world.rank, world.world_size, chosen, world.restart_count,
    )
    return ctx
