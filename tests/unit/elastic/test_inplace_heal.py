"""Heal without a world: the wire format, where received tensors land (``map_location``),
and a full source-to-receiver transfer over an in-memory link between two threads."""

from __future__ import annotations

import json
import math
import queue
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from checkpointing import ModelOptimizerState
from elastic.inplace import heal
from elastic.inplace.heal import agree_and_heal, receive_state, send_state, target_device
from elastic.inplace.state_wire import (
    SourceError,
    TensorSpec,
    decode_header,
    encode_header,
    flatten,
    tensor_paths,
    unflatten,
)


def test_the_wire_format_round_trips_every_leaf_type_it_carries() -> None:
    tree = {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(0)},
        "optim": {"state": {0: {"step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0],
                                    "amsgrad": False, "foreach": None}]},
        "python_rng": (3, tuple(range(5)), None),
        "nan": math.nan, "inf": -math.inf, "one": 1, "one_f": 1.0, "flag": True,
        "blob": b"\x00\xff", ("tuple", 1): "tuple key",
    }
    skeleton, tensors, paths = flatten(tree)
    header = decode_header(encode_header(skeleton, tensors))
    assert [s.shape for s in header.tensors] == [(2, 3), (0,), ()]
    assert tensor_paths(header.tree) == paths
    back = unflatten(header.tree, tensors)
    assert back["model"]["w"] is tensors[0] and back["optim"]["state"][0]["step"] is tensors[2]
    assert back["python_rng"] == (3, (0, 1, 2, 3, 4), None)
    assert type(back["one"]) is int and type(back["one_f"]) is float and back["flag"] is True
    assert math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert back["blob"] == b"\x00\xff" and back[("tuple", 1)] == "tuple key"
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_values_the_format_cannot_carry_are_refused_naming_where_they_are() -> None:
    with pytest.raises(TypeError, match=r'state value at "train"/"extra"/"fn" has type function'):
        flatten({"train": {"extra": {"fn": lambda: None}}})
    with pytest.raises(TypeError, match=r"only plain dense tensors"):
        flatten({"s": torch.eye(2).to_sparse()})


@pytest.mark.parametrize("header", [
    {"version": 1, "tree": {"tensor": 1}, "tensors": [
        {"dtype": "float32", "shape": [1], "device": "cpu"}]},
    {"version": 1, "tree": {"eval": "os.system('x')"}, "tensors": []},
    {"version": 1, "tree": None, "tensors": [{"dtype": "Tensor", "shape": [1],
                                              "device": "cpu"}]},
    {"version": 1, "tree": None, "tensors": [{"dtype": "float32", "shape": [-1],
                                              "device": "cpu"}]},
    {"version": 2, "tree": None, "tensors": []},
])
def test_a_malformed_header_is_refused(header: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"^heal header"):
        decode_header(json.dumps(header).encode())


def test_received_tensors_land_on_the_receivers_device_or_their_local_counterparts() -> None:
    cuda1 = torch.device("cuda", 1)  # never allocated: only the decision is checked
    on_gpu = TensorSpec(torch.float32, (4, 2), "cuda")
    on_cpu = TensorSpec(torch.int64, (), "cpu")
    assert target_device(on_gpu, None, cuda1) == (cuda1, False)
    assert target_device(on_cpu, None, cuda1) == (torch.device("cpu"), False)
    local = torch.empty(4, 2)
    assert target_device(on_gpu, local, cuda1) == (torch.device("cpu"), True)
    assert target_device(on_gpu, torch.empty(2, 4), cuda1) == (torch.device("cpu"), False)
    assert target_device(on_gpu, torch.empty(4, 2, dtype=torch.float64), cuda1)[1] is False


class _QueueLink:
    """Two ranks (0 and 1) in one process: messages are copied through per-peer queues.

    ``header`` may rewrite the header a source sends (its length message follows suit);
    ``cut`` may raise instead of sending the n-th message (a source dying).
    """

    def __init__(self, rank: int, boxes: dict[int, queue.Queue[torch.Tensor]], *,
                 header: Callable[[bytes], bytes] | None = None,
                 cut: int | None = None) -> None:
        self.rank = rank
        self.boxes = boxes
        self.header = header
        self.cut = cut
        self.sent = 0

    def send(self, buf: torch.Tensor, peers: Sequence[int]) -> None:
        index, self.sent = self.sent, self.sent + 1
        if index == self.cut:
            raise ConnectionError("the source died")
        if index == 0 and self.header is not None:
            return  # the header's length: sent with the rewritten header
        messages = [buf.clone()]
        if index == 1 and self.header is not None:
            payload = self.header(buf.numpy().tobytes())
            messages = [torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8),
                        torch.frombuffer(bytearray(payload), dtype=torch.uint8)]
        for peer in peers:
            for message in messages:
                self.boxes[peer].put(message)

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        message = self.boxes[self.rank].get(timeout=2)
        if message.numel() != buf.numel():
            raise RuntimeError(f"message of {message.numel()} bytes into {buf.numel()}")
        buf.copy_(message)


