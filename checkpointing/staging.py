"""Copy a (nested) state dict to host memory, reusing buffers between saves.

First-touch of fresh host memory is slow, and pinning it slower still (about 1.8 GB/s for
CUDA's page-locked memory), so each tensor's buffer is kept, keyed by its path, shape and
dtype, and overwritten by the next save. Only one save is in flight at a time, so a buffer is
never overwritten while a write still reads it. :meth:`HostStager.reserve` allocates the
buffers of a state ahead of its first save, on a background thread.

A DTensor (FSDP2, tensor parallelism) is staged as its local shard, into a kept buffer like
any tensor, and handed to DCP as a DTensor with the same spec (mesh, placements, global
shape) whose local tensor is that host buffer: what ``DTensor.to("cpu")`` gives, without a
fresh allocation per save.

Copies from an accelerator go into pinned buffers, in one of two ways:

* **in order** (:meth:`HostStager.stage`): on the stream that produced the state, waited for
  once per save before it returns;
* **overlapped** (:meth:`HostStager.stage_async`): on a side stream that first waits for an
  event recorded on the training stream when the save is called, so the copy sees the state
  after every kernel queued so far (the step being saved) and nothing queued later. The call
  returns at once. Until :meth:`StagedCopy.hold` makes the training stream wait for the copy,
  nothing queued on it may write a saved tensor; each source is marked as used by the side
  stream (``record_stream``) so that the caching allocator does not hand its memory to
  another tensor while the copy reads it. :meth:`StagedCopy.wait` is the host's wait (the
  writer's, before it reads the buffers).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torch_private import dtensor_spec

__all__ = ["CudaApi", "DeviceApi", "HostStager", "StagedCopy"]

logger = logging.getLogger(__name__)

_Key = tuple[str, tuple[int, ...], torch.dtype]


class DeviceApi(Protocol):
    """The streams and events the stager uses (CUDA's; tests pass a stand-in)."""

    def is_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on the accelerator (its copy runs on a stream)."""

    def host_buffer(self, shape: torch.Size, dtype: torch.dtype, device_source: bool
                    ) -> torch.Tensor:
        """A host tensor to copy into (pinned for an accelerator source)."""

    def current_stream(self, device: torch.device) -> Any:
        """The stream the training thread queues its work on."""

    def side_stream(self, device: torch.device) -> Any:
        """A new stream for the copies."""

    def event(self) -> Any:
        """A new timing event (``record(stream)``, ``query()``, ``synchronize()``,
        ``elapsed_time(end)`` in milliseconds)."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """Makes ``stream`` wait for ``event`` (the host does not wait)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any | None) -> None:
        """Queues ``dst <- src`` on ``stream`` (``None``: the current stream), non-blocking."""


class CudaApi:
    """:class:`DeviceApi` on CUDA."""

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def host_buffer(self, shape: torch.Size, dtype: torch.dtype, device_source: bool
                    ) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=device_source)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def side_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any | None) -> None:
        if stream is None:
            dst.copy_(src, non_blocking=True)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        # The source's memory must not go to another tensor while the side stream reads it.
        src.record_stream(stream)


