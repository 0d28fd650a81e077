"""Healing a newcomer in place: the streamed heal against the old ``torch.save`` broadcast.

Three worker processes on 127.0.0.1 in one gloo world (CPU): ranks 0 and 1 have trained a
few steps of an MLP with AdamW (the state: parameters and two moments, about ``--state-mib``
MiB), rank 2 is a newcomer (fresh weights, empty optimizer). Each run heals rank 2 twice, in
turn:

* ``broadcast`` (the baseline, the heal this repository shipped before): the source
  ``torch.save``\\ s its whole state into bytes, broadcasts the size and then the bytes to
  *every* rank, and the newcomer ``torch.load``\\ s them (``weights_only``) and loads them;
* ``streamed`` (:func:`elastic.inplace.heal.agree_and_heal`): a JSON header, then the tensors'
  bytes point to point to the ranks behind only, straight into the receiver's own tensors.

Measured on the newcomer: wall time of the heal call (after a barrier), and the growth of its
peak resident memory during the call (``VmHWM`` reset through ``/proc/self/clear_refs``); on
rank 1, which is up to date: bytes it received. Prints a Markdown table of medians over
``--runs`` with the ratio streamed / broadcast.

Reading the newcomer's memory row: both methods include torch's own initialisation of an
empty optimizer (``get_state_dict``/``set_state_dict`` give every parameter a zero gradient
and take one step at learning rate 0: the two Adam moments, 2/3 of the state, stay, and about
as much again is transient). The streamed heal adds nothing to that on CPU; a survivor that is
one step behind (optimizer already populated) grows by well under a MiB
(``tests/unit/elastic/test_inplace_heal_gloo.py``).

Usage::

    python benchmarks/heal_transfer.py [--state-mib 192] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MiB = 1 << 20


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _broadcast_heal(my_step: int, state: dict[str, Any], group: dist.ProcessGroup) -> int:
    """The baseline: the heal before the streamed one. Returns the bytes this rank received."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([my_step], dtype=torch.int64), group=group)
    steps = [int(t.item()) for t in gathered]
    best = max(steps)
    source = steps.index(best)
    if rank == source:
        buffer = io.BytesIO()
        torch.save({k: v.state_dict() for k, v in state.items()}, buffer)
        payload = buffer.getvalue()
        size = torch.tensor([len(payload)], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=source, group=group)
    if rank == source:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=source, group=group)
    if my_step < best:
        plain = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
        for key, target in state.items():
            target.load_state_dict(plain[key])
    return 0 if rank == source else int(size.item())


def _worker(rank: int, port: int, state_mib: int, runs: int, out: str) -> None:
    from checkpointing import ModelOptimizerState
    from elastic.inplace.heal import agree_and_heal

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3,
                            timeout=timedelta(seconds=600))
    group = dist.group.WORLD
    assert group is not None
    width = int((state_mib * MiB / 4 / 3 / 2) ** 0.5)  # two width x width layers, 3 copies

    def build(seed: int, steps: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, width))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(steps):
            model(torch.randn(4, width)).square().mean().backward()
            optim.step()
            optim.zero_grad()
        return {"train": ModelOptimizerState(model, optim)}

    state = build(0, 3) if rank < 2 else {}
    rows: list[dict[str, Any]] = []
    for _ in range(runs):
        for method in ("broadcast", "streamed"):
            if rank == 2:
                state = build(1, 0)  # a fresh newcomer each time
            my_step = 3 if rank < 2 else -1
            dist.barrier(group)
            Path("/proc/self/clear_refs").write_text("5")
            before = _kib("VmRSS")
            started = time.perf_counter()
            if method == "broadcast":
                received = _broadcast_heal(my_step, state, group)
            else:
                received = agree_and_heal(my_step, state, group).received_bytes
            rows.append({"method": method, "seconds": time.perf_counter() - started,
                         "peak_growth": (_kib("VmHWM") - before) * 1024,
                         "received": received})
    dist.barrier(group)
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=int, default=192)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import tempfile

    out = tempfile.mkdtemp(prefix="heal-bench-")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, server.port, args.state_mib, args.runs, out))
             for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1800)
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs):
        print(f"a worker failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
        return 1
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(3)]

    def median(rank: int, method: str, key: str) -> float:
        return statistics.median(row[key] for row in ranks[rank] if row["method"] == method)

    measures = [("newcomer: heal time (s)", 2, "seconds", 1.0),
                ("newcomer: peak RSS growth (MiB)", 2, "peak_growth", MiB),
                ("source: peak RSS growth (MiB)", 0, "peak_growth", MiB),
                ("up-to-date rank: bytes received (MiB)", 1, "received", MiB)]
    table = {name: {m: median(rank, m, key) / scale for m in ("broadcast", "streamed")}
             for name, rank, key, scale in measures}
    print(f"heal of a newcomer, state {args.state_mib} MiB, 3 gloo ranks on loopback, "
          f"median of {args.runs} runs\n")
    print("| measure | broadcast (before) | streamed | streamed / broadcast |")
    print("| --- | --- | --- | --- |")
    for name, values in table.items():
        ratio = values["streamed"] / values["broadcast"] if values["broadcast"] else float("nan")
        print(f"| {name} | {values['broadcast']:.3f} | {values['streamed']:.3f} | "
              f"{ratio:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"state_mib": args.state_mib, "runs": args.runs,
                                         "medians": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
