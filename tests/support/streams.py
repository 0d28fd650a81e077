"""A stand-in for CUDA streams and events that keeps their ordering, for tests without a GPU.

Work queued on a :class:`SimStream` does not run when it is queued: it runs when the test (or a
host wait) lets the stream advance, in queue order, and a stream that waits for an event stops
there until the event has completed on its own stream. So the tests can put the host far ahead
of the "device", interleave streams adversarially, and check what each queued copy or update
saw when it ran. Tensors stay on the CPU; "device" tensors are the ones the test says are
(:meth:`StreamSim.on_device`), and they are only changed by work queued on a stream.

:class:`SimDeviceApi` is :class:`checkpointing.staging.DeviceApi` over the simulator.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SimDeviceApi", "SimEvent", "SimStream", "StreamSim"]


class SimEvent:
    """A CUDA event: recorded on a stream, completed when that stream reaches it."""

    def __init__(self, sim: StreamSim) -> None:
        self.sim = sim
        self.done = True  # an event never recorded counts as completed, as in CUDA
        self.at: int | None = None  # the simulator's clock when it completed

    def record(self, stream: SimStream | None = None) -> None:
        self.done = False
        (stream or self.sim.main).queue.append(("mark", self))

    def query(self) -> bool:
        if not self.done and self.sim.runs_when_polled:
            self.sim.advance_any()
        return self.done

    def synchronize(self) -> None:
        self.sim.host_wait(lambda: self.done)

    def elapsed_time(self, end: SimEvent) -> float:
        """Milliseconds: one clock tick is a millisecond."""
        assert self.at is not None and end.at is not None, "both events must have completed"
        return float(end.at - self.at)


class SimStream:
    """A queue of work that runs in order when the simulator advances it."""

    def __init__(self, sim: StreamSim, name: str) -> None:
        self.sim = sim
        self.name = name
        self.queue: deque[tuple[str, Any]] = deque()
        self.syncs = 0  # host waits for this whole stream

    def enqueue(self, work: Callable[[], None]) -> None:
        self.queue.append(("run", work))

    def wait_event(self, event: SimEvent) -> None:
        self.queue.append(("wait", event))

    def synchronize(self) -> None:
        self.syncs += 1
        self.sim.host_wait(lambda: not self.queue)

    def advance(self) -> bool:
        """Runs the next piece of work if it can run; whether it did."""
        if not self.queue:
            return False
        kind, item = self.queue[0]
        if kind == "wait" and not item.done:
            return False
        self.queue.popleft()
        self.sim.clock += 1
        if kind == "run":
            item()
        elif kind == "mark":
            item.done = True
            item.at = self.sim.clock
        return True

    def run(self) -> None:
        """Runs this stream as far as it can go."""
        while self.advance():
            pass


class StreamSim:
    """The streams of one simulated device, and the host waits on them."""

    def __init__(self) -> None:
        self.clock = 0
        self.main = SimStream(self, "main")
        self.streams = [self.main]
        self._device: set[int] = set()
        #: Whether the device makes progress while the host polls an event (as a real one
        #: does on its own); off, it runs only when the test or a host wait lets it.
        self.runs_when_polled = False

    def new_stream(self, name: str) -> SimStream:
        stream = SimStream(self, name)
        self.streams.append(stream)
        return stream

    def on_device(self, *tensors: torch.Tensor) -> None:
        """Marks tensors (their storage: views and detached aliases too) as device tensors."""
        self._device.update(t.untyped_storage().data_ptr() for t in tensors)

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._device

    def advance_any(self) -> bool:
        """Runs one piece of work of the first stream that can run one."""
        return any(stream.advance() for stream in self.streams)

    def run_all(self) -> None:
        """Advances every stream until none can (round robin)."""
        while any(stream.advance() for stream in self.streams):
            pass

    def host_wait(self, until: Callable[[], bool]) -> None:
        """What a host wait does: the device runs until ``until`` holds.

        Raises:
            AssertionError: If no stream can make progress before it holds (the real wait
                would hang).
        """
        while not until():
            if not any(stream.advance() for stream in self.streams):
                raise AssertionError("the host would wait forever: every stream is blocked")


class SimDeviceApi:
    """:class:`checkpointing.staging.DeviceApi` over a :class:`StreamSim`."""

    def __init__(self, sim: StreamSim) -> None:
        self.sim = sim
        #: ``(source storage pointer, stream)`` of each ``record_stream``.
        self.record_stream_calls: list[tuple[int, SimStream]] = []

    def is_device(self, tensor: torch.Tensor) -> bool:
        return self.sim.is_device(tensor)

    def host_buffer(self, shape: torch.Size, dtype: torch.dtype, device_source: bool
                    ) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def current_stream(self, device: torch.device) -> SimStream:
        return self.sim.main

    def side_stream(self, device: torch.device) -> SimStream:
        return self.sim.new_stream("side")

    def event(self) -> SimEvent:
        return SimEvent(self.sim)

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        stream.wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimStream | None) -> None:
        target = stream or self.sim.main
        target.enqueue(lambda: dst.copy_(src))  # reads the source when the stream runs it
        if stream is not None:
            self.record_stream_calls.append((src.untyped_storage().data_ptr(), stream))
