"""Child process of ``test_cuda_paths.py``: an NCCL world of one is aborted from another
thread while a collective of it is pending on the GPU, and rebuilt, twice.

The collective is made to be pending by queueing it behind ``torch.cuda._sleep`` on the
current stream (a world of one has no peer to wait for). The worker's own code does the
work: :func:`elastic.inplace.groups.build_groups`, :class:`elastic.inplace.abort.WorldAbort`,
:func:`elastic.inplace.groups.abort_groups` and :class:`elastic.inplace.step_fence.StepFence`.

1. The default fence: the host waits in the fence (as before an optimizer step) while a
   thread aborts the world; the wait ends, the step is refused, the world is rebuilt.
2. The fence that waits for nothing (``ELASTIC_NCCL_STEP_FENCE=0``): the step is let through,
   a thread aborts the world; the abort notes that the step's collective had not finished.
3. The device gate (``ELASTIC_NCCL_STEP_FENCE=device``): a fused AdamW step is queued behind
   the pending all-reduce without the host waiting; a thread aborts the world; once the world
   is dropped, the parameter and the optimizer's state are unchanged (the step was skipped on
   the GPU) and the fence gives back the step's snapshot to rewind to. A step of the rebuilt
   world is applied.

Prints progress and times to stderr and one JSON line to stdout; exits 0 only if the process
lived through both aborts and both rebuilt worlds work. Times (seconds, monotonic):
``abort_s`` the abort call; ``rebuild_s`` from dropping the aborted world to the rebuilt
world's first all-reduce read back; ``rebuilt_s`` abort plus rebuild (in 2, measured from the
abort's start while the GPU still runs the sleep; in 1 the host first waits for the sleep,
which no abort cuts short, so that wait is left out); ``gpu_busy_after_abort_s`` how long the
queued GPU work still ran after the abort returned (an ``abort_s`` close to the sleep's
remainder would mean that the abort waited for the GPU). ``within_2s``: both ``rebuilt_s``
at most 2 s.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from elastic.inplace.abort import WorldAbort, WorldAbortedError
from elastic.inplace.groups import abort_groups, build_groups
from elastic.inplace.step_fence import FenceMode, StepFence
from elastic.process_group import NCCL_ASYNC_ERROR_HANDLING_ENV

SLEEP_S = 3.0  # GPU work queued ahead of the collective
ABORT_AFTER_S = 0.3  # when the thread aborts, well inside the sleep
TIMEOUT = timedelta(seconds=30)


def log(message: str) -> None:
    print(f"[nccl-abort-child] {message}", file=sys.stderr, flush=True)


def cycles_per_second(device: torch.device) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per second on this GPU (measured)."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    cycles = 50_000_000
    torch.cuda._sleep(cycles)  # warm-up (module load)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def build(epoch: int, device: torch.device, fence: StepFence | None) -> WorldAbort:
    guard = WorldAbort(name=f"epoch {epoch}",
                       on_abort=fence.on_abort if fence is not None else None)
    build_groups("nccl", store=HashStore(), epoch=epoch, rank=0, world_size=1, device=device,
                 timeout=TIMEOUT, world_abort=guard)
    return guard


def queue_pending_collective(device: torch.device, cycles: float) -> float:
    """Queues ``SLEEP_S`` of GPU work, then an all-reduce behind it; returns when the GPU
    work should end (monotonic)."""
    tensor = torch.ones(1 << 20, device=device)
    torch.cuda._sleep(int(cycles * SLEEP_S))
    queued = time.monotonic()
    work = dist.all_reduce(tensor, async_op=True)
    assert work is not None
    work.wait()  # the current stream waits for the collective; the host does not
    return queued + SLEEP_S


def abort_later(guard: WorldAbort, times: dict[str, float]) -> threading.Thread:
    def run() -> None:
        time.sleep(ABORT_AFTER_S)
        times["abort_started"] = time.monotonic()
        guard.abort("test: a member of the world is gone")
        times["abort_returned"] = time.monotonic()

    thread = threading.Thread(target=run, name="watch", daemon=True)
    thread.start()
    return thread


def rebuilt_sum(epoch: int, device: torch.device) -> tuple[WorldAbort, float]:
    """Rebuilds the world and all-reduces on a side stream (the default stream may still
    run the sleep): a world of one gives back its own values."""
    guard = build(epoch, device, None)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        value = torch.full((4,), 3.0, device=device)
        dist.all_reduce(value)
        host = value.cpu()  # waits for the side stream only
    return guard, float(host[0])


def main() -> int:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    cycles = cycles_per_second(device)
    log(f"torch.cuda._sleep: {cycles / 1e9:.2f} G cycles/s")
    result: dict[str, Any] = {}

    # 1. The default fence: the host waits, the abort releases it, the step is refused.
    guard = build(1, device, None)
    result["error_handling"] = os.environ.get(NCCL_ASYNC_ERROR_HANDLING_ENV)
    warm = torch.ones(8, device=device)
    dist.all_reduce(warm)  # the communicator works
    torch.cuda.synchronize()
    gpu_free_at = queue_pending_collective(device, cycles)
    times: dict[str, float] = {}
    thread = abort_later(guard, times)
    fence = StepFence(device, mode=FenceMode.WAIT)
    try:
        fence.before_optimizer_step(guard)
        refused = "nothing raised"
    except WorldAbortedError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    waited_until = time.monotonic()
    thread.join(30)
    assert not thread.is_alive(), "the abort did not return within 30 s"
    rebuild_started = time.monotonic()
    abort_groups(guard)
    guard, value = rebuilt_sum(2, device)
    rebuilt = time.monotonic()
    abort_s = times["abort_returned"] - times["abort_started"]
    result["wait"] = {
        "refused": refused, "rebuilt_sum": value, "abort_s": abort_s,
        # The host waited for the sleep, which no abort can cut short (in training the
        # pending collective itself is what the abort releases): counted apart.
        "host_waited_after_abort_s": waited_until - times["abort_started"],
        "rebuild_s": rebuilt - rebuild_started,
        "rebuilt_s": abort_s + rebuilt - rebuild_started,
        "gpu_busy_after_abort_s": max(0.0, gpu_free_at - times["abort_returned"]),
    }
    log(f"default fence: {json.dumps(result['wait'])}")

    # 2. The fence that does not wait: the abort notes the step it let through.
    abort_groups(guard)
    torch.cuda.synchronize()  # the first sleep is over
    later = StepFence(device, mode=FenceMode.LATER)
    guard = build(3, device, later)
    gpu_free_at = queue_pending_collective(device, cycles)
    later.before_optimizer_step(guard)  # returns at once: the step is applied
    times = {}
    thread = abort_later(guard, times)
    thread.join(30)
    assert not thread.is_alive(), "the abort did not return within 30 s"
    spoiled = later.spoiled
    rebuild_started = time.monotonic()
    abort_groups(guard)
    guard, value = rebuilt_sum(4, device)
    rebuilt = time.monotonic()
    result["later"] = {
        "spoiled": spoiled, "rebuilt_sum": value,
        "abort_s": times["abort_returned"] - times["abort_started"],
        "rebuild_s": rebuilt - rebuild_started,
        # Nothing waited for the GPU here: abort to a working world, while the GPU still
        # runs the queued sleep.
        "rebuilt_s": rebuilt - times["abort_started"],
        "gpu_busy_after_abort_s": max(0.0, gpu_free_at - times["abort_returned"]),
    }
    log(f"fence that does not wait: {json.dumps(result['later'])}")
    abort_groups(guard)
    torch.cuda.synchronize()

    # 3. The device gate: the step is queued, skipped on the GPU, and rewound to.
    gate = StepFence(device, mode=FenceMode.DEVICE)
    guard = build(5, device, gate)
    weight = torch.nn.Parameter(torch.ones(1 << 20, device=device))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.ones_like(weight)
    optimizer.step()  # the optimizer's state exists (no gate: no world yet for it)
    torch.cuda.synchronize()
    before = weight.detach().clone()
    steps_before = float(optimizer.state[weight]["step"])
    gpu_free_at = queue_pending_collective(device, cycles)
    queued = time.monotonic()
    gate.before_optimizer_step(guard, optimizer, snapshot=lambda: "step 7")
    optimizer.step()
    gate.after_optimizer_step(optimizer)
    host_s = time.monotonic() - queued
    times = {}
    thread = abort_later(guard, times)
    thread.join(30)
    assert not thread.is_alive(), "the abort did not return within 30 s"
    gate.settle(guard)  # waits for the stream (released by the abort), reads the gates
    abort_groups(guard)
    result["device"] = {
        "host_queued_s": host_s,  # the host did not wait for the GPU's sleep
        "skipped": bool(torch.equal(weight.detach(), before))
        and float(optimizer.state[weight]["step"]) == steps_before,
        "rewind_point": gate.rewind_point(), "spoiled": gate.spoiled,
        "found_inf_left": hasattr(optimizer, "found_inf"),
        "gpu_busy_after_abort_s": max(0.0, gpu_free_at - times["abort_returned"]),
    }
    guard = build(6, device, gate)  # a new world: a new gate, its steps applied
    gate.before_optimizer_step(guard, optimizer, snapshot=lambda: "step 7")
    optimizer.step()
    gate.after_optimizer_step(optimizer)
    gate.settle(guard)
    result["device"]["applied_in_the_next_world"] = not torch.equal(weight.detach(), before)
    log(f"device gate: {json.dumps(result['device'])}")
    abort_groups(guard)
    torch.cuda.synchronize()
    result["within_2s"] = all(result[k]["rebuilt_s"] <= 2.0 for k in ("wait", "later"))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
