"""The training loop's per-step cost and each checkpoint's stall, as training sees them, on GPU.

One worker under ``elastic-run --standalone`` (in place, NCCL on a GPU) trains a GPT-like model
(default: 223M parameters, bf16 autocast, fused AdamW, 2.7 GB of state) with
``ElasticLoop(model=, optimizer=, data=)``; a plain ``DistributedDataParallel`` copy of the same
model on the same world and data (``DistributedSampler``) runs in the same process, between the
loop's steps, so that every figure has its same-run baseline:

* **step time**: interleaved blocks of plain DDP, of the loop with the step fence the loop picks
  (``auto``: the device gate with a fused optimizer), and of the loop with the host wait before
  each optimizer step (``ELASTIC_NCCL_STEP_FENCE=1``, the previous default; switched in place
  between blocks); the goal is the loop at most 1.003x plain;
* **each save's stall**: saves every ``--save-every-s`` seconds (default 4 and 1, converted to
  steps with the measured step time): ours (``save_backpressure="defer"``) on the loop, and DCP
  ``async_save`` (``FileSystemWriter(cache_staged_state_dict=True)``, one save in flight: the
  next waits for the previous) on the plain model, plus ours with the default ``"wait"``
  policy at the fastest interval. A save's stall is the extra time of the steps around it
  over the phase's median step (steps timed on the device with CUDA events, no
  synchronisation inside a phase), set against the **copy floor**: the whole state copied
  into already pinned host memory from an idle device. The goal is every stall, the first
  included, at most 1.5x the floor;
* what the loop itself recorded per save (``checkpoint_staged`` stall_s in the event log),
  the step times while the staging buffers were pinned in the background, and the saves the
  ``"defer"`` policy deferred.

Each phase's length is fixed in steps before it starts; the whole run is sized to finish well
inside ``--budget-s`` (default 330 s: one 6-minute device call with its start-up). Everything
is written under a temporary directory (``--tmp-dir``), removed at the end.

``--smoke`` runs the same code on the CPU (gloo, a tiny GPT, a few steps per phase): a check
that the benchmark runs, not a measurement (no CUDA events, no fence, no goals).

Usage::

    python benchmarks/gpu_training.py [--smoke] [--save-every-s 4,1] [--rounds 3]
        [--block-steps 100] [--tmp-dir DIR] [--json out.json] [--budget-s 330]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SKIPPED = "no CUDA device"
STEP_GOAL = 1.003
STALL_GOAL = 1.5
#: Steps after a save's boundary (and the one before it) that its stall is counted over.
STALL_WINDOW = 5


@dataclass
class Config:
    """What one run trains and measures (``--smoke`` shrinks everything)."""

    smoke: bool = False
    vocab: int = 32768
    dim: int = 1024
    layers: int = 15
    heads: int = 16
    seq: int = 1024
    batch: int = 6
    warmup: int = 60
    rounds: int = 3  # of the (plain, loop, loop with host wait) step-time blocks
    block_steps: int = 100
    save_every_s: tuple[float, ...] = (4.0, 1.0)
    saves_per_phase: tuple[int, ...] = (3, 8)
    budget_s: float = 330.0

    @classmethod
    def smoke_config(cls) -> Config:
        return cls(smoke=True, vocab=256, dim=32, layers=2, heads=2, seq=32, batch=4,
                   warmup=4, rounds=1, block_steps=5, save_every_s=(0.3, 0.1),
                   saves_per_phase=(2, 3), budget_s=240.0)


# ------------------------------------------------------------------------------ analysis


def durations(marks: Sequence[float]) -> list[float]:
    """Step durations from the marks at each step's start (seconds)."""
    return [b - a for a, b in itertools.pairwise(marks)]


def stalls(steps: Sequence[float], boundaries: Sequence[int],
           window: int = STALL_WINDOW) -> tuple[float, list[float]]:
    """The phase's typical step and each save's stall.

    Args:
        steps: Step durations of a phase (seconds).
        boundaries: For each save, the index of the step that ended just before it was
            called: its stall is counted over steps ``b .. b + window - 1``.
        window: Steps a save may slow down.

    Returns:
        ``(typical step, stalls)``: the median of the steps outside every save's window, and
        per save the sum of its window's steps minus that many typical steps.
    """
    hit = {i for b in boundaries for i in range(b, b + window)}
    quiet = [d for i, d in enumerate(steps) if i not in hit] or list(steps)
    typical = statistics.median(quiet)
    out = []
    for b in boundaries:
        span = steps[b:b + window]
        out.append(sum(span) - typical * len(span))
    return typical, out


