"""A data-only encoding of plait's per-rank state: JSON with tagged tensors, tuples and arrays.

Decoding builds only plain values (numbers, strings, lists, dicts, tuples, tensors, NumPy arrays)
from JSON and raw bytes; unlike pickle it cannot import or call anything.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch
from plait.dist_core import dtype_name, parse_dtype

__all__ = ["StateFormatError", "decode", "encode"]

_MAGIC = "plait-state/1"


class StateFormatError(ValueError):
    """Bytes that are not a plait per-rank state (or use a type the format does not have)."""


def _to_json(obj: Any) -> Any:
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "__tensor__": dtype_name(t.dtype),
            "shape": list(t.shape),
            "data": base64.b64encode(raw).decode(),
        }
    if isinstance(obj, tuple):
        return {"__tuple__": [_to_json(x) for x in obj]}
    if isinstance(obj, list):
        return [_to_json(x) for x in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"per-rank state dict keys must be strings, got {sorted(map(repr, obj))[:5]}")
        return {"__dict__": {k: _to_json(v) for k, v in obj.items()}}
    if type(obj).__module__ == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biuf":
                raise TypeError(f"per-rank state cannot hold a NumPy array of dtype {obj.dtype}")
            return {"__ndarray__": obj.dtype.str, "shape": list(obj.shape), "data": obj.tolist()}
        return obj.item()  # a NumPy scalar
    raise TypeError(f"per-rank state cannot hold a {type(obj).__name__} (only plain values and tensors)")


def _from_json(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_from_json(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "__dict__" in obj:
        return {k: _from_json(v) for k, v in obj["__dict__"].items()}
    if "__tuple__" in obj:
        return tuple(_from_json(x) for x in obj["__tuple__"])
    if "__tensor__" in obj:
        try:
            dtype = parse_dtype(obj["__tensor__"])
        except ValueError:
            raise StateFormatError(f"unknown tensor dtype {obj['__tensor__']!r}") from None
        raw = bytearray(base64.b64decode(obj["data"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(obj["shape"]).clone()
    if "__ndarray__" in obj:
        import numpy as np

        np_dtype = np.dtype(obj["__ndarray__"])
        if np_dtype.kind not in "biuf":
            raise StateFormatError(f"unsupported array dtype {obj['__ndarray__']!r}")
        return np.array(obj["data"], dtype=np_dtype).reshape(obj["shape"])
    raise StateFormatError(f"unknown tagged object with keys {sorted(obj)}")


def encode(obj: Any) -> bytes:
    """Encode a state dict of plain values, tuples, tensors and NumPy arrays as UTF-8 JSON bytes."""
    return json.dumps({"format": _MAGIC, "state": _to_json(obj)}, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """Inverse of :func:`encode`.

    Raises:
        StateFormatError: the bytes are not an encoded plait state (e.g. a pickle).
    """
    try:
        doc = json.loads(bytes(data).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateFormatError(f"not a plait per-rank state (expected {_MAGIC} JSON): {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != _MAGIC:
        raise StateFormatError(f"not a plait per-rank state (expected format {_MAGIC!r})")
    try:
        return _from_json(doc["state"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise StateFormatError(f"malformed plait per-rank state: {e}") from None
