"""Loads and verifies a chaos run's last checkpoint.

    python -m tests.chaos.verify_checkpoint URL --weights PATH [--endpoint-url URL]

Checks that the newest committed checkpoint under ``URL`` (a directory or ``s3://``) is
the last step, that every file of its commit record has its recorded size and CRC32
(:meth:`~checkpointing.CheckpointManager.verify`), and that it loads into the chaos
workers' model (the float64 MLP of ``tests/integration/training/worker.py`` with Adam).
The result is ``{"step": S, "worst": D}``, ``D`` being the largest difference between the
loaded weights and ``--weights`` (the job's final weights), or ``{"error": "..."}``.

The in-place campaign verifies in its own process (:func:`verify_in_namespace`): torch and
DCP are imported once per campaign (this module's imports), not once per run. A process of
its own paid about 4.3 CPU-seconds of imports per run, which took over 30 s of wall time on
2 cores next to another campaign (load 20), while the load itself takes a fraction of a
second. The S3 server is only reachable from the run's namespaces, so the reads go through
an asyncio loop whose thread was born in the observer's namespace, handed to s3fs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import sys
import threading
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn

from checkpointing import CheckpointManager, ModelOptimizerState
from checkpointing.storage import STORAGE_RETRY_DEADLINE_S

if TYPE_CHECKING:
    from tests.support.netns import Host

#: What one verification may take, wall clock. It bounds: the reads of one checkpoint of
#: about 0.1 MB (latest.json, COMMIT.json, .metadata and 2-3 shards), any of which a storage
#: outage may hold for up to its retry deadline (``STORAGE_RETRY_DEADLINE_S``, 30 s; the
#: campaign's outages last at most 6 s and are over by the time the job ended), plus about
#: 0.5 CPU-second of CRCs, the DCP load and the comparison, which at a tenth of a core (2
#: cores, load 20: another campaign running beside this one) is 5 s; the rest is margin.
#: Not the imports: they are paid once, when the campaign imports this module.
VERIFY_LIMIT_S: Final = STORAGE_RETRY_DEADLINE_S + 30.0


def verify(url: str, weights: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """See the module docstring; returns the JSON-ready result."""
    manager = CheckpointManager(url, storage_options=storage_options, async_mode="disabled")
    try:
        latest = manager.latest()
        if latest is None:
            return {"error": f"no committed checkpoint under {url}"}
        manager.verify(latest)  # sizes and CRC32s of every file of the commit record
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        info = manager.load({"train": ModelOptimizerState(model, optimizer)})
        if info is None:
            return {"error": f"the checkpoint of step {latest.step} did not load"}
    finally:
        manager.close()
    want = torch.load(weights, weights_only=True)
    worst = max((model.state_dict()[k] - want[k]).abs().max().item() for k in want)
    return {"step": int(info.step), "worst": float(worst)}


def s3_options(endpoint: str) -> dict[str, Any]:
    """fsspec options for the chaos runs' S3 server (moto: any credentials)."""
    return {"client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "key": "x", "secret": "x"}


def _reported(url: str, weights: str, options: dict[str, Any]) -> dict[str, Any]:
    try:
        return verify(url, weights, options)
    except Exception as exc:  # reported, not raised: the campaign records it
        return {"error": f"{type(exc).__name__}: {exc}"}


class _IoLoop:
    """An asyncio loop on a thread started by the calling thread: started from a namespace's
    thread, its sockets (and its resolver's threads) are that namespace's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever,
                                        name="verify-checkpoint-io", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops the loop and every thread it started (the namespace is deleted after the
        run: nothing of this process may stay in it)."""
        done = asyncio.run_coroutine_threadsafe(self.loop.shutdown_default_executor(),
                                                self.loop)
        with contextlib.suppress(Exception):
            done.result(timeout=timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


def verify_in_namespace(host: Host, url: str, weights: str, *, endpoint: str | None = None,
                        limit_s: float = VERIFY_LIMIT_S) -> dict[str, Any]:
    """Verifies the checkpoint in this process, reaching storage from ``host``'s namespace.

    Args:
        host: The namespace host that reaches the S3 server (the observer).
        url: The checkpoint root (a directory, or ``s3://`` with ``endpoint``).
        weights: The job's final weights.
        endpoint: The S3 server's URL, for ``s3://`` roots.
        limit_s: See :data:`VERIFY_LIMIT_S`.

    Returns:
        The result (see the module docstring); an ``error`` if it took over ``limit_s``.
    """
    io = host.call(_IoLoop) if endpoint else None
    options = {**s3_options(endpoint), "loop": io.loop} if io is not None and endpoint else {}
    future = host.submit(_reported, url, weights, options)
    try:
        result = future.result(timeout=limit_s)
    except FutureTimeoutError:
        # The loop goes on: the verification still waits on it (the cluster reports it).
        return {"error": f"verifying the checkpoint took over {limit_s:g} s (the bound of its "
                         "storage reads, each retried for at most "
                         f"{STORAGE_RETRY_DEADLINE_S:g} s, and of its load on a loaded "
                         "2-core machine)"}
    if io is not None:
        from s3fs import S3FileSystem

        # s3fs closes a filesystem's session (on its loop) when the filesystem goes; DCP's
        # reader left one in fsspec's instance cache.
        S3FileSystem.clear_instance_cache()
        gc.collect()
        io.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.verify_checkpoint")
    parser.add_argument("url")
    parser.add_argument("--weights", required=True)
    parser.add_argument("--endpoint-url", default=None, help="the S3 server (s3:// URLs)")
    args = parser.parse_args(argv)
    options = s3_options(args.endpoint_url) if args.endpoint_url else {}
    result = _reported(args.url, args.weights, options)
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
