"""A committed snapshot as a safetensors file: the rank's local shards and
optimizer state under their layout names, the encoded extras as the uint8
tensor ``replica.extras``, and the layout JSON and step in the metadata.
Readable by any safetensors reader; ``load_export`` turns it back into a
``Snapshot`` that restores like a mirror does."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import torch

from replica.errors import ReplicaError, SnapshotCorruptedError
from replica.state.layout import StateLayout, dtype_of
from replica.state.snapshot import Snapshot
from replica.transport.base import bucket_digest

__all__ = ["EXTRAS_KEY", "export_path", "load_export", "resumable", "step_folder", "write_export"]

EXTRAS_KEY = "replica.extras"
_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}
_LENGTH = struct.Struct("<Q")
# Digests whose words are keyed from each bucket's offset in the snapshot (protocol 2).
_KEYED_BY_OFFSET = "offset"


def export_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank:05d}.safetensors"


def step_folder(directory: str | Path, step: int) -> Path:
    """Where a job's export of ``step`` goes inside its export folder (one file per rank)."""
    return Path(directory) / f"step{step:08d}"


def resumable(directory: str | Path, world_size: int) -> tuple[int, Path]:
    """The newest step of which ``directory`` holds every rank's file, and the folder that
    holds them: ``directory`` itself (one export) or its newest complete ``step_folder``
    (a job's export folder, where standbys may have written more than one version).
    ReplicaError says what is there when no step is complete."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ReplicaError(f"{directory} is not a folder")
    candidates = [directory, *sorted(directory.glob("step*"), reverse=True)]
    seen = {}
    for folder in candidates:
        files = [export_path(folder, r) for r in range(world_size)]
        present = [f for f in files if f.exists()]
        if present:
            seen[folder.name or str(folder)] = len(present)
        if len(present) == world_size:
            steps = {_step_of(f) for f in files}
            if len(steps) != 1:
                raise ReplicaError(f"{folder}: the ranks' files hold different steps {sorted(steps)}")
            return steps.pop(), folder
    raise ReplicaError(f"{directory} holds no complete export of {world_size} ranks (files found per folder: "
                       f"{seen or 'none'})")


def _step_of(path: Path) -> int:
    with open(path, "rb") as f:
        (n,) = _LENGTH.unpack(f.read(_LENGTH.size))
        header = json.loads(f.read(n))
    meta = header.get("__metadata__", {})
    if "replica.step" not in meta:
        raise ReplicaError(f"{path} is not a replica export (no step in its metadata)")
    return int(meta["replica.step"])


def write_export(snapshot: Snapshot, path: str | Path) -> Path:
    if snapshot.step is None:
        raise ReplicaError("export of a snapshot that holds no state")
    layout = snapshot.layout
    buffer = snapshot.buffer.cpu()
    extras = snapshot.extras()
    header: dict[str, object] = {
        "__metadata__": {"format": "pt", "replica.state.layout": layout.to_json(), "replica.step": str(snapshot.step)},
    }
    if snapshot.digests is not None:  # the bucket digests it was received with: load_export checks them
        header["__metadata__"]["replica.digests"] = json.dumps(snapshot.digests)
        header["__metadata__"]["replica.digests_keyed"] = _KEYED_BY_OFFSET
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
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.{threading.get_ident()}.tmp")  # two writers of one file
    with open(tmp, "wb") as f:
        f.write(_LENGTH.pack(len(text)))
        f.write(text)
        for piece in pieces:
            f.write(piece.numpy().data)
        f.write(extras)
    tmp.replace(path)  # never a half-written file under the final name
    return path


def load_export(path: str | Path) -> Snapshot:
    """The snapshot stored in an exported file (restore it with ``replica.restore_snapshot``),
    checked against the digests written with it (SnapshotCorruptedError if it changed)."""
    data = Path(path).read_bytes()
    (n,) = _LENGTH.unpack_from(data)
    header = json.loads(data[_LENGTH.size:_LENGTH.size + n])
    meta = header.pop("__metadata__", {})
    if "replica.state.layout" not in meta:
        raise ReplicaError(f"{path} is not a replica export (no layout in its metadata)")
    layout = StateLayout.from_json(meta["replica.state.layout"])
    body = memoryview(data)[_LENGTH.size + n:]

    def view(name: str, dtype: torch.dtype, shape) -> torch.Tensor:
        lo, hi = header[name]["data_offsets"]
        raw = torch.frombuffer(bytearray(body[lo:hi]), dtype=torch.uint8) if hi > lo else torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)

    tensors = [view(e.name, dtype_of(e.dtype), e.shape) for e in layout.entries]
    extras = view(EXTRAS_KEY, torch.uint8, (-1,)).numpy().tobytes()
    snapshot = Snapshot(layout)
    snapshot.capture(tensors, extras, step=int(meta["replica.step"]))
    if "replica.digests" in meta:  # a file that changed since it was written is never restored
        written = [int(d) for d in json.loads(meta["replica.digests"])]
        if meta.get("replica.digests_keyed") == _KEYED_BY_OFFSET:
            snapshot.digests = written
            snapshot.verify()
        else:  # written before protocol 2: each bucket's words were keyed from the bucket's start
            snapshot.digests = [bucket_digest(snapshot.buffer[lo:hi]) for lo, hi in layout.buckets()]
            bad = [i for i, (now, then) in enumerate(zip(snapshot.digests, written, strict=True)) if now != then]
            if bad:
                raise SnapshotCorruptedError(
                    f"{path}: bucket(s) {bad} changed since the file was written; it is not used",
                    rank=layout.rank, step=snapshot.step, buckets=tuple(bad))
            snapshot.digests = snapshot.compute_digests()
    return snapshot