def block_ratio(blocks: Sequence[dict[str, Any]], config: str, baseline: str = "plain"
                ) -> tuple[float, list[float]] | None:
    """Median over rounds of ``config``'s mean step over ``baseline``'s in the same round."""
    ratios = []
    for round_ in sorted({b["round"] for b in blocks}):
        mine = [b for b in blocks if b["round"] == round_ and b["config"] == config]
        base = [b for b in blocks if b["round"] == round_ and b["config"] == baseline]
        if mine and base:
            ratios.append(statistics.mean(mine[0]["steps"]) /
                          statistics.mean(base[0]["steps"]))
    return (statistics.median(ratios), ratios) if ratios else None


# -------------------------------------------------------------------------------- worker


class _Clock:
    """Marks step starts on the device timeline (CUDA events) or the host's (CPU)."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.cuda = cuda
        self._torch = torch
        self._marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    @property
    def count(self) -> int:
        return len(self._marks)

    def take(self) -> list[float]:
        """The durations marked so far (synchronises), and a fresh start."""
        marks, self._marks = self._marks, []
        if not self.cuda:
            return durations(marks)
        self._torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]


def _gpt(cfg: Config) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
            self.qkv, self.proj = nn.Linear(cfg.dim, 3 * cfg.dim), nn.Linear(cfg.dim, cfg.dim)
            self.fc, self.out = nn.Linear(cfg.dim, 4 * cfg.dim), nn.Linear(4 * cfg.dim, cfg.dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = (z.view(b, t, cfg.heads, c // cfg.heads).transpose(1, 2)
                       for z in self.qkv(self.ln1(x)).split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.dim), nn.Embedding(cfg.seq, cfg.dim)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.dim)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.blocks:
                x = block(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # the head tied to the embedding

    return GPT()


class _Tokens:
    """Synthetic token sequences (inputs and next-token targets), fixed by a seed."""

    def __init__(self, cfg: Config, count: int) -> None:
        import torch

        generator = torch.Generator().manual_seed(11)
        self.data = torch.randint(cfg.vocab, (count, cfg.seq + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        row = self.data[index]
        return row[:-1], row[1:]


@dataclass
class _Phase:
    """One measured phase: step durations and, for saves, their boundaries."""

    name: str
    kind: str
    interval: int = 0
    steps: list[float] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)
    round: int = 0
    config: str = ""
    deferred: int = 0


def _worker(cfg: Config, out: Path, tmp: Path) -> int:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    import elastic
    from checkpointing import CheckpointManager
    from elastic.inplace.step_fence import FenceMode

    started = time.monotonic()
    ctx = elastic.init()
    device = ctx.device
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    loop_model = _gpt(cfg)
    plain_model = _gpt(cfg)
    plain_model.load_state_dict(loop_model.state_dict())
    loop_model.to(device)
    plain_model.to(device)
    params = sum(p.numel() for p in loop_model.parameters())
    loop_opt = torch.optim.AdamW(loop_model.parameters(), lr=3e-4, fused=True)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=3e-4, fused=True)
    data = _Tokens(cfg, 512 if not cfg.smoke else 64)
    manager = CheckpointManager(str(tmp / "ours"), keep_last=1,
                                process_group=ctx.checkpoint_group, round=ctx.round)
    saved_at: list[tuple[int, float]] = []  # (clock count at the call, seconds in the call)
    clock = _Clock(cuda)
    original_save = manager.save

    def timed_save(step: int, state: Any, **kwargs: Any) -> Any:
        called = time.monotonic()
        try:
            return original_save(step, state, **kwargs)
        finally:
            saved_at.append((clock.count, time.monotonic() - called))

    manager.save = timed_save  # type: ignore[method-assign]
    loop = elastic.ElasticLoop(
        ctx, model=loop_model, optimizer=loop_opt, data=data, global_batch_size=cfg.batch,
        micro_batch_size=cfg.batch, max_steps=10**9, checkpoint=manager,
        checkpoint_interval=10**9, save_backpressure="defer", seed=0,
        loader_options={"pin_memory": cuda}, install_signal_handler=False)
    autocast: Callable[[], Any] = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda
        else (lambda: torch.autocast("cpu", enabled=False)))

    def loss_of(model: Any, x: Any, y: Any) -> Any:
        with autocast():
            logits = model(x)
        return F.cross_entropy(logits.float().view(-1, cfg.vocab), y.view(-1))

    batches: Iterator[Any] = iter(loop.batches())
    pending = [next(batches)]

    def loop_steps(n: int) -> None:
        """``n`` loop steps, marking each one's start (and the one after the last)."""
        for _ in range(n):
            clock.mark()
            x, y = pending[0]
            loop.backward(loss_of(loop.model, x, y))
            pending[0] = next(batches)  # the step's optimizer, end_step, saves; next batch
        clock.mark()

    plain = DistributedDataParallel(plain_model, device_ids=[device.index] if cuda else None,
                                    process_group=ctx.process_group)
    sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
    loader = DataLoader(data, batch_size=cfg.batch, sampler=sampler, drop_last=True,
                        pin_memory=cuda)

    def plain_batches() -> Iterator[Any]:
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            for x, y in loader:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            epoch += 1

    plain_iter = plain_batches()
    dcp_state: dict[str, Any] = {"writer": None, "future": None, "dir": None, "n": 0}

    def dcp_save() -> None:
        future = dcp_state["future"]
        if future is not None:
            future.result()  # one save in flight: the next waits for the previous
            shutil.rmtree(dcp_state["dir"], ignore_errors=True)
        where = str(tmp / f"dcp-{dcp_state['n']}")
        dcp_state["n"] += 1
        if dcp_state["writer"] is None:  # one writer, so one staging cache, for every save
            # (DCP's cached staging buffers are pinned: CUDA only.)
            dcp_state["writer"] = FileSystemWriter(where, cache_staged_state_dict=cuda)
        model_sd, optim_sd = get_state_dict(plain_model, plain_opt)
        dcp_state["future"] = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                             checkpoint_id=where,
                                             storage_writer=dcp_state["writer"], no_dist=True)
        dcp_state["dir"] = where

    def plain_steps(n: int, save_every: int = 0, boundaries: list[int] | None = None) -> None:
        for i in range(n):
            clock.mark()
            x, y = next(plain_iter)
            loss_of(plain, x, y).backward()
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)
            if save_every and (i + 1) % save_every == 0:
                assert boundaries is not None
                boundaries.append(clock.count - 1)
                dcp_save()
        clock.mark()

    def elapsed() -> float:
        return time.monotonic() - started

    result: dict[str, Any] = {
        "config": asdict(cfg), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "params": params, "phases": [], "skipped": [],
    }
    controller = getattr(ctx, "inplace", None)
    fence = getattr(controller, "fence", None)

    # Warm-up; the staging buffers are pinned in the background from the first step on.
    loop_steps(cfg.warmup)
    result["warmup_steps"] = clock.take()
    waited_from = time.monotonic()
    while manager.busy() is not None and time.monotonic() - waited_from < 120:
        time.sleep(0.05)
    result["reserve_wait_after_warmup_s"] = time.monotonic() - waited_from
    result["fence"] = fence.mode.name if fence is not None else "none (gloo)"
    step_s = statistics.median(result["warmup_steps"][cfg.warmup // 2:])
    result["warmup_step_s"] = step_s
    phases: list[_Phase] = []

    # Step time: interleaved blocks.
    picked = fence.mode if fence is not None else None
    configs = ["plain", "loop"] + (["loop_host_wait"] if fence is not None else [])
    for round_ in range(cfg.rounds):
        order = configs if round_ % 2 == 0 else list(reversed(configs))
        for name in order:
            if name == "plain":
                plain_steps(cfg.block_steps)
            else:
                if fence is not None:
                    # A benchmark-only switch of the fence the loop picked (from
                    # ELASTIC_NCCL_STEP_FENCE at start-up), to time both in one process.
                    fence.mode = FenceMode.WAIT if name == "loop_host_wait" else picked
                loop_steps(cfg.block_steps)
            phases.append(_Phase(f"{name} r{round_}", "block", steps=clock.take(),
                                 round=round_, config=name))
    if fence is not None:
        fence.mode = picked

    # Saves: ours and DCP at each interval, and ours with the "wait" policy at the fastest.
    intervals = [max(2, round(s / step_s)) for s in cfg.save_every_s]
    plan: list[tuple[str, int, int]] = []
    for seconds, interval, count in zip(cfg.save_every_s, intervals, cfg.saves_per_phase,
                                        strict=True):
        plan += [(f"ours every {seconds:g} s", interval, count),
                 (f"DCP every {seconds:g} s", interval, count)]
    plan.append((f"ours every {cfg.save_every_s[-1]:g} s, wait policy", intervals[-1],
                 cfg.saves_per_phase[-1]))
    for name, interval, count in plan:
        steps = interval * count + STALL_WINDOW
        if elapsed() + 1.5 * steps * step_s + 20 > cfg.budget_s:
            result["skipped"].append(f"{name}: over the {cfg.budget_s:g} s budget")
            continue
        manager.wait()
        future = dcp_state["future"]
        if future is not None:
            future.result()
        clock.take()
        phase = _Phase(name, "saves", interval=interval)
        if name.startswith("DCP"):
            plain_steps(steps, save_every=interval, boundaries=phase.boundaries)
        else:
            saved_at.clear()
            wait_policy = name.endswith("wait policy")
            loop.saves.backpressure = "wait" if wait_policy else "defer"
            loop.saves.max_commit_lag = interval  # "wait": the loop's default, the interval
            loop.saves.interval = interval  # benchmark-only: the interval changes per phase
            base = loop.step
            loop.saves.restored(base)  # the phase's saves count from its first step
            loop_steps(steps)
            loop.saves.interval = 10**9
            loop.saves._deferred = None  # a save deferred at the phase's end is not taken
            phase.boundaries = [count - 1 for count, _ in saved_at]
            phase.deferred = sum(1 for s in range(base + 1, base + steps + 1)
                                 if s % interval == 0) - len(saved_at)
        phase.steps = clock.take()
        phases.append(phase)
    manager.wait()
    if dcp_state["future"] is not None:
        dcp_state["future"].result()

    # The copy floor: the loop's whole state into pinned host memory, from an idle device.
    model_sd, optim_sd = get_state_dict(loop_model, loop_opt)
    tensors = [t for t in _flat([model_sd, optim_sd]) if t.device.type == device.type]
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    floor = []
    for _ in range(4):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        floor.append(time.perf_counter() - t0)
    result["floor_s"] = floor[1:]  # the first touches the buffers
    result["state_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    result["phases"] = [asdict(p) for p in phases]
    result["elapsed_s"] = elapsed()
    out.write_text(json.dumps(result))
    # End the job: one more step, the loop's last (with its final save).
    loop.max_steps = loop.step + 1
    for x, y in batches_rest(pending, batches):
        loop.backward(loss_of(loop.model, x, y))
    ctx.close()
    return 0


def batches_rest(pending: list[Any], batches: Iterator[Any]) -> Iterator[Any]:
    """The batch already fetched, then the loop's remaining ones."""
    yield pending[0]
    yield from batches


def _flat(value: Any) -> Iterator[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)


# -------------------------------------------------------------------------------- report


def summarize(worker: dict[str, Any], staged: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures and goals from a worker's result and the loop's ``checkpoint_staged``
    events."""
    phases = worker["phases"]
    blocks = [p | {"steps": p["steps"]} for p in phases if p["kind"] == "block"]
    floor = statistics.median(worker["floor_s"])
    summary: dict[str, Any] = {"floor_s": floor, "state_bytes": worker["state_bytes"],
                               "steps": {}, "saves": {}}
    for config in ("plain", "loop", "loop_host_wait"):
        mine = [statistics.mean(b["steps"]) for b in blocks if b["config"] == config]
        if mine:
            summary["steps"][config] = {"step_s": statistics.median(mine), "blocks": mine}
    for config in ("loop", "loop_host_wait"):
        ratio = block_ratio(blocks, config)
        if ratio is not None:
            summary["steps"][config]["ratio"] = ratio[0]
            summary["steps"][config]["ratios"] = ratio[1]
    for phase in phases:
        if phase["kind"] != "saves":
            continue
        typical, each = stalls(phase["steps"], phase["boundaries"])
        summary["saves"][phase["name"]] = {
            "interval": phase["interval"], "typical_step_s": typical, "stalls_s": each,
            "stalls_over_floor": [s / floor for s in each] if floor > 0 else [],
            "deferred": phase["deferred"]}
    summary["loop_recorded_stall_s"] = [e.get("stall_s") for e in staged]
    summary["loop_recorded_stage_s"] = [e.get("stage_s") for e in staged]
    warm = worker["warmup_steps"]
    summary["warmup"] = {"max_step_s": max(warm) if warm else None,
                         "median_step_s": statistics.median(warm) if warm else None,
                         "reserve_wait_after_warmup_s": worker["reserve_wait_after_warmup_s"]}
    goals = {}
    if "ratio" in summary["steps"].get("loop", {}):
        goals["loop step / plain DDP <= 1.003"] = summary["steps"]["loop"]["ratio"] <= STEP_GOAL
    for name, saves in summary["saves"].items():
        if name.startswith("ours") and not name.endswith("wait policy") and saves["stalls_s"]:
            goals[f"{name}: every stall <= 1.5x floor"] = (
                max(saves["stalls_over_floor"]) <= STALL_GOAL)
    summary["goals"] = goals
    return summary


def table(worker: dict[str, Any], summary: dict[str, Any]) -> str:
    cfg = worker["config"]
    floor = summary["floor_s"]
    lines = [
        f"In-training benchmark on {worker['device']} (torch {worker['torch']}): GPT "
        f"{worker['params'] / 1e6:.0f}M parameters ({cfg['layers']} layers, dim {cfg['dim']}, "
        f"seq {cfg['seq']}, batch {cfg['batch']}), fused AdamW"
        f"{', bf16 autocast' if not cfg['smoke'] else ''}; state "
        f"{summary['state_bytes'] / 1e9:.2f} GB; step fence {worker['fence']}; "
        f"{worker['elapsed_s']:.0f} s.",
        "", "| step time | median of blocks | / plain DDP (median of rounds) | rounds |",
        "|---|---:|---:|---|"]
    for config, label in (("plain", "plain DDP + DistributedSampler"),
                          ("loop", "ElasticLoop in place, fence as picked"),
                          ("loop_host_wait", "ElasticLoop, host wait (ELASTIC_NCCL_STEP_FENCE=1)")):
        entry = summary["steps"].get(config)
        if entry is None:
            continue
        ratio = f"{entry['ratio']:.4f}" if "ratio" in entry else "1"
        rounds = ", ".join(f"{r:.4f}" for r in entry.get("ratios", []))
        lines.append(f"| {label} | {entry['step_s'] * 1e3:.2f} ms | {ratio} | {rounds} |")
    lines += ["", f"Copy floor (whole state to pinned host memory, idle device): "
              f"{floor * 1e3:.1f} ms.", "",
              "| saves | interval | typical step | stall per save (ms) | max / floor | "
              "first / floor | deferred |", "|---|---:|---:|---|---:|---:|---:|"]
    for name, saves in summary["saves"].items():
        each = saves["stalls_s"]
        over = saves["stalls_over_floor"]
        lines.append(
            f"| {name} | {saves['interval']} steps | {saves['typical_step_s'] * 1e3:.1f} ms | "
            f"{', '.join(f'{s * 1e3:.0f}' for s in each)} | "
            f"{max(over):.2f} | {over[0]:.2f} | {saves['deferred']} |" if each else
            f"| {name} | {saves['interval']} steps | - | no save | - | - | - |")
    recorded = [(s, h) for s, h in zip(summary["loop_recorded_stall_s"],
                                       summary["loop_recorded_stage_s"], strict=True)
                if s is not None and h is not None]
    warm = summary["warmup"]
    lines += ["", "The loop's own records (checkpoint_staged: stall_s, of which the save "
              "call's host time stage_s; ms): "
              f"{', '.join(f'{s * 1e3:.0f} ({h * 1e3:.0f})' for s, h in recorded) or 'none'}.",
              f"Warm-up (staging buffers pinned in the background): median step "
              f"{(warm['median_step_s'] or 0) * 1e3:.1f} ms, max "
              f"{(warm['max_step_s'] or 0) * 1e3:.1f} ms; waited "
              f"{warm['reserve_wait_after_warmup_s']:.2f} s after it for the pinning.",
              ""]
    if worker["skipped"]:
        lines.append("Skipped: " + "; ".join(worker["skipped"]) + ".")
    if not cfg["smoke"]:
        lines += ["| goal | met |", "|---|---|"]
        lines += [f"| {goal} | {'yes' if met else 'NO'} |" for goal, met in
                  summary["goals"].items()]
    else:
        lines.append("Smoke run on the CPU: no goals (the figures mean nothing here).")
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------- parent


def run(cfg: Config, tmp_dir: str | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Runs the worker under ``elastic-run --standalone``; its result and the loop's
    ``checkpoint_staged`` events."""
    from elastic.eventlog import read_events

    tmp = Path(tempfile.mkdtemp(prefix="gpu-training-bench-", dir=tmp_dir))
    try:
        out, events = tmp / "worker.json", tmp / "events"
        config = tmp / "config.json"
        config.write_text(json.dumps(asdict(cfg)))
        cmd = [sys.executable, "-m", "launch", "--standalone", "--nproc-per-node", "1",
               "--max-restarts", "0", "--events-dir", str(events),
               str(Path(__file__).resolve()), "--worker", "--config", str(config),
               "--out", str(out), "--tmp-dir", str(tmp)]
        env = dict(os.environ, LOGLEVEL="WARNING")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.pop("ELASTIC_MODE", None)  # elastic-run's default (in place), not the shell's
        if cfg.smoke:
            env.setdefault("OMP_NUM_THREADS", "1")
        done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=cfg.budget_s + 120)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the worker failed ({done.returncode}): {done.stderr[-3000:]}")
        staged = [e for e in read_events(str(events)) if e.get("event") == "checkpoint_staged"]
        return json.loads(out.read_text()), staged
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU run (no figures)")
    parser.add_argument("--save-every-s", default=None,
                        help="save intervals in seconds, comma-separated (default 4,1)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of step-time blocks")
    parser.add_argument("--block-steps", type=int, default=None, help="steps per block")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the whole run may take (phases that would not fit are "
                             "skipped and listed)")
    parser.add_argument("--tmp-dir", help="where checkpoints go (default: the system temp)")
    parser.add_argument("--json", help="also write the figures as JSON to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        cfg = Config(**json.loads(Path(args.config).read_text()))
        cfg.save_every_s = tuple(cfg.save_every_s)
        cfg.saves_per_phase = tuple(cfg.saves_per_phase)
        return _worker(cfg, Path(args.out), Path(args.tmp_dir))
    cfg = Config.smoke_config() if args.smoke else Config()
    try:
        if args.save_every_s:
            cfg.save_every_s = tuple(float(s) for s in args.save_every_s.split(","))
            cfg.saves_per_phase = tuple(cfg.saves_per_phase[min(i, len(cfg.saves_per_phase) - 1)]
                                        for i in range(len(cfg.save_every_s)))
    except ValueError:
        parser.error(f"--save-every-s ({args.save_every_s}) must be seconds, comma-separated.")
    for name in ("rounds", "block_steps", "batch", "budget_s"):
        value = getattr(args, name)
        if value is not None:
            if value <= 0 or (isinstance(value, float) and not math.isfinite(value)):
                parser.error(f"--{name.replace('_', '-')} ({value}) must be positive.")
            setattr(cfg, name, value)
    if not cfg.smoke:
        import torch

        if not torch.cuda.is_available():
            print(f"gpu_training: skipped: {SKIPPED} (torch.cuda.is_available() is False); "
                  "--smoke runs it on the CPU")
            if args.json:
                Path(args.json).write_text(json.dumps({"skipped": SKIPPED}))
            return 0
    worker, staged = run(cfg, args.tmp_dir)
    summary = summarize(worker, staged)
    print(table(worker, summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"worker": worker, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
