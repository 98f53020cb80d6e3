"""Host memory that another process of this node can map: memfd regions.

A region is an anonymous memory file (``memfd_create``) sealed at its size, so a
peer that maps it can never be cut short (no SIGBUS when the owner shrinks it,
nor when the owner dies: the peer's mapping keeps the pages). ``shared_empty``
allocates one as a tensor; ``region_of`` says whether a tensor's bytes live in
one, and returns the record a peer needs to map it: the owner's pid, the file's
descriptor number there, its inode and size. The peer opens
``/proc/<pid>/fd/<fd>`` (the same user and PID namespace), checks the inode and
the seals, and maps it copy-on-write: it reads the owner's pages and can never
write them.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from replica.errors import MemoryPinningError, TransportError

__all__ = ["RECORD_BYTES", "Region", "RegionRecord", "map_region", "parse_record", "pin", "region_of", "shared_empty"]

_RECORD = struct.Struct("<QQQQ")  # pid, fd, inode, bytes
RECORD_BYTES = _RECORD.size
_NAME = "replica-shm"  # every region's memfd name: /proc/<pid>/fd/<fd> reads "/memfd:replica-shm (deleted)"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class _Mapping(mmap.mmap):
    """An mmap that can be weakly referenced: its region closes its file once the
    last tensor over it is gone."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Region:
    """Where a tensor's bytes live: ``offset`` bytes into the region ``record`` names."""

    record: bytes
    offset: int
    nbytes: int


_lock = threading.Lock()
# data_ptr of a region's first byte -> (record, size); an entry leaves when its mapping is freed.
_regions: dict[int, tuple[bytes, int]] = {}


def _forget(address: int, fd: int) -> None:
    with _lock:
        _regions.pop(address, None)
    os.close(fd)


def pin(t: torch.Tensor) -> None:
    """Page-lock ``t``'s whole mapping for CUDA (``cudaHostRegister``), so copies between
    it and a GPU run asynchronously on the copy engines (``is_pinned()`` is then True);
    unregistered when the mapping goes. ``t`` is a tensor over a whole region, as
    ``shared_empty`` or ``map_region`` return it. MemoryPinningError when CUDA refuses
    (no GPU, out of lockable memory)."""
    mapping = _mapping_of(t)
    if not torch.cuda.is_available():
        raise MemoryPinningError("cannot pin shared memory: CUDA is not available")
    cudart = torch.cuda.cudart()
    if cudart is None:  # torch without its CUDA runtime bindings
        raise MemoryPinningError("cannot pin shared memory: this torch has no CUDA runtime bindings")
    address, size = t.untyped_storage().data_ptr(), len(mapping)
    status = cudart.cudaHostRegister(address, size, 0)
    if int(status) != 0:
        raise MemoryPinningError(f"cudaHostRegister of {size} bytes of shared memory failed: CUDA error {int(status)}")
    weakref.finalize(mapping, _unpin, cudart, address)


def _unpin(cudart, address: int) -> None:
    with contextlib.suppress(Exception):
        cudart.cudaHostUnregister(address)


def _mapping_of(t: torch.Tensor) -> _Mapping:
    base = t.untyped_storage()
    # torch.frombuffer keeps the buffer (the mapping) alive through the storage's context.
    mapping = getattr(t, "_replica_mapping", None)
    if mapping is None or not isinstance(mapping, _Mapping):
        raise ValueError("pin() takes a tensor over a whole region, as shared_empty or map_region return it")
    if base.nbytes() > len(mapping):
        raise ValueError("the tensor is larger than its mapping")
    return mapping


def _over(mapping: _Mapping) -> torch.Tensor:
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view lives
    # For pin(); views of it share the storage, not the attribute. setattr: an attribute of
    # this tensor alone, which torch.Tensor does not declare (_mapping_of reads it with getattr).
    setattr(tensor, "_replica_mapping", mapping)  # noqa: B010
    return tensor


def shared_empty(nbytes: int, *, pinned: bool = False) -> torch.Tensor:
    """A zeroed uint8 tensor of ``nbytes`` in a memfd region of its own, which peers
    of this node can map (``region_of``). Its file closes when its storage is freed.
    ``pinned``: page-locked for CUDA too (``pin``), where CUDA is present."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    fd = os.memfd_create(_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        size = max(nbytes, 1)  # mmap cannot map 0 bytes
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mapping = _Mapping(fd, size)
    except BaseException:
        os.close(fd)
        raise
    tensor = _over(mapping)
    address = tensor.data_ptr()
    record = _RECORD.pack(os.getpid(), fd, os.fstat(fd).st_ino, size)
    with _lock:
        _regions[address] = (record, size)
    weakref.finalize(mapping, _forget, address, fd)
    if pinned and torch.cuda.is_available():
        pin(tensor)
    return tensor[:nbytes]


def region_of(t: torch.Tensor) -> Region | None:
    """The region holding ``t``'s bytes (a contiguous CPU tensor), or None when they
    are not in one made by ``shared_empty`` in this process."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    storage = t.untyped_storage()
    with _lock:
        found = _regions.get(storage.data_ptr())
    if found is None:
        return None
    record, size = found
    offset = t.data_ptr() - storage.data_ptr()
    nbytes = t.numel() * t.element_size()
    if offset < 0 or offset + nbytes > size:
        return None
    return Region(record=record, offset=offset, nbytes=nbytes)


class RegionRecord(NamedTuple):
    """What a region's record says: the process that made it, its descriptor there, its
    inode and its size in bytes."""

    pid: int
    fd: int
    inode: int
    size: int


def parse_record(record: bytes) -> RegionRecord:
    """A region's record, read; TransportError if it is not one."""
    try:
        return RegionRecord(*_RECORD.unpack(record))
    except struct.error as exc:
        raise TransportError(f"bad shared-memory record: {exc}") from exc


def map_region(record: bytes, *, writable: bool = False) -> torch.Tensor:
    """A peer's region as a read-only-in-effect uint8 tensor (copy-on-write: this
    process sees the owner's bytes and never writes them), or with ``writable`` as
    shared memory this process writes into (a region the peer gave as a receive's
    destination). TransportError, saying why, when it cannot be mapped from here.
    Only a sealed memfd that ``shared_empty`` made is mapped, never another file the
    record might name."""
    pid, fd, inode, size = parse_record(record)
    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path)
    except OSError:
        target = None  # os.open below says why
    if target is not None and not target.startswith(f"/memfd:{_NAME} "):
        raise TransportError(f"{path} is not a replica shared-memory region; refusing to map it")
    try:
        opened = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError as exc:
        raise TransportError(
            f"cannot open the peer's shared memory at {path} ({exc.strerror}): the peer must run as the same "
            "user in the same PID namespace (same container); use the UCX transport"
        ) from exc
    try:
        st = os.fstat(opened)
        if st.st_ino != inode or st.st_size != size:
            raise TransportError(
                f"{path} is not the peer's shared memory (inode {st.st_ino}, {st.st_size} bytes; "
                f"expected inode {inode}, {size} bytes): is the peer in another PID namespace? "
                "use the UCX transport"
            )
        try:
            seals = fcntl.fcntl(opened, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
            raise TransportError(f"the peer's shared memory {path} is not sealed at its size; refusing to map it")
        mapping = _Mapping(opened, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
    finally:
        os.close(opened)  # the mapping keeps the file
    return _over(mapping)