def _transfer(source_state: dict[str, Any], receiver_state: dict[str, Any], *,
              chunk_bytes: int = 64, device: torch.device | None = None,
              header: Callable[[bytes], bytes] | None = None, cut: int | None = None,
              ) -> tuple[tuple[int, int], tuple[int, int]]:
    boxes: dict[int, queue.Queue[torch.Tensor]] = {0: queue.Queue(), 1: queue.Queue()}
    sent: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def source() -> None:
        try:
            sent.append(send_state(_QueueLink(0, boxes, header=header, cut=cut), [1],
                                   source_state, chunk_bytes=chunk_bytes))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=source)
    thread.start()
    try:
        got = receive_state(_QueueLink(1, boxes), 0, receiver_state, device=device,
                            chunk_bytes=chunk_bytes)
    finally:
        thread.join(10)
    if errors:
        raise errors[0]
    return sent[0], got


def _trained(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).double()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(4, 5, dtype=torch.float64)).square().sum().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    return model, optim, sched


def _tensors_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(
            _tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_a_newcomer_with_an_empty_optimizer_receives_the_state_bit_for_bit() -> None:
    model, optim, sched = _trained(0, 5)
    counter = {"n": 4, "rng": random.getstate()}
    view = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous on both sides
    source = {"train": ModelOptimizerState(model, optim), "sched": sched, "extra": counter,
              "view": {"t": view}}
    new_model, new_optim, new_sched = _trained(1, 0)
    assert not new_optim.state  # Adam's moments do not exist yet
    params_before = [p.data_ptr() for p in new_model.parameters()]
    fresh: dict[str, Any] = {}
    receiver = {"train": ModelOptimizerState(new_model, new_optim), "sched": new_sched,
                "extra": fresh, "view": {"t": torch.zeros(3, 4).t()}}
    (sent, source_staging), (got, staging) = _transfer(source, receiver, chunk_bytes=64)
    assert sent == got > 0 and 0 < staging <= 64 and 0 < source_staging <= 64
    assert _tensors_equal(model.state_dict(), new_model.state_dict())
    assert _tensors_equal(optim.state_dict(), new_optim.state_dict())
    assert sched.state_dict() == new_sched.state_dict()
    assert fresh == counter and torch.equal(receiver["view"]["t"], view)
    # The parameters were filled where they live (no new storage swapped in).
    assert [p.data_ptr() for p in new_model.parameters()] == params_before


def test_accelerator_tensors_of_the_source_land_on_the_receivers_own_device() -> None:
    # No GPU here: the header is rewritten to say the source's float tensors were on CUDA,
    # and the receiver's device is "meta", standing for its own GPU.
    def on_cuda(payload: bytes) -> bytes:
        doc = json.loads(payload)
        for spec in doc["tensors"]:
            if spec["dtype"].startswith("float"):
                spec["device"] = "cuda"
        return json.dumps(doc).encode()

    source = {"blob": {"w": torch.randn(3, 2), "rng": torch.get_rng_state(),
                       "kept": torch.ones(2)}}
    kept = torch.zeros(2)
    received: dict[str, Any] = {"kept": kept}
    _transfer(source, {"blob": received}, device=torch.device("meta"), header=on_cuda)
    assert received["w"].device == torch.device("meta")  # map_location: receiver's device
    assert received["rng"].device.type == "cpu"  # a CPU tensor stays on CPU
    assert received["kept"] is kept and torch.equal(kept, torch.ones(2))  # its local place


def test_a_source_that_cannot_send_its_state_makes_both_sides_raise() -> None:
    with pytest.raises((SourceError, TypeError), match="has type object"):
        _transfer({"x": {"bad": object()}}, {"x": {}})


def test_a_heal_that_fails_half_way_makes_the_rank_report_no_state() -> None:
    model, optim, _ = _trained(0, 2)
    new_model, new_optim, _ = _trained(1, 1)

    with pytest.raises(queue.Empty):  # a few data messages in, the source died
        _transfer({"train": ModelOptimizerState(model, optim)},
                  {"train": ModelOptimizerState(new_model, new_optim)}, cut=4)
    assert not torch.equal(new_model[0].weight, model[0].weight)  # partly overwritten
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert group is not None
        result = agree_and_heal(5, {}, group)
        assert result.steps == (-1,)  # not 5: its state is a mixture of two steps
        assert agree_and_heal(5, {}, group).steps == (5,)  # storage was read meanwhile
    finally:
        dist.destroy_process_group()
        heal._TORN.clear()
