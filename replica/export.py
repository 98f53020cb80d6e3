"""A committed snapshot as a safetensors file: the rank's local shards and
optimizer state under their layout names, the encoded extras as the uint8
tensor ``replica.extras``, and the layout JSON and step in the metadata.
Readable by any safetensors reader; ``load_export`` turns it back into a
``Snapshot`` that restores like a mirror does."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from replica.errors import ReplicaError
from replica.layout import StateLayout, dtype_of
from replica.snapshot import Snapshot

__all__ = ["EXTRAS_KEY", "export_path", "load_export", "write_export"]

EXTRAS_KEY = "replica.extras"
_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}
_LENGTH = struct.Struct("<Q")


def export_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank:05d}.safetensors"


def write_export(snapshot: Snapshot, path: str | Path) -> Path:
    if snapshot.step is None:
        raise ReplicaError("export of a snapshot that holds no state")
    layout = snapshot.layout
    buffer = snapshot.buffer.cpu()
    extras = snapshot.extras()
    header: dict[str, object] = {
        "__metadata__": {"format": "pt", "replica.layout": layout.to_json(), "replica.step": str(snapshot.step)},
    }
    pieces = []
    end = 0
    for e in layout.entries:
        if e.dtype not in _DTYPES:
            raise ReplicaError(f"{e.name}: safetensors has no dtype for {e.dtype}")
        header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [end, end + e.nbytes]}
        pieces.append(buffer[e.offset:e.offset + e.nbytes])
        end += e.nbytes
    header[EXTRAS_KEY] = {"dtype": "U8", "shape": [len(extras)], "data_offsets": [end, end + len(extras)]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_LENGTH.pack(len(text)))
        f.write(text)
        for piece in pieces:
            f.write(piece.numpy().data)
        f.write(extras)
    tmp.replace(path)  # never a half-written file under the final name
    return path


def load_export(path: str | Path) -> Snapshot:
    """The snapshot stored in an exported file (restore it with ``replica.restore_snapshot``)."""
    data = Path(path).read_bytes()
    (n,) = _LENGTH.unpack_from(data)
    header = json.loads(data[_LENGTH.size:_LENGTH.size + n])
    meta = header.pop("__metadata__", {})
    if "replica.layout" not in meta:
        raise ReplicaError(f"{path} is not a replica export (no layout in its metadata)")
    layout = StateLayout.from_json(meta["replica.layout"])
    body = memoryview(data)[_LENGTH.size + n:]

    def view(name: str, dtype: torch.dtype, shape) -> torch.Tensor:
        lo, hi = header[name]["data_offsets"]
        raw = torch.frombuffer(bytearray(body[lo:hi]), dtype=torch.uint8) if hi > lo else torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)

    tensors = [view(e.name, dtype_of(e.dtype), e.shape) for e in layout.entries]
    extras = view(EXTRAS_KEY, torch.uint8, (-1,)).numpy().tobytes()
    snapshot = Snapshot(layout)
    snapshot.capture(tensors, extras, step=int(meta["replica.step"]))
    return snapshot
