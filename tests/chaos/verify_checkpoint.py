"""Loads and verifies a chaos run's last checkpoint; prints one JSON line (a subprocess).

    python -m tests.chaos.verify_checkpoint URL --weights PATH [--endpoint-url URL]

Checks that the newest committed checkpoint under ``URL`` (a directory or ``s3://``) is
the last step, that every file of its commit record has its recorded size and CRC32
(:meth:`~checkpointing.CheckpointManager.verify`), and that it loads into the chaos
workers' model (the float64 MLP of ``tests/integration/training/worker.py`` with Adam).
Prints ``{"step": S, "worst": D}``, ``D`` being the largest difference between the loaded
weights and ``--weights`` (the job's final weights), or ``{"error": "..."}`` (exit 1).

It runs as its own process so that the in-place campaign can run it inside the namespace
that reaches the run's S3 server (fsspec's I/O thread would otherwise open its connections
from the test process's own namespace).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def verify(url: str, weights: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """See the module docstring; returns the JSON-ready result."""
    import torch
    from torch import nn

    from checkpointing import CheckpointManager, ModelOptimizerState

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.verify_checkpoint")
    parser.add_argument("url")
    parser.add_argument("--weights", required=True)
    parser.add_argument("--endpoint-url", default=None, help="the S3 server (s3:// URLs)")
    args = parser.parse_args(argv)
    options: dict[str, Any] = {}
    if args.endpoint_url:
        options = {"client_kwargs": {"endpoint_url": args.endpoint_url}, "key": "x",
                   "secret": "x"}
    try:
        result = verify(args.url, args.weights, options)
    except Exception as exc:  # reported, not raised: the campaign records it
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
