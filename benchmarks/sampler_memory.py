"""Sampler memory and time to first batch: the constant-memory order against torch.randperm.

For each dataset size ``N`` and each order, a fresh child process (this interpreter, torch and
``elastic`` imported before anything is measured) builds a sampler the way ``ElasticLoop``
does (stream mode: a global batch of ``--global-batch`` over ``--world`` ranks, micro-batches
of up to ``--micro-batch``; rank 0) and draws its first micro-batch. It reports:

* **resident memory**: the child's RSS after the first batch minus its RSS just before the
  sampler was built (``/proc/self/status``), and the peak over the same span (``VmHWM``,
  reset just before);
* **time to first batch**: from constructing the sampler to holding its first micro-batch;
* **throughput**: indices per second over the next ``--throughput`` indices of the rank's
  stream (the sampler's cost while training).

The orders:

* ``feistel``: ``elastic.ElasticSampler`` as it is now (:mod:`elastic.permutation`);
* ``randperm sampler``: ``ElasticSampler`` before the constant-memory order (commit 86153c8),
  copied here as :class:`RandpermSampler`: every epoch ``torch.randperm(N)``, and the stream
  lists the rest of the epoch (``.tolist()``, about 36 bytes per sample) before its first index;
* ``randperm tensor``: ``torch.randperm(N)`` alone (8 bytes per sample): what any sampler that
  materialises the order needs at least, however lazily it then reads it.

Each child runs under an address-space limit (``--memory-limit-gib``, lowered to what the
machine has available minus 2 GiB), so a case that does not fit fails with ``MemoryError`` and
is reported as not fitting instead of waking the kernel's OOM killer. The published figures
(``docs/data.md``) come from::

    python benchmarks/sampler_memory.py --sizes 1e6,1e8,1e9

Usage::

    python benchmarks/sampler_memory.py [--sizes 1e6,1e8,1e9] [--world 8]
        [--global-batch 1024] [--micro-batch 128] [--throughput 1000000]
        [--memory-limit-gib 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FEISTEL = "feistel"
RANDPERM_SAMPLER = "randperm sampler"
RANDPERM_TENSOR = "randperm tensor"
ORDERS = (FEISTEL, RANDPERM_SAMPLER, RANDPERM_TENSOR)
MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Case:
    """One order at one size, measured in its own process."""

    size: int
    order: str
    status: str  # "ok", "out of memory" (the limit), "failed" (anything else)
    memory_limit_gib: float
    rss_mib: float | None = None
    """RSS after the first batch minus RSS before the sampler was built."""
    peak_mib: float | None = None
    """Peak RSS while building it and drawing the first batch, minus RSS before."""
    base_rss_mib: float | None = None
    """The child's RSS before the sampler (the interpreter, torch, elastic)."""
    first_batch_s: float | None = None
    throughput_per_s: float | None = None
    error: str = ""


# ------------------------------------------------------------------- the sampler before


class RandpermSampler:
    """``ElasticSampler``'s stream mode before the constant-memory order (commit 86153c8):
    the code that decided its memory, unchanged (``_order_of``, ``_stream``, and the
    micro-batching of ``micro_batches``)."""

    def __init__(self, dataset_size: int, *, seed: int, rank: int, world_size: int,
                 global_batch: int) -> None:
        self._dataset_size, self._seed = dataset_size, seed
        self._rank, self._world_size, self._global_batch = rank, world_size, global_batch
        self._epoch = self._consumed = 0

    def _order_of(self, epoch: int) -> Any:
        import torch

        generator = torch.Generator()
        generator.manual_seed(self._seed + epoch)
        return torch.randperm(self._dataset_size, generator=generator)

    def _stream(self) -> Iterator[int]:
        epoch, start = self._epoch, self._consumed
        length = self._dataset_size
        step, world, rank = self._global_batch, self._world_size, self._rank
        position = 0
        while True:
            order = self._order_of(epoch)[start:length].tolist()
            for index in order:
                if position % step % world == rank:
                    yield index
                position += 1
            epoch, start = epoch + 1, 0

    def micro_batches(self, sizes: tuple[int, ...]) -> Iterator[list[int]]:
        indices = self._stream()
        while True:
            for size in sizes:
                yield [next(indices) for _ in range(size)]


