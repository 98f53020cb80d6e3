"""Exports (``replica.state.export``): written and read with the ``safetensors`` package.

Every export is a standard safetensors file: ``safetensors.safe_open`` reads each tensor
and the metadata, equal to what ``load_export`` returns (``support.state.assert_safe_open_reads``,
which the other tests that write exports call too). Round trips are bit-exact for every dtype a
safetensors file holds, views of other tensors' storage, 0-dim and empty tensors. A file
that is not a readable safetensors file, or not a replica export, is refused with
ReplicaError (never the package's own SafetensorError); a changed byte with
SnapshotCorruptedError. Files of the hand-written writer before (the tensors in layout
order) still load."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import pytest
import torch

import replica
from replica.errors import ReplicaError, SnapshotCorruptedError
from replica.state.export import (
    DCP_SHARDING_INFO,
    EXTRAS_KEY,
    export_path,
    load_export,
    resumable,
    step_folder,
    write_export,
)
from replica.state.layout import StateLayout, dtype_of, state_tensors
from replica.state.serialize import encode
from replica.state.snapshot import Snapshot, collect_extras
from support.state import assert_safe_open_reads, bits

safetensors = pytest.importorskip("safetensors")
from safetensors import SafetensorError, safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def write_old_format(snapshot: Snapshot, path: Path) -> Path:
    """The hand-written writer replica used before the safetensors package (kept verbatim
    but for the atomic rename): the tensors in layout order, then the extras."""
    codes = {
        "float64": "F64",
        "float32": "F32",
        "float16": "F16",
        "bfloat16": "BF16",
        "float8_e4m3fn": "F8_E4M3",
        "float8_e5m2": "F8_E5M2",
        "int64": "I64",
        "int32": "I32",
        "int16": "I16",
        "int8": "I8",
        "uint64": "U64",
        "uint32": "U32",
        "uint16": "U16",
        "uint8": "U8",
        "bool": "BOOL",
    }
    layout, buffer, extras = snapshot.layout, snapshot.buffer.cpu(), snapshot.extras()
    header: dict = {
        "__metadata__": {"format": "pt", "replica.state.layout": layout.to_json(), "replica.step": str(snapshot.step)}
    }
    if snapshot.digests is not None:
        header["__metadata__"]["replica.digests"] = json.dumps(snapshot.digests)
        header["__metadata__"]["replica.digests_keyed"] = "offset"
    pieces, end = [], 0
    for e in layout.entries:
        header[e.name] = {"dtype": codes[e.dtype], "shape": list(e.shape), "data_offsets": [end, end + e.nbytes]}
        pieces.append(buffer[e.offset : e.offset + e.nbytes])
        end += e.nbytes
    header[EXTRAS_KEY] = {"dtype": "U8", "shape": [len(extras)], "data_offsets": [end, end + len(extras)]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for piece in pieces:
            f.write(piece.numpy().data)
        f.write(extras)
    return path


def _special(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values whose bits a lossy path would change: NaN payloads, -0.0, infinities,
    denormals for floats; extremes for integers."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.Size(shape).numel())
    if dtype == torch.bool:
        return (torch.randint(0, 2, (n,), generator=g) == 1).reshape(shape)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)  # any bit pattern
    t = raw.view(dtype)
    if dtype.is_floating_point and n >= 4 and size >= 2:
        t[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")]).to(dtype)
    if dtype == torch.int64 and n >= 2:
        t[:2] = torch.tensor([-(1 << 63), (1 << 63) - 1])
    return t.reshape(shape)


ALL_DTYPES = [
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
]


def state(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Named state tensors of every kind an export must keep bit for bit."""
    base = _special(torch.bfloat16, (12, 10), seed)
    wide = _special(torch.int64, (6, 8), seed + 1)
    tensors = [
        ("model.bf16", _special(torch.bfloat16, (5, 7), seed + 2)),
        # Views into another tensor's storage (Snapshot.capture takes contiguous tensors only:
        # a non-contiguous one is made contiguous first, as a trainer's would be).
        ("model.bf16_rows", base[3:7]),
        ("model.bf16_transposed", base.t().contiguous()),
        ("model.int64_row", wide[2]),
        ("model.int64_column", wide[:, 3].contiguous()),
        ("model.int64_scalar", torch.tensor(-(1 << 62) - 7)),  # 0-dim
        ("model.fp32_scalar", torch.tensor(float("-0.0"))),  # 0-dim, sign bit only
        ("model.empty", torch.empty(0, 4, dtype=torch.float32)),
        ("optim.step", torch.tensor(123456789012, dtype=torch.int64)),
    ]
    tensors += [(f"dtype.{name}", _special(dtype_of(name), (3, 5), seed + 10 + i)) for i, name in enumerate(ALL_DTYPES)]
    return tensors


