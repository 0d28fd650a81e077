"""Copy a (nested) state dict to host memory, reusing buffers between saves.

First-touch of fresh host memory is slow, so each tensor's buffer is kept, keyed by its path,
shape and dtype, and overwritten by the next save. Only one save is in flight at a time, so a
buffer is never overwritten while a write still reads it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

_Key = tuple[str, tuple[int, ...], torch.dtype]


class HostStager:
    """Stages state into reusable CPU buffers (pinned when the source is on an accelerator)."""

    def __init__(self) -> None:
        self._buffers: dict[_Key, torch.Tensor] = {}
        self.staged_bytes = 0

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Return a host copy of ``state``; ``Stateful`` values are replaced by their state dict."""
        self.staged_bytes = 0
        used: set[_Key] = set()
        out = {
            str(k): self._copy(f"{k}", v.state_dict() if isinstance(v, Stateful) else v, used)
            for k, v in state.items()
        }
        # Buffers of tensors that disappeared would otherwise live forever.
        for key in set(self._buffers) - used:
            del self._buffers[key]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
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
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            # DTensor and other subclasses: let torch produce its own host copy.
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
        buf.copy_(src, non_blocking=src.device.type == "cuda")
        self.staged_bytes += buf.numel() * buf.element_size()
        return buf
