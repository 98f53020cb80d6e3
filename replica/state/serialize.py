"""A small, exact, pickle-free encoding for the state of ``extra`` objects
(LR schedulers, data loaders, RNG states): what their ``state_dict()`` returns.

Decoding runs no code: only None, bool, int, float (bit-exact), str, bytes,
list, tuple, dict, CPU torch tensors and numpy arrays are accepted; anything
else is refused with the path to the offending value. Floats travel as their
IEEE bits, so a learning rate comes back bit for bit.
"""

from __future__ import annotations

import array
import struct
import sys
from typing import Any

import numpy as np
import torch

__all__ = ["decode", "encode"]

_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")

# torch dtypes by name, for tensors; bfloat16 has no numpy twin, so tensors
# travel as raw bytes plus the torch dtype name.
_TORCH_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def encode(obj: Any) -> bytes:
    out = bytearray()
    _encode(obj, out, "state")
    return bytes(out)


# Where a value sits, for error messages only: the root's name, or (parent, kind, key),
# turned into text only when something cannot be encoded. Formatting every element's
# path up front cost more than encoding it (an RNG state is hundreds of ints).
_ITEM, _KEY, _VALUE = 0, 1, 2


def _where(path) -> str:
    if isinstance(path, str):
        return path
    parent, kind, key = path
    base = _where(parent)
    if kind == _ITEM:
        return f"{base}[{key}]"
    if kind == _KEY:
        return f"{base}.<key>"
    return f"{base}[{key!r}]"


def decode(data: bytes) -> Any:
    view = memoryview(data)
    obj, at = _decode(view, 0)
    if at != len(view):
        raise ValueError(f"{len(view) - at} trailing bytes after the encoded state")
    return obj


def _put_bytes(out: bytearray, b: bytes) -> None:
    out += _U32.pack(len(b))
    out += b


