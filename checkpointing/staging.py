"""Copy a (nested) state dict to host memory, reusing buffers between saves.

First-touch of fresh host memory is slow, so each tensor's buffer is kept, keyed by its path,
shape and dtype, and overwritten by the next save. Only one save is in flight at a time, so a
buffer is never overwritten while a write still reads it.

A DTensor (FSDP2, tensor parallelism) is staged as its local shard, into a kept buffer like
any tensor, and handed to DCP as a DTensor with the same spec (mesh, placements, global
shape) whose local tensor is that host buffer: what ``DTensor.to("cpu")`` gives, without a
fresh allocation per save. Copies from an accelerator are issued asynchronously into pinned
buffers and waited for once per save, on the streams that issued them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torch_private import dtensor_spec

_Key = tuple[str, tuple[int, ...], torch.dtype]


class HostStager:
    """Stages state into reusable CPU buffers (pinned when the source is on an accelerator)."""

    def __init__(self) -> None:
        self._buffers: dict[_Key, torch.Tensor] = {}
        self.staged_bytes = 0
        self._copying_from: set[torch.device] = set()  # devices with copies in flight

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Return a host copy of ``state``; ``Stateful`` values are replaced by their state dict."""
        self.staged_bytes = 0
        self._copying_from.clear()
        used: set[_Key] = set()
        out = {
            str(k): self._copy(f"{k}", v.state_dict() if isinstance(v, Stateful) else v, used)
            for k, v in state.items()
        }
        # Buffers of tensors that disappeared would otherwise live forever.
        for key in set(self._buffers) - used:
            del self._buffers[key]
        for device in self._copying_from:
            # Only the streams the copies were issued on: the save waits for the step's
            # kernels queued before them, not for unrelated work on other streams.
            torch.cuda.current_stream(device).synchronize()
        return out

    def _copy(self, path: str, value: Any, used: set[_Key]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(path, value, used)
        if isinstance(value, Mapping):
            return {k: self._copy(f"{path}.{k}", v, used) for k, v in value.items()}
        if isinstance(value, list):
            return [self._copy(f"{path}.{i}", v, used) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._copy(f"{path}.{i}", v, used) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _copy_tensor(self, path: str, tensor: torch.Tensor, used: set[_Key]) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            local = self._copy_tensor(path, tensor.to_local().detach(), used)
            # DTensor's own constructor, as torch's DCP staging builds it: from_local() would
            # move the host shard back to the mesh's device.
            return DTensor(  # type: ignore[no-untyped-call]
                local, dtensor_spec(tensor), requires_grad=False)
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            # Other subclasses: let torch produce its own host copy.
            return tensor.detach().to("cpu", copy=True)
        src = tensor.detach()
        key: _Key = (path, tuple(src.shape), src.dtype)
        used.add(key)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(
                src.shape, dtype=src.dtype, device="cpu", pin_memory=src.device.type == "cuda"
            )
            self._buffers[key] = buf
        asynchronous = src.device.type == "cuda"
        buf.copy_(src, non_blocking=asynchronous)
        if asynchronous:
            self._copying_from.add(src.device)
        self.staged_bytes += buf.numel() * buf.element_size()
        return buf
