"""A committed snapshot as a safetensors file: the rank's local shards and
optimizer state under their layout names, the encoded extras as the uint8
tensor ``replica.extras``, and the layout JSON and step in the metadata.
Written and read with the ``safetensors`` package, so any safetensors reader
reads it; ``load_export`` turns it back into a ``Snapshot`` that restores like
a mirror does. The ranks' files of one step together are a checkpoint that
``torch.distributed.checkpoint.load`` reads through its ``HuggingFaceStorageReader``,
at the job's world size or another: the tensors are named as DCP names a model's
and optimizer's state dicts (``model.{fqn}``, ``optim.state.{fqn}.{key}``) and each
file's metadata says where its shards lie in the whole tensors (``DCP_SHARDING_INFO``).
Files of the hand-written writer before (the same tensors and metadata, the tensors
in layout order) are standard safetensors files too, and load the same."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch

from replica.errors import ReplicaError, SnapshotCorruptedError
from replica.state.layout import StateLayout, dtype_of
from replica.state.snapshot import Snapshot
from replica.transport.base import bucket_digest

__all__ = [
    "DCP_SHARDING_INFO",
    "EXTRAS_KEY",
    "export_path",
    "load_export",
    "load_extras",
    "resumable",
    "step_folder",
    "write_export",
]

EXTRAS_KEY = "replica.extras"
# The metadata key of a safetensors file's place in a sharded checkpoint (torch.distributed.checkpoint).
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
# The dtypes a safetensors file has a code for (F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64 ... U8, BOOL).
_DTYPES = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint64",
        "uint32",
        "uint16",
        "uint8",
        "bool",
    }
)
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
    raise ReplicaError(
        f"{directory} holds no complete export of {world_size} ranks (files found per folder: {seen or 'none'})"
    )


def _open(path: str | Path):
    """``safetensors.safe_open`` on ``path``; ReplicaError (not the package's own error) for a
    file it cannot read as safetensors: truncated, grown, or a header that does not parse.
    A file that is not there stays a FileNotFoundError."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise ReplicaError(f"{path} is not a readable safetensors file ({exc}); it is not used") from exc


def _step_of(path: Path) -> int:
    with _open(path) as f:
        meta = f.metadata() or {}
    if "replica.step" not in meta:
        raise ReplicaError(f"{path} is not a replica export (no step in its metadata)")
    return int(meta["replica.step"])


def _sharding_info(layout: StateLayout) -> dict[str, dict[str, list[int]]]:
    """Where each tensor of the file lies in its whole tensor, as ``torch.distributed.checkpoint``'s
    ``HuggingFaceStorageReader`` reads it: every key of the file named (the extras at 0)."""
    info = {e.name: {"saved_offsets": list(e.global_offset or (0,) * len(e.shape))} for e in layout.entries}
    info[EXTRAS_KEY] = {"saved_offsets": [0]}
    return info


def write_export(snapshot: Snapshot, path: str | Path) -> Path:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if snapshot.step is None:
        raise ReplicaError("export of a snapshot that holds no state")
    layout = snapshot.layout
    buffer = snapshot.buffer.cpu()
    extras = snapshot.extras()
    metadata = {
        "format": "pt",
        "replica.state.layout": layout.to_json(),
        "replica.step": str(snapshot.step),
        DCP_SHARDING_INFO: json.dumps(_sharding_info(layout)),
    }
    if snapshot.digests is not None:  # the bucket digests it was received with: load_export checks them
        metadata["replica.digests"] = json.dumps(snapshot.digests)
        metadata["replica.digests_keyed"] = _KEYED_BY_OFFSET
    # Views of the buffer, no copies: safetensors writes each from where it lies.
    tensors = {}
    for e in layout.entries:
        if e.dtype not in _DTYPES:
            raise ReplicaError(f"{e.name}: safetensors has no dtype for {e.dtype}")
        tensors[e.name] = buffer[e.offset : e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)
    tensors[EXTRAS_KEY] = (
        torch.frombuffer(bytearray(extras), dtype=torch.uint8) if extras else torch.empty(0, dtype=torch.uint8)
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.{threading.get_ident()}.tmp")  # two writers of one file
    try:
        # The mode a file created here gets (0o666 less the umask), as exports always had:
        # safetensors writes a private temporary file (0600) and renames it over ``tmp``.
        with open(tmp, "wb") as f:
            mode = os.fstat(f.fileno()).st_mode & 0o777
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, mode)
    except SafetensorError as exc:
        tmp.unlink(missing_ok=True)
        raise ReplicaError(f"could not write {path}: {exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)  # never a half-written file under the final name
    return path


def load_extras(path: str | Path) -> dict:
    """What an exported file holds beside its tensors, decoded (``replica.state.serialize``, no
    pickle): ``extra`` (each ``extra`` object's ``state_dict()`` by its name: RNG states, data
    positions, LR schedulers), ``param_groups`` (the optimizer's hyperparameters) and
    ``optim_scalars`` (its per-parameter state that is not a tensor). Not checked against the
    file's digests: ``load_export`` checks them."""
    from replica.state.serialize import decode

    with _open(path) as f:
        if EXTRAS_KEY not in set(f.keys()):
            raise ReplicaError(f"{path} is not a replica export (no {EXTRAS_KEY})")
        data = f.get_tensor(EXTRAS_KEY).numpy().tobytes()
    return decode(data)


def load_export(path: str | Path) -> Snapshot:
    """The snapshot stored in an exported file (restore it with ``replica.restore_snapshot``),
    checked against the digests written with it (SnapshotCorruptedError if it changed).
    ReplicaError for a file that is not a readable safetensors file or not a replica export."""
    with _open(path) as f:
        meta = f.metadata() or {}
        if "replica.state.layout" not in meta:
            raise ReplicaError(f"{path} is not a replica export (no layout in its metadata)")
        if "replica.step" not in meta:
            raise ReplicaError(f"{path} is not a replica export (no step in its metadata)")
        layout = StateLayout.from_json(meta["replica.state.layout"])
        names = set(f.keys())
        missing = [n for n in (*(e.name for e in layout.entries), EXTRAS_KEY) if n not in names]
        if missing:
            raise ReplicaError(
                f"{path} is not a replica export: its layout names tensors it does not hold ({missing[:5]})"
            )
        tensors = []
        for e in layout.entries:
            t = f.get_tensor(e.name)
            if t.dtype != dtype_of(e.dtype) or tuple(t.shape) != tuple(e.shape):
                raise ReplicaError(
                    f"{path}: tensor {e.name} is {t.dtype} {tuple(t.shape)}, its layout says {e.dtype} {tuple(e.shape)}"
                )
            tensors.append(t)
        extras = f.get_tensor(EXTRAS_KEY)
        if extras.dtype != torch.uint8 or extras.dim() != 1:
            raise ReplicaError(f"{path}: {EXTRAS_KEY} is {extras.dtype} {tuple(extras.shape)}, not a uint8 vector")
    snapshot = Snapshot(layout)
    snapshot.capture(tensors, extras.numpy().tobytes(), step=int(meta["replica.step"]))
    del tensors, extras
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
                    rank=layout.rank,
                    step=snapshot.step,
                    buckets=tuple(bad),
                )
            snapshot.digests = snapshot.compute_digests()
    return snapshot
