"""Checkpoint cost on the training thread and time to durable: ours versus torch's, with floors.

For each ``--sizes`` entry (MiB of model plus Adam state: an MLP of float32 ``d x d`` layers,
its ``exp_avg`` and ``exp_avg_sq``, so params are a third of it) this measures, on local disk
and interleaved round-robin so machine load hits every method alike:

* ``torch.save`` into one file, then ``fsync`` (blocking = durable);
* DCP ``save`` with its ``FileSystemWriter`` (``sync_files=True``; blocking = durable);
* DCP ``async_save`` (stock ``FileSystemWriter``): blocking = until it returns, durable = until
  its future resolves;
* ours, :class:`checkpointing.CheckpointManager`: blocking = until ``save()`` returns (staging
  copy into reused host buffers), durable = until ``committed`` resolves (fsynced shards and
  the commit record written);
* physical floors of the same run: ``copy_`` of every tensor into preallocated, already
  touched host tensors (the least a snapshot can block), and a raw write of the same bytes
  into one file with ``fsync`` (the least "durable" can take).

Each method gets one unmeasured warm-up save (ours keeps its staging buffers from it, as in
training), then ``--repeats`` measured ones; the table shows medians. With ``--s3-size`` it also
starts ``moto_server`` in a subprocess on 127.0.0.1 and compares ours on ``s3://`` with raw
s3fs puts of the same bytes (4 objects in parallel, as our 4 I/O threads do), given as
``bytes`` (what a user would write, and the goal's baseline) and as the zero-copy body ours
uploads (a ``bytes`` body is copied whole by botocore and aiohttp on its way out; this is the
tighter floor). Everything is written under a temporary directory that is removed at the end.

Usage::

    python benchmarks/checkpoint_throughput.py --sizes 300,1500 --repeats 3 --s3-size 300 \\
        [--out results.md] [--json results.json] [--tmp-dir /path/on/the/disk/to/measure]

``--json`` writes the medians (and every measured repeat) per size and method:
``{"repeats", "settle", "local": [{"size_mib", "bytes", "methods": {name: {"blocking_s",
"durable_s", "blocking", "durable"}}}], "s3": the same for the S3 run, or null}``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpointing import CheckpointManager
from checkpointing.remote_buffers import BufferBody

MiB = 1 << 20
S3_RAW = "s3: raw s3fs puts (4 in parallel)"
#: The same puts with the upload body ours uses, which botocore and aiohttp do not copy whole.
S3_RAW_ZERO_COPY = "s3: raw s3fs puts, zero-copy body"
S3_OURS = "s3: ours"
_D = 2048  # layer width: 16 MiB of float32 per weight matrix


@dataclass
class Timing:
    """Blocking and durable seconds of every measured repeat of one method."""

    blocking: list[float] = field(default_factory=list)
    durable: list[float] = field(default_factory=list)

    def add(self, blocking: float, durable: float) -> None:
        self.blocking.append(blocking)
        self.durable.append(durable)

    @property
    def block_med(self) -> float:
        return statistics.median(self.blocking)

    @property
    def durable_med(self) -> float:
        return statistics.median(self.durable)


def build_state(total_mib: int) -> dict[str, torch.Tensor]:
    """A flat state dict: MLP params plus Adam's two moments, about ``total_mib`` MiB."""
    per_layer = (_D * _D + _D) * 4
    layers = max(1, round(total_mib * MiB / 3 / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(_D, _D) for _ in range(layers)])
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()  # creates exp_avg and exp_avg_sq
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        state[f"model.{name}"] = p.detach()
        st = optim.state[p]
        state[f"optim.{name}.exp_avg"] = st["exp_avg"]
        state[f"optim.{name}.exp_avg_sq"] = st["exp_avg_sq"]
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def settle(seconds: float) -> None:
    """Let the previous method's frees and the host's writeback calm down before measuring.

    On a shared VM the first big copy right after a large fsynced write runs several times
    slower than in quiet; every method, floors included, starts from the same quiet state.
    """
    gc.collect()
    time.sleep(seconds)


def _byte_views(state: dict[str, torch.Tensor]) -> Iterator[memoryview]:
    for t in state.values():
        yield memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