def _encode(obj: Any, out: bytearray, path) -> None:
    if obj is None:
        out += b"N"
    elif obj is True:
        out += b"T"
    elif obj is False:
        out += b"F"
    elif isinstance(obj, int):
        raw = int(obj).to_bytes((int(obj).bit_length() + 8) // 8 or 1, "little", signed=True)
        out += b"I"
        _put_bytes(out, raw)
    elif isinstance(obj, float):
        out += b"D" + _F64.pack(obj)
    elif isinstance(obj, str):
        out += b"S"
        _put_bytes(out, obj.encode())
    elif isinstance(obj, (bytes, bytearray)):
        out += b"B"
        _put_bytes(out, bytes(obj))
    elif isinstance(obj, (list, tuple)) and (words := _words(obj)) is not None:
        # A run of 32-bit unsigned ints (Python's random.getstate() holds 625): one array,
        # instead of an encoded int each (which cost ~0.5 ms of every commit).
        out += (b"w" if isinstance(obj, list) else b"W") + _U32.pack(len(words)) + words.tobytes()
    elif isinstance(obj, (list, tuple)):
        out += b"L" if isinstance(obj, list) else b"U"
        out += _U32.pack(len(obj))
        for i, item in enumerate(obj):
            _encode(item, out, (path, _ITEM, i))
    elif isinstance(obj, dict):
        out += b"M" + _U32.pack(len(obj))
        for key, value in obj.items():
            _encode(key, out, (path, _KEY, None))
            _encode(value, out, (path, _VALUE, key))
    elif isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise TypeError(f"{_where(path)}: cannot encode a tensor of {obj.dtype}")
        t = obj.detach().cpu().contiguous()
        out += b"X"
        _put_bytes(out, name.encode())
        out += _U32.pack(t.dim()) + b"".join(struct.pack("<q", s) for s in t.shape)
        _put_bytes(out, t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"{_where(path)}: cannot encode a numpy array of Python objects")
        a = np.ascontiguousarray(obj)
        out += b"A"
        _put_bytes(out, a.dtype.str.encode())
        out += _U32.pack(a.ndim) + b"".join(struct.pack("<q", s) for s in a.shape)
        _put_bytes(out, a.tobytes())
    elif isinstance(obj, np.generic):
        _encode(obj.item(), out, path)
    else:
        raise TypeError(f"{_where(path)}: cannot encode {type(obj).__name__} (only plain data, tensors and arrays)")


_WORDS_AT_LEAST = 16  # shorter sequences of ints are encoded an int at a time
_BIG_ENDIAN = sys.byteorder == "big"
assert array.array("I").itemsize == 4, "array('I') must hold 32-bit words"


def _words(items: list | tuple) -> array.array | None:
    """``items`` as little-endian 32-bit words if each is a plain int (not a bool) in
    [0, 2**32) and there are enough of them; else None."""
    if len(items) < _WORDS_AT_LEAST or set(map(type, items)) != {int}:
        return None
    try:
        words = array.array("I", items)
    except OverflowError:  # negative, or wider than 32 bits
        return None
    if _BIG_ENDIAN:  # pragma: no cover - the wire is little-endian
        words.byteswap()
    return words


def _get_bytes(view: memoryview, at: int) -> tuple[bytes, int]:
    (n,) = _U32.unpack_from(view, at)
    at += _U32.size
    if at + n > len(view):
        raise ValueError("encoded state is truncated")
    return bytes(view[at : at + n]), at + n


def _get_shape(view: memoryview, at: int) -> tuple[tuple[int, ...], int]:
    (ndim,) = _U32.unpack_from(view, at)
    at += _U32.size
    shape = struct.unpack_from(f"<{ndim}q", view, at)
    return tuple(shape), at + 8 * ndim


def _decode(view: memoryview, at: int) -> tuple[Any, int]:
    kind = bytes(view[at : at + 1])
    at += 1
    if kind == b"N":
        return None, at
    if kind == b"T":
        return True, at
    if kind == b"F":
        return False, at
    if kind == b"I":
        raw, at = _get_bytes(view, at)
        return int.from_bytes(raw, "little", signed=True), at
    if kind == b"D":
        return _F64.unpack_from(view, at)[0], at + _F64.size
    if kind == b"S":
        raw, at = _get_bytes(view, at)
        return raw.decode(), at
    if kind == b"B":
        return _get_bytes(view, at)
    if kind in (b"L", b"U"):
        (n,) = _U32.unpack_from(view, at)
        at += _U32.size
        items = []
        for _ in range(n):
            item, at = _decode(view, at)
            items.append(item)
        return (items if kind == b"L" else tuple(items)), at
    if kind in (b"w", b"W"):
        (n,) = _U32.unpack_from(view, at)
        at += _U32.size
        if at + 4 * n > len(view):
            raise ValueError("encoded state is truncated")
        words = array.array("I")
        words.frombytes(bytes(view[at : at + 4 * n]))
        if _BIG_ENDIAN:  # pragma: no cover
            words.byteswap()
        return (words.tolist() if kind == b"w" else tuple(words)), at + 4 * n
    if kind == b"M":
        (n,) = _U32.unpack_from(view, at)
        at += _U32.size
        result = {}
        for _ in range(n):
            key, at = _decode(view, at)
            result[key], at = _decode(view, at)
        return result, at
    if kind == b"X":
        name, at = _get_bytes(view, at)
        shape, at = _get_shape(view, at)
        raw, at = _get_bytes(view, at)
        dtype = _TORCH_DTYPES.get(name.decode())
        if dtype is None:
            raise ValueError(f"unknown tensor dtype {name!r}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone(), at
    if kind == b"A":
        dtype, at = _get_bytes(view, at)
        shape, at = _get_shape(view, at)
        raw, at = _get_bytes(view, at)
        arr = np.dtype(dtype.decode())
        if arr.hasobject:
            raise ValueError("refusing a numpy array of Python objects")
        return np.frombuffer(raw, dtype=arr).reshape(shape).copy(), at
    raise ValueError(f"unknown tag {kind!r} at byte {at - 1}")
