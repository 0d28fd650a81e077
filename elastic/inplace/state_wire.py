"""The wire format of a heal: a state tree as a JSON header plus raw tensor bytes.

A survivor sends its state to a rank that is behind (:mod:`~elastic.inplace.heal`). Nothing
is pickled: the tree's structure and its small leaves (steps, learning rates, RNG tuples, the
sampler cursor) travel as JSON, each tensor as a placeholder ``{"tensor": i}`` with its dtype,
shape and source device type in the header, and the tensors' bytes after it. Decoding is
plain JSON and a fixed set of containers, so a peer cannot make a receiver run code (the
property ``torch.load(weights_only=True)`` gave the old payload).

Encoded values: ``None``, ``bool``, ``int``, ``float`` (NaN and infinities included) and
``str`` as themselves; every container is a one-key object, so that decoding is unambiguous:
``{"list": [...]}``, ``{"tuple": [...]}``, ``{"dict": [[key, value], ...]}`` (keys of any
encodable hashable type: optimizer state dicts have ``int`` keys), ``{"bytes": base64}`` and
``{"tensor": index}``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

__all__ = ["FORMAT_VERSION", "Header", "SourceError", "TensorSpec", "decode_header",
           "encode_error", "encode_header", "flatten", "tensor_paths", "unflatten"]

FORMAT_VERSION: Final = 1
_MAX_DEPTH: Final = 64

Path = tuple[str, ...]
"""Where a value sits in a tree: each key JSON-encoded, so ``1`` and ``"1"`` differ."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a receiver needs to know of one tensor before its bytes arrive.

    Attributes:
        dtype: Its dtype.
        shape: Its shape.
        device_type: The device type it lived on at the source (``"cpu"``, ``"cuda"``).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    device_type: str

    @property
    def nbytes(self) -> int:
        """Size of its data in bytes."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded header: the tree with tensor placeholders, and each tensor's spec."""

    tree: Any
    tensors: tuple[TensorSpec, ...]


def flatten(tree: Any) -> tuple[Any, list[torch.Tensor], list[Path]]:
    """Splits ``tree`` into an encodable skeleton, its tensors and their paths.

    Raises:
        TypeError: On a value the format cannot carry (named by its path), or a tensor that is
            not a plain dense tensor (a DTensor, a sparse or quantized tensor).
    """
    tensors: list[torch.Tensor] = []
    paths: list[Path] = []

    def walk(value: Any, path: Path) -> Any:
        if len(path) > _MAX_DEPTH:
            raise TypeError(f"state nested deeper than {_MAX_DEPTH} levels at {_show(path)}.")
        if isinstance(value, torch.Tensor):
            if not (type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter)) \
                    or value.layout != torch.strided or value.is_quantized:
                raise TypeError(
                    f"state value at {_show(path)} is a {type(value).__name__} "
                    f"({value.layout}); only plain dense tensors can be healed in place."
                )
            tensors.append(value)
            paths.append(path)
            return {"tensor": len(tensors) - 1}
        if value is None or type(value) in (bool, int, float, str):
            return value
        if isinstance(value, bytes):
            return {"bytes": base64.b64encode(value).decode("ascii")}
        if isinstance(value, list):
            return {"list": [walk(v, (*path, str(i))) for i, v in enumerate(value)]}
        if isinstance(value, tuple):
            return {"tuple": [walk(v, (*path, str(i))) for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            items = []
            for key, item in value.items():
                encoded = walk(key, (*path, "<key>"))
                items.append([encoded, walk(item, (*path, json.dumps(encoded)))])
            return {"dict": items}
        raise TypeError(
            f"state value at {_show(path)} has type {type(value).__name__}, which a heal "
            "cannot send; keep state dicts to tensors, numbers, strings, bytes, lists, tuples "
            "and dicts."
        )

    return walk(tree, ()), tensors, paths


def _show(path: Path) -> str:
    return "/".join(path) or "the top level"


def encode_header(skeleton: Any, tensors: list[torch.Tensor]) -> bytes:
    """The header for :func:`flatten`'s output."""
    specs = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
              "device": t.device.type} for t in tensors]
    doc = {"version": FORMAT_VERSION, "tree": skeleton, "tensors": specs}
    return json.dumps(doc, separators=(",", ":")).encode()