# ------------------------------------------------------------------------------- local methods
def floor_copy(state: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> tuple[float, float]:
    t0 = time.perf_counter()
    for k, v in state.items():
        dst[k].copy_(v)
    dt = time.perf_counter() - t0
    return dt, dt


def floor_disk(state: dict[str, torch.Tensor], where: str) -> tuple[float, float]:
    os.makedirs(where, exist_ok=True)
    path = os.path.join(where, "raw.bin")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for mv in _byte_views(state):
            while mv.nbytes:
                mv = mv[os.write(fd, mv[: 1 << 30]):]
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(where)
    dt = time.perf_counter() - t0
    return dt, dt


def torch_save(state: dict[str, torch.Tensor], where: str) -> tuple[float, float]:
    os.makedirs(where, exist_ok=True)
    t0 = time.perf_counter()
    with open(os.path.join(where, "ckpt.pt"), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(where)
    dt = time.perf_counter() - t0
    return dt, dt


def dcp_save(state: dict[str, torch.Tensor], where: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(where), no_dist=True)
    dt = time.perf_counter() - t0
    return dt, dt


def dcp_async_save(state: dict[str, torch.Tensor], where: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    fut: Any = dcp.async_save(state, storage_writer=FileSystemWriter(where), no_dist=True)
    blocking = time.perf_counter() - t0
    fut.result()
    return blocking, time.perf_counter() - t0


class Ours:
    """One manager per root, reused across saves like a training run does."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.mgr = CheckpointManager(url, keep_last=1, **kwargs)
        self.step = 0

    def __call__(self, state: dict[str, torch.Tensor], where: str) -> tuple[float, float]:
        self.step += 1
        t0 = time.perf_counter()
        handle = self.mgr.save(self.step, state)
        blocking = time.perf_counter() - t0
        handle.committed.result()
        durable = time.perf_counter() - t0
        self.mgr.wait()  # retention of the previous step, outside the measurement
        return blocking, durable

    def close(self) -> None:
        self.mgr.close()


def run_local(
    total_mib: int, repeats: int, tmp: str, pause: float
) -> tuple[int, dict[str, Timing]]:
    state = build_state(total_mib)
    size = nbytes(state)
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        dst[k].copy_(v)  # first touch happens here, not in the measurement
    ours = Ours(os.path.join(tmp, f"ours-{total_mib}"))
    methods: dict[str, Callable[[dict[str, torch.Tensor], str], tuple[float, float]]] = {
        "floor: copy into reused host memory": lambda s, w: floor_copy(s, dst),
        "floor: raw write + fsync": floor_disk,
        "torch.save + fsync": torch_save,
        "DCP save": dcp_save,
        "DCP async_save": dcp_async_save,
        "ours (CheckpointManager)": ours,
    }
    timings = {name: Timing() for name in methods}
    try:
        for rep in range(repeats + 1):
            for name, fn in methods.items():
                where = os.path.join(tmp, f"{uuid.uuid4().hex[:8]}")
                settle(pause)
                blocking, durable = fn(state, where)
                if rep > 0:  # rep 0 is the warm-up
                    timings[name].add(blocking, durable)
                shutil.rmtree(where, ignore_errors=True)
                print(
                    f"  {total_mib} MiB rep {rep}{' (warm-up)' if rep == 0 else ''} {name}: "
                    f"blocking {blocking:.3f} s, durable {durable:.3f} s",
                    file=sys.stderr, flush=True,
                )
    finally:
        ours.close()
    return size, timings


# ------------------------------------------------------------------------------------------ S3
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(exe):
        exe = shutil.which("moto_server") or "moto_server"
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"moto_server on port ({port}) did not start") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def run_s3(total_mib: int, repeats: int, pause: float) -> tuple[int, dict[str, Timing]]:
    import s3fs

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    state = build_state(total_mib)
    size = nbytes(state)
    blob = b"".join(bytes(mv) for mv in _byte_views(state))
    parts = 4
    step = -(-len(blob) // parts)
    chunks = [blob[i * step:(i + 1) * step] for i in range(parts)]
    timings = {S3_RAW: Timing(), S3_RAW_ZERO_COPY: Timing(), S3_OURS: Timing()}
    with moto_server() as endpoint:
        opts: dict[str, Any] = {
            "client_kwargs": {"endpoint_url": endpoint}, "key": "bench", "secret": "bench",
        }
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir("bench")
        ours = Ours("s3://bench/ours", storage_options=opts)

        def raw(s: dict[str, torch.Tensor], where: str) -> tuple[float, float]:
            prefix = f"bench/raw/{where.rsplit('/', 1)[-1]}"
            t0 = time.perf_counter()
            fs.pipe({f"{prefix}/{i}": c for i, c in enumerate(chunks)})
            dt = time.perf_counter() - t0
            fs.rm(prefix, recursive=True)
            return dt, dt

        def raw_zero_copy(s: dict[str, torch.Tensor], where: str) -> tuple[float, float]:
            prefix = f"bench/raw0/{where.rsplit('/', 1)[-1]}"
            t0 = time.perf_counter()
            fs.pipe({f"{prefix}/{i}": BufferBody(c) for i, c in enumerate(chunks)})
            dt = time.perf_counter() - t0
            fs.rm(prefix, recursive=True)
            return dt, dt

        methods = {
            S3_RAW: raw, S3_RAW_ZERO_COPY: raw_zero_copy, S3_OURS: ours,
        }
        try:
            for rep in range(repeats + 1):
                for name, fn in methods.items():
                    settle(pause)
                    blocking, durable = fn(state, uuid.uuid4().hex[:8])
                    if rep > 0:
                        timings[name].add(blocking, durable)
                    print(
                        f"  s3 {total_mib} MiB rep {rep} {name}: blocking {blocking:.3f} s, "
                        f"durable {durable:.3f} s",
                        file=sys.stderr, flush=True,
                    )
        finally:
            ours.close()
    return size, timings


# -------------------------------------------------------------------------------------- report
def _fmt(seconds: float) -> str:
    return f"{seconds:.3f}"


def report(
    local: list[tuple[int, int, dict[str, Timing]]],
    s3: tuple[int, int, dict[str, Timing]] | None,
    header: str,
) -> str:
    lines = [header, ""]
    lines += [
        "| size | method | blocking s (median) | durable s (median) | durable GiB/s |",
        "|---|---|---:|---:|---:|",
    ]
    rows = list(local) + ([s3] if s3 else [])
    for mib, size, timings in rows:
        for name, t in timings.items():
            gibs = size / (1 << 30) / t.durable_med if t.durable_med > 0 else float("inf")
            lines.append(
                f"| {mib} MiB ({size / MiB:.0f} MiB) | {name} | {_fmt(t.block_med)} | "
                f"{_fmt(t.durable_med)} | {gibs:.2f} |"
            )
    lines += ["", "| size | ratio | value | goal |", "|---|---|---:|---:|"]
    for mib, _, t in local:
        copy = t["floor: copy into reused host memory"].block_med
        disk = t["floor: raw write + fsync"].durable_med
        ours = t["ours (CheckpointManager)"]
        dcp_async = t["DCP async_save"]
        lines += [
            f"| {mib} MiB | ours blocking / copy floor | {ours.block_med / copy:.2f} | <= 1.5 |",
            f"| {mib} MiB | ours durable / disk floor | {ours.durable_med / disk:.2f} | <= 1.3 |",
            f"| {mib} MiB | DCP async_save blocking / copy floor | "
            f"{dcp_async.block_med / copy:.2f} | |",
            f"| {mib} MiB | DCP async_save durable / disk floor | "
            f"{dcp_async.durable_med / disk:.2f} | |",
        ]
    if s3:
        mib, _, t = s3
        ours_s3 = t[S3_OURS].durable_med
        lines += [
            f"| {mib} MiB | s3: ours durable / raw s3fs puts | "
            f"{ours_s3 / t[S3_RAW].durable_med:.2f} | <= 1.3 |",
            f"| {mib} MiB | s3: ours durable / zero-copy s3fs puts | "
            f"{ours_s3 / t[S3_RAW_ZERO_COPY].durable_med:.2f} | |",
        ]
    return "\n".join(lines) + "\n"


def results_json(
    local: list[tuple[int, int, dict[str, Timing]]],
    s3: tuple[int, int, dict[str, Timing]] | None,
) -> dict[str, Any]:
    """The measured medians (and raw repeats) as a JSON-ready dict; see the module docstring."""

    def one(mib: int, size: int, timings: dict[str, Timing]) -> dict[str, Any]:
        methods = {
            name: {"blocking_s": t.block_med, "durable_s": t.durable_med,
                   "blocking": list(t.blocking), "durable": list(t.durable)}
            for name, t in timings.items()
        }
        return {"size_mib": mib, "bytes": size, "methods": methods}

    return {"local": [one(*row) for row in local], "s3": one(*s3) if s3 else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--sizes", default="300,1500", help="MiB of model + Adam state, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=3, help="measured saves per method")
    parser.add_argument("--s3-size", type=int, default=300, help="MiB for the S3 run; 0 skips it")
    parser.add_argument(
        "--settle", type=float, default=1.0, help="quiet seconds before each measured save"
    )
    parser.add_argument("--out", help="also write the Markdown table to this file")
    parser.add_argument("--json", help="also write the medians as JSON to this file")
    parser.add_argument("--tmp-dir", help="where to write (default: the system temp dir)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.repeats < 1 or not sizes or any(s < 1 for s in sizes):
        parser.error(f"--repeats ({args.repeats}) and --sizes ({args.sizes}) must be positive.")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    load_before = os.getloadavg()
    started = time.time()
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.tmp_dir)
    try:
        local = []
        for mib in sizes:
            size, timings = run_local(mib, args.repeats, tmp, args.settle)
            local.append((mib, size, timings))
        s3 = None
        if args.s3_size > 0:
            size, timings = run_s3(args.s3_size, args.repeats, args.settle)
            s3 = (args.s3_size, size, timings)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    header = (
        f"Checkpoint throughput, medians of {args.repeats} after 1 warm-up "
        f"({args.settle:g} s settle before each), torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs, disk under {tmp}; load average "
        f"{load_before[0]:.1f} at start, {load_after[0]:.1f} at end; "
        f"{time.time() - started:.0f} s in all."
    )
    text = report(local, s3, header)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        data = {"repeats": args.repeats, "settle": args.settle, **results_json(local, s3)}
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