def snapshot_of(
    tensors,
    extras: bytes = b"extras \x00\xff",
    *,
    step: int = 9,
    digests: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> Snapshot:
    layout = StateLayout.build(tensors, world_size=world_size, rank=rank, extras_capacity=1 << 10, bucket_bytes=1 << 10)
    snapshot = Snapshot(layout)
    snapshot.capture([t for _, t in tensors], extras, step=step, digests=digests)
    return snapshot


def assert_same(loaded: Snapshot, tensors, extras: bytes) -> None:
    for e, (name, t) in zip(loaded.layout.entries, tensors, strict=True):
        got = loaded.buffer[e.offset : e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)
        assert e.name == name and got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(bits(got), bits(t)), name
    assert loaded.extras() == extras


@pytest.mark.parametrize("digests", [True, False], ids=["with-digests", "without"])
def test_round_trip_is_bit_exact_and_safe_open_reads_it(tmp_path, digests):
    tensors = state()
    snapshot = snapshot_of(tensors, digests=digests)
    path = write_export(snapshot, tmp_path / "rank0.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.safetensors"]  # no temporary file left
    loaded = load_export(path)
    assert loaded.step == 9 and loaded.layout == snapshot.layout
    assert torch.equal(loaded.buffer, snapshot.buffer)
    assert loaded.digests == (snapshot.digests if digests else None)
    assert_same(loaded, tensors, b"extras \x00\xff")
    assert_safe_open_reads(path, loaded)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
        assert ("replica.digests" in f.metadata()) == digests
    plain = load_file(str(path))  # any reader: the state under its layout names
    assert torch.equal(bits(plain["model.bf16_transposed"]), bits(dict(tensors)["model.bf16_transposed"]))
    assert plain["model.int64_scalar"].shape == () and plain["model.int64_scalar"].item() == -(1 << 62) - 7


def test_empty_extras_and_a_state_of_empty_tensors(tmp_path):
    tensors = [("model.none", torch.empty(0, dtype=torch.bfloat16)), ("model.zero_rows", torch.empty(0, 3))]
    snapshot = snapshot_of(tensors, b"", step=0)
    loaded = load_export(write_export(snapshot, tmp_path / "x" / "rank0.safetensors"))  # makes the folder
    assert loaded.step == 0 and torch.equal(loaded.buffer, snapshot.buffer)
    assert_same(loaded, tensors, b"")
    assert_safe_open_reads(tmp_path / "x" / "rank0.safetensors", loaded)


def test_a_file_of_the_hand_written_writer_still_loads(tmp_path):
    tensors = state(seed=3)
    snapshot = snapshot_of(tensors)
    old = write_old_format(snapshot, tmp_path / "old.safetensors")
    loaded = load_export(old)
    assert loaded.step == 9 and loaded.digests == snapshot.digests and torch.equal(loaded.buffer, snapshot.buffer)
    assert_same(loaded, tensors, b"extras \x00\xff")
    assert_safe_open_reads(old, loaded)
    # Both are safetensors files of the same tensors and metadata; only the order of the
    # tensors in the body differs (safetensors sorts them by dtype, then name).
    new = write_export(snapshot, tmp_path / "new.safetensors")
    assert new.stat().st_mode == old.stat().st_mode  # readable by whoever read the old exports
    with safe_open(str(old), framework="pt") as a, safe_open(str(new), framework="pt") as b:
        # (the new one also says where its shards lie, for torch.distributed.checkpoint)
        assert a.metadata() == {k: v for k, v in b.metadata().items() if k != DCP_SHARDING_INFO}
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(bits(a.get_tensor(k)), bits(b.get_tensor(k))) for k in a.keys())  # noqa: SIM118 - safe_open handles
    # ... and the old file's corruption is found as before.
    data = bytearray(old.read_bytes())
    data[-50] ^= 0x01
    old.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorruptedError, match="step 9"):
        load_export(old)


def _damaged(tmp_path: Path, change) -> Path:
    path = write_export(snapshot_of(state()), tmp_path / "rank00000.safetensors")
    path.write_bytes(change(path.read_bytes()))
    return path


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d[:-7],  # truncated body
        lambda d: d[: len(d) // 3],  # truncated in the header
        lambda d: d[:5],  # not even a header length
        lambda d: b"",
        lambda d: d + b"\x00" * 8,  # grown
        lambda d: struct.pack("<Q", 1 << 40) + d[8:],  # a header length past the file
        lambda d: d[:8] + b"[" + d[9:],  # a header that is not JSON
    ],
    ids=["body", "header", "length", "empty", "grown", "length-too-big", "not-json"],
)
def test_an_unreadable_file_is_a_replica_error(tmp_path, change):
    path = _damaged(tmp_path, change)
    with pytest.raises(ReplicaError, match="not a readable safetensors file") as caught:
        load_export(path)
    assert not isinstance(caught.value, SafetensorError) and isinstance(caught.value.__cause__, SafetensorError)
    with pytest.raises(ReplicaError, match="not a readable safetensors file"):
        resumable(tmp_path, 1)  # what `replica launch --resume` turns into a parser error