# ----------------------------------------------------------------------------- the child


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(size: int, order: str, args: argparse.Namespace) -> Case:
    """Measures one case in this (fresh) process."""
    import gc
    import resource

    import torch

    from elastic.batching import plan_batches
    from elastic.sampler import ElasticSampler

    limit = int(args.memory_limit_gib * GiB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(1)
    case = Case(size, order, "ok", args.memory_limit_gib)
    plan = plan_batches(args.global_batch, args.micro_batch, args.world)
    sizes = plan.micro_batch_sizes(0)
    gc.collect()
    base = _status_kib("VmRSS")
    _reset_peak()
    began = time.perf_counter()
    batches: Iterator[list[int]]
    held: Any = None
    try:
        if order == FEISTEL:
            sampler = ElasticSampler(size, seed=1234, rank=0, world_size=args.world)
            sampler.set_global_batch_size(args.global_batch)
            batches = sampler.micro_batches(plan)
            first = next(batches)
        elif order == RANDPERM_SAMPLER:
            batches = RandpermSampler(size, seed=1234, rank=0, world_size=args.world,
                                      global_batch=args.global_batch).micro_batches(sizes)
            first = next(batches)
        else:
            generator = torch.Generator().manual_seed(1234)
            held = torch.randperm(size, generator=generator)
            first = held[: sizes[0]].tolist()
            batches = iter(())
    except (MemoryError, RuntimeError) as exc:
        # torch's allocator raises RuntimeError ("DefaultCPUAllocator: can't allocate memory").
        if isinstance(exc, RuntimeError) and "allocate memory" not in str(exc):
            raise
        case.status = "out of memory"
        case.error = (f"{type(exc).__name__} under a {args.memory_limit_gib:g} GiB "
                      "address-space limit")
        return case
    case.first_batch_s = time.perf_counter() - began
    case.rss_mib = (_status_kib("VmRSS") - base) / 1024
    case.peak_mib = (_status_kib("VmHWM") - base) / 1024
    case.base_rss_mib = base / 1024
    assert len(first) == sizes[0] and all(0 <= i < size for i in first)
    if order != RANDPERM_TENSOR and args.throughput:
        drawn, began = 0, time.perf_counter()
        while drawn < args.throughput:
            drawn += len(next(batches))
        case.throughput_per_s = drawn / (time.perf_counter() - began)
    del held
    return case


# ---------------------------------------------------------------------------- the parent


def _available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GiB
    return float("inf")


def run_case(size: int, order: str, args: argparse.Namespace) -> Case:
    """Runs one case in a fresh child process (this script with ``--child``)."""
    limit = min(args.memory_limit_gib, max(1.0, _available_gib() - 2.0))
    cmd = [sys.executable, __file__, "--child", str(size), order,
           "--world", str(args.world), "--global-batch", str(args.global_batch),
           "--micro-batch", str(args.micro_batch), "--throughput", str(args.throughput),
           "--memory-limit-gib", f"{limit:.2f}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return Case(size, order, "failed", limit, error=f"timed out after {args.timeout} s")
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        if done.returncode < 0:
            tail = f"killed by signal {-done.returncode} ({tail})"
        return Case(size, order, "failed", limit, error=tail[:300])
    return Case(**json.loads(done.stdout.strip().splitlines()[-1]))


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def table(cases: list[Case]) -> str:
    """The Markdown table of every case."""
    lines = ["| N | order | status | RSS after first batch | peak RSS | time to first batch | "
             "indices/s after |", "|---:|---|---|---:|---:|---:|---:|"]
    for c in cases:
        status = c.status if c.status == "ok" else f"**{c.status}**: {c.error}"
        lines.append(
            f"| {c.size:.0e} | {c.order} | {status} | {_fmt(c.rss_mib, '.2f', ' MiB')} | "
            f"{_fmt(c.peak_mib, '.2f', ' MiB')} | {_fmt(c.first_batch_s, '.4f', ' s')} | "
            f"{_fmt(c.throughput_per_s, '.3g')} |")
    return "\n".join(lines)


def summary(cases: list[Case]) -> list[str]:
    """One line per size: the new order's memory and first batch against randperm's."""
    out = []
    by = {(c.size, c.order): c for c in cases}
    for size in sorted({c.size for c in cases}):
        ours = by.get((size, FEISTEL))
        if ours is None or ours.rss_mib is None:
            continue
        parts = [f"- N={size:.0e}: feistel sampler {ours.rss_mib:.2f} MiB "
                 f"(peak {ours.peak_mib:.2f}), first batch {ours.first_batch_s:.4f} s"]
        for name in (RANDPERM_SAMPLER, RANDPERM_TENSOR):
            base = by.get((size, name))
            if base is None:
                continue
            if base.peak_mib is None or base.first_batch_s is None:
                parts.append(f"{name}: {base.status} ({base.error})")
            else:
                parts.append(f"{name} {base.peak_mib / 1024:.2f} GiB peak, first batch "
                             f"{base.first_batch_s:.2f} s "
                             f"({base.first_batch_s / max(ours.first_batch_s or 0, 1e-9):.0f}x)")
        out.append("; ".join(parts))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e8,1e9",
                        help="comma-separated dataset sizes (1e9 style allowed)")
    parser.add_argument("--orders", default=",".join(ORDERS),
                        help="comma-separated: " + ",".join(ORDERS))
    parser.add_argument("--world", type=int, default=8, help="ranks the batch is split over")
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=128)
    parser.add_argument("--throughput", type=int, default=1_000_000,
                        help="indices drawn after the first batch to time (0: skip)")
    parser.add_argument("--memory-limit-gib", type=float, default=16.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    parser.add_argument("--json", type=Path, default=None, help="write every case here")
    parser.add_argument("--child", nargs=2, metavar=("SIZE", "ORDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case = child(int(args.child[0]), args.child[1], args)
        print(json.dumps(asdict(case)))
        return 0
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    unknown = [o for o in orders if o not in ORDERS]
    if unknown or any(s < args.world for s in sizes):
        parser.error(f"orders must be among {', '.join(ORDERS)} and sizes at least --world.")
    print(f"Sampler memory, rank 0 of {args.world}, global batch {args.global_batch}, "
          f"micro-batches of up to {args.micro_batch}; each case in a fresh process under "
          f"an address-space limit of at most {args.memory_limit_gib:g} GiB "
          f"({_available_gib():.1f} GiB available at start)", flush=True)
    cases = []
    for size in sizes:
        for order in orders:
            case = run_case(size, order, args)
            print(f"N={size:.0e} {order}: {case.status} rss={_fmt(case.rss_mib, '.2f')} MiB "
                  f"peak={_fmt(case.peak_mib, '.2f')} MiB first_batch="
                  f"{_fmt(case.first_batch_s, '.4f')} s {case.error}", file=sys.stderr,
                  flush=True)
            cases.append(case)
    print()
    print(table(cases))
    print()
    print("\n".join(summary(cases)))
    if args.json:
        args.json.write_text(json.dumps({"world": args.world,
                                         "global_batch": args.global_batch,
                                         "micro_batch": args.micro_batch,
                                         "cases": [asdict(c) for c in cases]}, indent=1))
    return 0 if all(c.status != "failed" for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
