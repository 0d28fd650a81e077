"""Checkpoint blocking time for CUDA state: ours against a device-to-pinned-host copy floor and
against DCP ``async_save`` with its cached pinned staging, in the same run.

For each ``--sizes`` entry (GiB of model plus Adam state on the GPU: float32 ``4096 x 4096``
weights and their biases, each with ``exp_avg`` and ``exp_avg_sq``, so parameters are a third
of it), measured interleaved round-robin so that the machine's state hits every method alike:

* the floor: every tensor copied (``non_blocking``) into preallocated, already touched pinned
  host tensors, then the stream waited for: the least a snapshot of device state can block;
* ours, :class:`checkpointing.CheckpointManager`: blocking = until ``save()`` returns (the
  state is in its reused pinned buffers), durable = until ``committed`` resolves;
* DCP ``async_save`` with ``FileSystemWriter(cache_staged_state_dict=True)``: its pinned host
  copy is kept across saves (torch's ``BlockingAsyncStager``; the writer is reused, with a new
  ``checkpoint_id`` per save);
* DCP ``async_save`` with ``async_stager=DefaultStager(StagingOptions(use_pinned_memory=True,
  use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True))``: torch's
  current staging API (pinned storages cached per source storage, non-blocking copies, one
  device synchronisation), reused across saves.

Blocking is host time from a synchronised device (``torch.cuda.synchronize()`` first) until
the call returns, which is when each method lets the training thread change the state
again. Each method gets one unmeasured warm-up save (it allocates and pins its buffers there,
as in training), then ``--repeats`` measured ones; the table shows medians, and the ratios
to the floor (the goal: ours at most 1.5x). Everything is written under a temporary directory
(``--tmp-dir``) that is removed at the end; durable times depend on that disk.

Host memory: the floor and the three methods each keep a pinned copy of the state, so about
4x the largest size is pinned (64 GiB for 16 GiB); a size that does not fit the available
memory is refused before anything is allocated. Disk: each save writes the state once (the
16 GiB size writes 16 GiB x 3 methods x (repeats + 1)).

Without CUDA it prints one line and exits 0 (with ``--json`` it writes ``{"skipped": "no CUDA
device"}``), which ``benchmarks/run_all.py`` reports as "skipped: no CUDA device".

Usage::

    python benchmarks/cuda_checkpoint.py [--sizes 1,4,16] [--repeats 3] [--settle 1]
        [--tmp-dir DIR] [--out table.md] [--json out.json]

``--json`` writes ``{"repeats", "settle", "device", "sizes": [{"size_gib", "bytes",
"methods": {name: {"blocking_s", "durable_s", "blocking", "durable"}}}]}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.checkpoint_throughput import Ours, Timing, settle

GiB = 1 << 30
SKIPPED = "no CUDA device"
FLOOR = "floor: device-to-pinned-host copy"
OURS = "ours (CheckpointManager)"
DCP_CACHED = "DCP async_save, cache_staged_state_dict=True"
DCP_STAGER = "DCP async_save, DefaultStager (pinned, non-blocking)"
_D = 4096  # layer width: 64 MiB of float32 per weight matrix (a power of two: pinned
# allocations are rounded up to one)
_COPIES = 4  # pinned host copies of the state: the floor's and each method's

Method = Callable[[dict[str, torch.Tensor], str], tuple[float, float]]


def build_state(size_gib: float, device: torch.device) -> dict[str, torch.Tensor]:
    """A flat CUDA state dict: weights and biases with Adam's two moments, about ``size_gib``."""
    per_layer = (_D * _D + _D) * 4 * 3
    layers = max(1, round(size_gib * GiB / per_layer))
    state: dict[str, torch.Tensor] = {}
    generator = torch.Generator(device=device).manual_seed(0)
    for i in range(layers):
        for kind in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
            state[f"{kind}.layers.{i}.weight"] = torch.empty(
                _D, _D, device=device).normal_(generator=generator)
            state[f"{kind}.layers.{i}.bias"] = torch.zeros(_D, device=device)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (what can be pinned without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def release_host_memory() -> None:
    """Frees the pinned blocks torch's host allocator keeps cached (between sizes)."""
    gc.collect()
    torch.cuda.empty_cache()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


# ------------------------------------------------------------------------------------ methods
class Floor:
    """Copies into pinned host tensors allocated (and touched) once."""

    def __init__(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        self.device = device
        self.dst = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                    for k, v in state.items()}

    def __call__(self, state: dict[str, torch.Tensor], where: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        for k, v in state.items():
            self.dst[k].copy_(v, non_blocking=True)  # device to pinned host, on the stream
        # The copies were queued on the current stream; the snapshot exists once it is done.
        torch.cuda.current_stream(self.device).synchronize()
        dt = time.perf_counter() - t0
        return dt, dt


class DcpCached:
    """``async_save`` staging through ``FileSystemWriter(cache_staged_state_dict=True)``."""

    def __init__(self) -> None:
        self.writer: Any = None

    def __call__(self, state: dict[str, torch.Tensor], where: str) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        if self.writer is None:  # one writer, so one staging cache, for every save
            self.writer = FileSystemWriter(where, cache_staged_state_dict=True)
        t0 = time.perf_counter()
        fut: Any = dcp.async_save(state, checkpoint_id=where, storage_writer=self.writer,
                                  no_dist=True)
        blocking = time.perf_counter() - t0
        fut.result()
        return blocking, time.perf_counter() - t0


class DcpStager:
    """``async_save`` staging through one reused ``DefaultStager`` (pinned, non-blocking)."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=True))

    def __call__(self, state: dict[str, torch.Tensor], where: str) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        t0 = time.perf_counter()
        fut: Any = dcp.async_save(state, storage_writer=FileSystemWriter(where),
                                  async_stager=self.stager, no_dist=True)
        blocking = time.perf_counter() - t0
        fut.result()
        return blocking, time.perf_counter() - t0

    def close(self) -> None:
        self.stager.close()


def run_size(size_gib: float, repeats: int, tmp: str, pause: float,
             device: torch.device) -> tuple[int, dict[str, Timing], dict[str, str]]:
    """Times every method on one state size; a DCP method that raises is dropped from the
    remaining repeats and reported as failed (the floor and ours must not fail)."""
    state = build_state(size_gib, device)
    size = nbytes(state)
    floor = Floor(state, device)
    ours = Ours(os.path.join(tmp, f"ours-{size_gib:g}"))
    cached, stager = DcpCached(), DcpStager()
    methods: dict[str, Method] = {FLOOR: floor, OURS: ours, DCP_CACHED: cached,
                                  DCP_STAGER: stager}
    timings = {name: Timing() for name in methods}
    failed: dict[str, str] = {}
    try:
        for rep in range(repeats + 1):
            for name, fn in methods.items():
                if name in failed:
                    continue
                where = os.path.join(tmp, uuid.uuid4().hex[:8])
                settle(pause)
                torch.cuda.synchronize(device)  # nothing queued is counted against a method
                try:
                    blocking, durable = fn(state, where)
                except Exception as exc:  # a baseline's bug in this torch must not hide ours
                    if name in (FLOOR, OURS):
                        raise
                    failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
                    print(f"  {size_gib:g} GiB rep {rep} {name}: failed: {failed[name]}",
                          file=sys.stderr, flush=True)
                    shutil.rmtree(where, ignore_errors=True)
                    continue
                if rep > 0:  # rep 0 is the warm-up
                    timings[name].add(blocking, durable)
                shutil.rmtree(where, ignore_errors=True)
                print(f"  {size_gib:g} GiB rep {rep}{' (warm-up)' if rep == 0 else ''} {name}: "
                      f"blocking {blocking:.3f} s, durable {durable:.3f} s",
                      file=sys.stderr, flush=True)
    finally:
        ours.close()
        stager.close()
    return size, {n: t for n, t in timings.items() if n not in failed}, failed


# ------------------------------------------------------------------------------------- report
Row = tuple[float, int, dict[str, Timing], dict[str, str]]


def report(rows: list[Row], header: str) -> str:
    lines = [header, "",
             "| size | method | blocking s (median) | blocking / floor | durable s (median) |",
             "|---|---|---:|---:|---:|"]
    for gib, size, timings, failed in rows:
        floor = timings[FLOOR].block_med
        for name, t in timings.items():
            ratio = t.block_med / floor if floor > 0 else float("inf")
            durable = "-" if name == FLOOR else f"{t.durable_med:.3f}"
            lines.append(f"| {gib:g} GiB ({size / GiB:.2f} GiB) | {name} | {t.block_med:.3f} | "
                         f"{ratio:.2f} | {durable} |")
        for name, why in failed.items():
            lines.append(f"| {gib:g} GiB ({size / GiB:.2f} GiB) | {name} | failed: {why} | - | - |")
    lines += ["", "| size | ratio | value | goal |", "|---|---|---:|---:|"]
    for gib, _, timings, _ in rows:
        floor, ours = timings[FLOOR].block_med, timings[OURS].block_med
        lines.append(f"| {gib:g} GiB | ours blocking / copy floor | {ours / floor:.2f} | <= 1.5 |")
        for name in (DCP_CACHED, DCP_STAGER):
            if name not in timings:
                continue
            lines.append(f"| {gib:g} GiB | {name} blocking / copy floor | "
                         f"{timings[name].block_med / floor:.2f} | |")
    return "\n".join(lines) + "\n"


def results_json(rows: list[Row]) -> list[dict[str, Any]]:
    """The measured medians (and every repeat) per size, as the module docstring gives."""
    return [{"size_gib": gib, "bytes": size, "failed": failed, "methods": {
        name: {"blocking_s": t.block_med, "durable_s": t.durable_med,
               "blocking": list(t.blocking), "durable": list(t.durable)}
        for name, t in timings.items()}} for gib, size, timings, failed in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--sizes", default="1,4,16", help="GiB of CUDA state, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="measured saves per method")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="quiet seconds before each measured save")
    parser.add_argument("--tmp-dir", help="where the checkpoints go (default: the system temp)")
    parser.add_argument("--out", help="also write the Markdown table to this file")
    parser.add_argument("--json", help="also write the medians as JSON to this file")
    args = parser.parse_args(argv)
    try:
        sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes ({args.sizes}) must be numbers of GiB, comma-separated.")
    if args.repeats < 1 or not sizes or any(s <= 0 for s in sizes):
        parser.error(f"--repeats ({args.repeats}) and --sizes ({args.sizes}) must be positive.")
    if not torch.cuda.is_available():
        print(f"cuda_checkpoint: skipped: {SKIPPED} (torch.cuda.is_available() is False)")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": SKIPPED}))
        return 0
    need, have = _COPIES * max(sizes) * GiB, available_bytes()
    if need > 0.9 * have:
        parser.error(f"--sizes up to ({max(sizes):g}) GiB need about {need / GiB:.0f} GiB of "
                     f"pinned host memory ({_COPIES} copies) but {have / GiB:.0f} GiB is "
                     "available; pass smaller --sizes.")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    started = time.time()
    tmp = tempfile.mkdtemp(prefix="cuda-ckpt-bench-", dir=args.tmp_dir)
    rows = []
    try:
        for gib in sizes:
            rows.append((gib, *run_size(gib, args.repeats, tmp, args.settle, device)))
            release_host_memory()  # this size's state and pinned copies, before the next
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    name = torch.cuda.get_device_name(device)
    header = (f"CUDA checkpoint blocking time, medians of {args.repeats} after 1 warm-up "
              f"({args.settle:g} s settle before each), {name}, torch {torch.__version__}, "
              f"{os.cpu_count()} CPUs, disk under {tmp}; {time.time() - started:.0f} s in all.")
    text = report(rows, header)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"repeats": args.repeats, "settle": args.settle, "device": name,
             "sizes": results_json(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