def test_a_changed_byte_is_snapshot_corruption(tmp_path):
    path = _damaged(tmp_path, lambda d: d[: len(d) - 100] + bytes([d[len(d) - 100] ^ 0x20]) + d[len(d) - 99 :])
    with pytest.raises(SnapshotCorruptedError, match="step 9") as caught:
        load_export(path)
    assert caught.value.rank == 0 and caught.value.step == 9 and caught.value.buckets


def test_a_safetensors_file_that_is_no_replica_export(tmp_path):
    path = tmp_path / "rank00000.safetensors"
    save_file({"w": torch.zeros(3)}, str(path))
    with pytest.raises(ReplicaError, match="not a replica export .no layout in its metadata"):
        load_export(path)
    with pytest.raises(ReplicaError, match="not a replica export .no step in its metadata"):
        resumable(tmp_path, 1)
    # The metadata of an export over tensors that are not its layout's.
    snapshot = snapshot_of(state())
    with safe_open(str(write_export(snapshot, path)), framework="pt") as f:
        meta = f.metadata()
    save_file({"w": torch.zeros(3)}, str(path), metadata=meta)
    with pytest.raises(ReplicaError, match="names tensors it does not hold"):
        load_export(path)
    names = [*(e.name for e in snapshot.layout.entries), EXTRAS_KEY]
    other = {name: torch.zeros(1, dtype=torch.uint8) for name in names}
    save_file(other, str(path), metadata=meta)
    with pytest.raises(ReplicaError, match="its layout says"):
        load_export(path)


def test_a_dtype_safetensors_has_no_code_for_is_refused_before_writing(tmp_path):
    snapshot = snapshot_of([("model.c", torch.zeros(2, dtype=torch.complex128))])
    with pytest.raises(ReplicaError, match="safetensors has no dtype for complex128"):
        write_export(snapshot, tmp_path / "rank0.safetensors")
    assert not list(tmp_path.iterdir())
    with pytest.raises(ReplicaError, match="holds no state"):
        write_export(Snapshot(snapshot.layout), tmp_path / "rank0.safetensors")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    snapshot = snapshot_of(state())
    path = write_export(snapshot, tmp_path / "rank0.safetensors")
    before = path.read_bytes()

    def fail(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", fail)
    with pytest.raises(ReplicaError, match="could not write .*No space left"):
        write_export(snapshot_of(state(seed=1), step=10), path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["rank0.safetensors"]
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.{threading.get_ident()}.tmp")
    assert not tmp.exists()


def test_resumable_finds_the_newest_complete_step(tmp_path):
    for step, ranks in ((3, (0, 1)), (5, (0, 1)), (7, (1,))):  # step 7: rank 0's file missing
        for rank in ranks:
            snapshot = snapshot_of(state(seed=rank), step=step, rank=rank, world_size=2)
            path = write_export(snapshot, export_path(step_folder(tmp_path, step), rank))
            assert_safe_open_reads(path, load_export(path))
    assert resumable(tmp_path, 2) == (5, step_folder(tmp_path, 5))
    write_export(snapshot_of(state(), step=6, rank=0, world_size=2), export_path(step_folder(tmp_path, 7), 0))
    with pytest.raises(ReplicaError, match=r"different steps \[6, 7\]"):
        resumable(tmp_path, 2)


def test_an_export_restores_a_model_and_optimizer(tmp_path):
    """The whole path with a bf16 model, its int64 buffer and AdamW's state (0-dim steps):
    capture as the replicator does, export, read with safe_open, restore into fresh objects."""

    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
        model.register_buffer("count", torch.tensor(seed, dtype=torch.int64))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = make(0)
    layout = StateLayout.of(model, optimizer, world_size=1, rank=0, extras_capacity=1 << 12, bucket_bytes=1 << 10)
    snapshot = Snapshot(layout)
    snapshot.capture(
        [t for _, t in state_tensors(model, optimizer)], encode(collect_extras(optimizer, {})), step=4, digests=True
    )
    path = write_export(snapshot, tmp_path / "rank00000.safetensors")
    loaded = load_export(path)
    assert_safe_open_reads(path, loaded)
    fresh, fresh_optimizer = make(1)
    replica.restore_snapshot(loaded, fresh, fresh_optimizer, {}, rank=0, world_size=1)
    for (name, want), (_, got) in zip(
        state_tensors(model, optimizer), state_tensors(fresh, fresh_optimizer), strict=True
    ):
        assert torch.equal(bits(got), bits(want)), name