@dataclass(eq=False)
class StagedCopy:
    """A save's host copy, complete (in order) or still running on side streams (overlapped).

    Attributes:
        host_state: The host copy (valid once :meth:`wait` returned).
        nbytes: Bytes staged.
        stage_s: Host time the staging call took (walking the state, queueing the copies).
    """

    host_state: dict[str, Any]
    nbytes: int
    stage_s: float = 0.0
    _api: DeviceApi | None = None
    # device -> (side stream, event when the copy started, event when it is complete)
    _copies: dict[torch.device, tuple[Any, Any, Any]] = field(default_factory=dict)
    _held: dict[torch.device, tuple[Any, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def overlapped(self) -> bool:
        """Whether copies still run (or ran) on side streams after the call returned."""
        return bool(self._copies)

    def wait(self) -> None:
        """Waits on the host until every copy is complete (then ``host_state`` is the step's)."""
        for _stream, _start, done in self._copies.values():
            done.synchronize()

    def done(self) -> bool:
        """Whether every copy is complete (without waiting)."""
        return all(done.query() for _s, _b, done in self._copies.values())

    def hold(self) -> None:
        """Makes each training stream wait for the copy before it runs anything queued from
        now on (call it before the first kernel that writes a saved tensor); only the first
        call does anything."""
        api = self._api
        with self._lock:
            if api is None or self._held or not self._copies:
                return
            for device, (_stream, _start, done) in self._copies.items():
                stream = api.current_stream(device)
                before, after = api.event(), api.event()
                before.record(stream)
                api.wait_event(stream, done)
                after.record(stream)
                self._held[device] = (before, after)

    @property
    def held(self) -> bool:
        """Whether :meth:`hold` ran (the training streams wait for the copy)."""
        return bool(self._held) or not self._copies

    def timings(self) -> tuple[float, float] | None:
        """``(copy_s, held_s)`` once known, else ``None``: how long the copies ran on their
        side streams, and how long the training streams waited for them (the most of any
        device); ``(0, 0)`` for a copy made in order (``stage_s`` is its time)."""
        if not self._copies:
            return 0.0, 0.0
        if not self._held:
            return None
        copy_ms = held_ms = 0.0
        for device, (_stream, start, done) in self._copies.items():
            before, after = self._held[device]
            if not (done.query() and after.query()):
                return None
            copy_ms = max(copy_ms, start.elapsed_time(done))
            held_ms = max(held_ms, before.elapsed_time(after))
        return copy_ms / 1e3, held_ms / 1e3


class HostStager:
    """Stages state into reusable CPU buffers (pinned when the source is on an accelerator).

    Args:
        api: Streams and events (default: CUDA's; tests pass a stand-in).
    """

    def __init__(self, api: DeviceApi | None = None) -> None:
        self._api: DeviceApi = api or CudaApi()
        self._buffers: dict[_Key, torch.Tensor] = {}
        self._buffers_lock = threading.Lock()
        self.staged_bytes = 0
        self._side: dict[torch.device, Any] = {}
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None

    # ---------------------------------------------------------------------------- reserve
    def reserve(self, state: Mapping[str, Any]) -> int:
        """Allocates, on a background thread, the buffers that staging ``state`` will need
        and that do not exist yet (the state is walked on the calling thread).

        Returns:
            Bytes to allocate (0: every buffer exists).
        """
        self.join_reserve()
        specs: dict[_Key, tuple[torch.Size, torch.dtype, bool]] = {}

        def note(path: str, src: torch.Tensor) -> torch.Tensor:
            key: _Key = (path, tuple(src.shape), src.dtype)
            if key not in self._buffers:
                specs[key] = (src.shape, src.dtype, self._api.is_device(src))
            return src

        self._walk(state, note)
        total = sum(shape.numel() * dtype.itemsize for shape, dtype, _ in specs.values())
        if not specs:
            return 0

        def allocate() -> None:
            try:
                # Largest first: each is one allocation, kept apart so that a save can
                # start on what exists if it must.
                for key, (shape, dtype, pinned) in sorted(
                        specs.items(), key=lambda kv: -kv[1][0].numel() * kv[1][1].itemsize):
                    buffer = self._api.host_buffer(shape, dtype, pinned)
                    with self._buffers_lock:
                        self._buffers.setdefault(key, buffer)
            except BaseException as exc:  # e.g. pinned memory exhausted: staging allocates
                self._reserve_error = exc

        thread = threading.Thread(target=allocate, name="checkpoint-staging-reserve",
                                  daemon=True)
        self._reserving = thread
        thread.start()
        return total

    @property
    def reserving(self) -> bool:
        """Whether a :meth:`reserve` is still allocating."""
        thread = self._reserving
        return thread is not None and thread.is_alive()

    def join_reserve(self) -> None:
        """Waits for a :meth:`reserve` in progress (its failure is logged: staging then
        allocates what is missing)."""
        thread, self._reserving = self._reserving, None
        if thread is not None:
            thread.join()
        error, self._reserve_error = self._reserve_error, None
        if error is not None:
            logger.warning("allocating the checkpoint staging buffers ahead failed (%s); "
                           "the save allocates them", error)

    # ------------------------------------------------------------------------------ stage
    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Return a host copy of ``state``; ``Stateful`` values are replaced by their state dict.
        The copy is complete on return."""
        return self.stage_async(state, overlap=False).host_state

    def stage_async(self, state: Mapping[str, Any], *, overlap: bool) -> StagedCopy:
        """Starts a host copy of ``state`` (see the module docstring).

        Args:
            state: Tensors, nested containers and ``Stateful`` objects.
            overlap: Copy accelerator tensors on side streams and return at once (the
                caller must :meth:`StagedCopy.hold` before changing the state); ``False``:
                copy in order and wait.
        """
        started = time.monotonic()
        self.join_reserve()
        self.staged_bytes = 0
        used: set[_Key] = set()
        devices: dict[torch.device, Any] = {}  # device -> side stream (overlap) or None
        api = self._api

        def stage_tensor(path: str, src: torch.Tensor) -> torch.Tensor:
            key: _Key = (path, tuple(src.shape), src.dtype)
            used.add(key)
            on_device = api.is_device(src)
            with self._buffers_lock:
                buf = self._buffers.get(key)
                if buf is None:
                    buf = api.host_buffer(src.shape, src.dtype, on_device)
                    self._buffers[key] = buf
            self.staged_bytes += buf.numel() * buf.element_size()
            if not on_device:
                buf.copy_(src)
                return buf
            if src.device not in devices:
                devices[src.device] = self._start_side(src.device) if overlap else None
            side = devices[src.device]
            api.copy(buf, src, side[0] if side is not None else None)
            return buf

        out = self._walk(state, stage_tensor)
        with self._buffers_lock:
            # Buffers of tensors that disappeared would otherwise live forever.
            for key in set(self._buffers) - used:
                del self._buffers[key]
        staged = StagedCopy(out, self.staged_bytes, _api=api)
        for device, side in devices.items():
            if side is None:
                # Only the streams the copies were issued on: the save waits for the step's
                # kernels queued before them, not for unrelated work on other streams.
                api.current_stream(device).synchronize()
            else:
                stream, start = side
                done = api.event()
                done.record(stream)
                staged._copies[device] = (stream, start, done)
        staged.stage_s = time.monotonic() - started
        return staged

    def _start_side(self, device: torch.device) -> tuple[Any, Any]:
        """The side stream of ``device``, made to wait for what the training stream queued."""
        api = self._api
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = api.side_stream(device)
        ready = api.event()
        ready.record(api.current_stream(device))
        api.wait_event(stream, ready)
        start = api.event()
        start.record(stream)
        return stream, start

    # ------------------------------------------------------------------------------- walk
    def _walk(self, state: Mapping[str, Any],
              on_tensor: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
        return {
            str(k): self._copy(f"{k}", v.state_dict() if isinstance(v, Stateful) else v,
                               on_tensor)
            for k, v in state.items()
        }

    def _copy(self, path: str, value: Any,
              on_tensor: Callable[[str, torch.Tensor], torch.Tensor]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(path, value, on_tensor)
        if isinstance(value, Mapping):
            return {k: self._copy(f"{path}.{k}", v, on_tensor) for k, v in value.items()}
        if isinstance(value, list):
            return [self._copy(f"{path}.{i}", v, on_tensor) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._copy(f"{path}.{i}", v, on_tensor) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _copy_tensor(self, path: str, tensor: torch.Tensor,
                     on_tensor: Callable[[str, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            local = self._copy_tensor(path, tensor.to_local().detach(), on_tensor)
            # DTensor's own constructor, as torch's DCP staging builds it: from_local() would
            # move the host shard back to the mesh's device.
            return DTensor(  # type: ignore[no-untyped-call]
                local, dtensor_spec(tensor), requires_grad=False)
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            # Other subclasses: let torch produce its own host copy.
            return tensor.detach().to("cpu", copy=True)
        return on_tensor(path, tensor.detach())