def encode_error(message: str) -> bytes:
    """A header that tells the receivers the source could not send its state."""
    return json.dumps({"version": FORMAT_VERSION, "error": message}).encode()


class SourceError(TypeError):
    """The source rank could not send its state (it raised the same error itself)."""


def decode_header(payload: bytes) -> Header:
    """Parses and validates a header written by :func:`encode_header`.

    Raises:
        SourceError: If the source sent an error header.
        ValueError: If the header is malformed.
    """
    doc = json.loads(payload.decode())
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"heal header of an unknown format ({str(doc)[:80]!r}).")
    if "error" in doc:
        raise SourceError(f"the source rank could not send its state: {doc['error']}")
    specs = []
    for raw in doc["tensors"]:
        dtype = getattr(torch, str(raw["dtype"]), None)
        shape = raw["shape"]
        if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) \
                or not all(type(d) is int and d >= 0 for d in shape) \
                or not isinstance(raw["device"], str):
            raise ValueError(f"heal header has an invalid tensor spec ({raw!r}).")
        specs.append(TensorSpec(dtype, tuple(shape), raw["device"]))
    tree = doc["tree"]
    _check_tree(tree, len(specs), 0)
    return Header(tree=tree, tensors=tuple(specs))


def _check_tree(node: Any, count: int, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError("heal header nests too deep.")
    if node is None or type(node) in (bool, int, float, str):
        return
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"heal header has an invalid node ({str(node)[:80]!r}).")
    (tag, body), = node.items()
    if tag == "tensor":
        if type(body) is not int or not 0 <= body < count:
            raise ValueError(f"heal header names tensor {body!r} of {count}.")
    elif tag == "bytes":
        if not isinstance(body, str):
            raise ValueError("heal header has invalid bytes.")
    elif tag in ("list", "tuple"):
        if not isinstance(body, list):
            raise ValueError(f"heal header has an invalid {tag}.")
        for item in body:
            _check_tree(item, count, depth + 1)
    elif tag == "dict":
        if not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2
                                                 for p in body):
            raise ValueError("heal header has an invalid dict.")
        for key, value in body:
            _check_tree(key, count, depth + 1)
            _check_tree(value, count, depth + 1)
    else:
        raise ValueError(f"heal header has an unknown tag ({tag!r}).")


def tensor_paths(tree: Any) -> list[Path]:
    """The path of each tensor placeholder of a header tree, in tensor-index order."""
    found: dict[int, Path] = {}

    def walk(node: Any, path: Path) -> None:
        if not isinstance(node, dict):
            return
        (tag, body), = node.items()
        if tag == "tensor":
            found[body] = path
        elif tag in ("list", "tuple"):
            for i, item in enumerate(body):
                walk(item, (*path, str(i)))
        elif tag == "dict":
            for key, value in body:
                walk(value, (*path, json.dumps(key)))

    walk(tree, ())
    return [found[i] for i in sorted(found)]


def unflatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuilds the value a header tree encodes, with ``tensors`` in its placeholders."""
    if not isinstance(tree, dict):
        return tree
    (tag, body), = tree.items()
    if tag == "tensor":
        return tensors[body]
    if tag == "bytes":
        return base64.b64decode(body)
    if tag == "list":
        return [unflatten(v, tensors) for v in body]
    if tag == "tuple":
        return tuple(unflatten(v, tensors) for v in body)
    return {_hashable(unflatten(k, tensors)): unflatten(v, tensors) for k, v in body}


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise ValueError(f"heal header has an unhashable dict key ({key!r}).") from None
    return key
