"""The durable floor: every standby writes some of the versions it holds to a folder (local to
its host or shared), in the background, so that a rank that lost every in-memory copy of its
state (its trainer and its standby together) has somewhere to come back from.

A version is the global commit of step S: each standby writes its rank's part,
``DIR/step{S:08d}/rank{r:05d}.safetensors`` (``replica.state.export``'s file: the rank's shards,
optimizer state and extras, with the digests of its buckets), then counts it in the job store.
The standby whose part completes the version writes its manifest (``FloorVersion``: every
part's file, size, content digest and layout fingerprint), signed like every value of the store,
and a copy beside the files (``MANIFEST.json``, its HMAC under the job's token). Only a version
named by a manifest is ever used; a half-written one never is. Each standby keeps its parts of
the ``keep`` newest complete versions and deletes the older ones.

Which steps: every ``every_steps``-th (S a multiple of it: the same steps on every rank), and,
when ``interval`` passed since the last complete version, the step rank 0's standby plans two
commits ahead (``keys.floor_planned``), which every standby still holds when it commits. One
write at a time per standby: a version that comes while one is being written is skipped, never
queued. The copy is taken from the mirror's held version without holding the mirror (the
stream never waits for the disk) and checked against the version's digests: a copy overtaken
by the next receive is dropped (skipped). A write that fails (no space, an I/O error, a
read-only folder) is warned once per kind and counted; the job goes on, with the last complete
version as its floor."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from replica.errors import ReplicaError, SnapshotCorruptedError
from replica.jobstore import FloorPart, FloorVersion, JobStore, Number, keys
from replica.mirror.standby import Mirror
from replica.ops import combine_digests
from replica.state.export import export_path, load_export, step_folder, write_export
from replica.state.snapshot import Snapshot
from replica.timing import Deadline, pause

__all__ = [
    "Floor",
    "FloorConfig",
    "FloorStats",
    "MANIFEST",
    "check_version",
    "drop_half_written",
    "manifest_file",
    "verify_manifest_file",
    "write_part",
]

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
_IDLE = timedelta(seconds=1)  # the thread's wait for a kept version, at most (then it looks at its stop)
_COMMIT_POLL = timedelta(milliseconds=20)  # how often it reads the global commit, waiting for a version's
_COMMIT_WAIT = timedelta(seconds=60)  # and for how long at most
_CLOSE_SETTLE = timedelta(seconds=2)  # at close, the wait for the other ranks' parts of its last version
_STEP_FOLDER = re.compile(r"step(\d{8})")  # step_folder's name
_PLAN_AHEAD = 2  # commits: a planned step is still held by every standby when it is committed


@dataclass(kw_only=True, frozen=True, slots=True)
class FloorConfig:
    """Where and how often the standbys write durable versions (``replica launch --durable``)."""

    #: The folder (local to each standby's host, or shared); a version is a ``step{S:08d}`` folder in it.
    directory: Path
    #: A version every this many steps (S a multiple of it); 0: by ``interval`` only.
    every_steps: int = 50
    #: And one at least this often (planned by rank 0's standby); zero: by ``every_steps`` only.
    interval: timedelta = timedelta(minutes=10)
    #: The complete versions each standby keeps.
    keep: int = 2

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps must be >= 0, got {self.every_steps}")
        if self.interval < timedelta(0):
            raise ValueError(f"interval must be >= 0, got {self.interval}")
        if self.every_steps == 0 and self.interval == timedelta(0):
            raise ValueError("a floor needs a cadence: every_steps > 0 or an interval > 0")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")


@dataclass(kw_only=True, slots=True)
class FloorStats:
    written: list[int] = field(default_factory=list)  # steps whose part this standby wrote, still on disk
    parts: int = 0  # the parts this standby wrote, in all (pruned ones too)
    complete: list[int] = field(default_factory=list)  # of those, the versions it saw complete
    skipped: list[int] = field(default_factory=list)  # steps it did not write (busy, overtaken, not held)
    errors: int = 0
    seconds: float = 0.0  # writing, in all
    bytes: int = 0


def manifest_file(version: FloorVersion, token: bytes) -> bytes:
    """``MANIFEST.json``: the manifest as JSON, with the HMAC-SHA256 of its canonical form."""
    body = _canonical(version)
    signed = {"manifest": json.loads(body), "hmac_sha256": hmac.new(token, body, hashlib.sha256).hexdigest()}
    return json.dumps(signed, indent=1, sort_keys=True).encode() + b"\n"


def verify_manifest_file(data: bytes, token: bytes) -> dict:
    """The manifest of a ``MANIFEST.json``; ReplicaError when its signature does not match."""
    try:
        signed = json.loads(data)
        body = json.dumps(signed["manifest"], sort_keys=True, separators=(",", ":")).encode()
        mac = signed["hmac_sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ReplicaError(f"not a replica floor manifest ({exc})") from None
    if not hmac.compare_digest(hmac.new(token, body, hashlib.sha256).hexdigest(), str(mac)):
        raise ReplicaError("the floor manifest's signature does not match (another job's, or changed)")
    return signed["manifest"]


def check_version(version: FloorVersion) -> str | None:
    """What makes a complete version unusable, read back from its files (each part there, of
    the size its manifest says, its content checked against the digests it was written with
    and the manifest's); None when it is usable."""
    for rank, (file, nbytes, digest) in enumerate(zip(version.files, version.nbytes, version.digests, strict=True)):
        path = Path(version.directory) / file
        try:
            if (size := path.stat().st_size) != nbytes:
                return f"rank {rank}'s part {path} holds {size} bytes, its manifest says {nbytes}"
            part = load_export(path)
        except (OSError, ReplicaError) as exc:  # SnapshotCorruptedError: a bucket that changed
            return f"rank {rank}'s part {path}: {exc}"
        sizes = [hi - lo for lo, hi in part.layout.buckets()]
        if part.step != version.step or part.digests is None or combine_digests(part.digests, sizes) != digest:
            return f"rank {rank}'s part {path} is not the one its manifest names (another step's, or rewritten)"
    return None


def _canonical(version: FloorVersion) -> bytes:
    body = {
        "step": version.step,
        "directory": version.directory,
        "files": list(version.files),
        "nbytes": list(version.nbytes),
        "digests": list(version.digests),
        "fingerprints": list(version.fingerprints),
        "written_at": version.written_at,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class Floor:
    """The durable floor of one standby (its ``Mirror``): a thread that writes the due versions
    the mirror holds. ``close()`` stops it (a write in progress finishes first)."""

    def __init__(self, mirror: Mirror, config: FloorConfig, *, on_written: Callable[[int, Path], None] | None = None):
        """``on_written(step, path)``: called once this standby's part of ``step`` is written
        and synced, before it is counted (the roles' injected faults)."""
        self.mirror = mirror
        self.config = config
        self._on_written = on_written
        self.stats = FloorStats()
        self._store = mirror.store
        self._rank, self._world_size = mirror.rank, mirror.world_size
        self._staging: Snapshot | None = None  # the copy a part is written from (host memory, kept)
        self._warned: set[int] = set()  # the errnos warned about
        self._newest: int | None = None  # the newest version the mirror kept
        self._latest: tuple[int | None, float] = (None, time.monotonic())  # the newest complete version, seen when
        self._wake = threading.Event()
        self._stop = threading.Event()
        # This rank's parts already in the folder (a standby this one replaces wrote them): pruned as its own.
        self.stats.written = sorted(
            int(p.parent.name.removeprefix("step"))
            for p in config.directory.glob(f"step*/{export_path('', self._rank).name}")
            if p.parent.name.removeprefix("step").isdigit()
        )
        self._thread = threading.Thread(target=self._run, name=f"replica-floor-{self._rank}", daemon=True)
        self._thread.start()
        mirror.on_version(self._kept)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()
        try:  # versions another rank's part completes meanwhile (briefly): keep the newest, drop the rest
            deadline = Deadline.after(_CLOSE_SETTLE)
            while self._settle() and not deadline.expired:
                pause(_COMMIT_POLL, deadline=deadline)
        except Exception as exc:  # noqa: BLE001 - the job store may be gone at the end
            logger.info("[standby rank %d] the durable floor at close: %s", self._rank, exc)

    # --- the thread ---

    def _kept(self, step: int) -> None:  # the mirror's receiving thread: at once
        self._newest = step
        self._wake.set()

    def _run(self) -> None:
        handled: int | None = None
        while not self._stop.is_set():
            self._wake.wait(_IDLE.total_seconds())
            self._wake.clear()
            step = self._newest
            if self._stop.is_set() or step is None or step == handled:
                continue
            handled = step  # one write at a time: versions kept meanwhile are skipped, not queued
            try:
                if self._due(step):
                    self._write(step)
                self._settle()
            except Exception as exc:  # noqa: BLE001 - the floor never ends a standby; the next version tries again
                logger.warning("[standby rank %d] the durable floor: %s", self._rank, exc)

    def _due(self, step: int) -> bool:
        every = self.config.every_steps
        if every and step % every == 0:
            return True
        interval = self.config.interval.total_seconds()
        if not interval:
            return False
        planned = self._store.get(keys.floor_planned())
        if planned is not None and planned.value == step:
            return True
        latest = self._store.get(keys.floor_latest())
        seen, at = self._latest
        if latest is not None and latest.value != seen:
            self._latest = seen, at = latest.value, time.monotonic()
        if self._rank == 0 and time.monotonic() - at >= interval and (planned is None or planned.value < step):
            self._store.put(keys.floor_planned(), Number(value=step + _PLAN_AHEAD))
            self._latest = seen, time.monotonic()  # planned once an interval, not at every step
        return False

    def _write(self, step: int) -> None:
        copy = self._copy(step)  # now, while the mirror surely holds it
        if copy is None or not self._committed(step):
            self.stats.skipped.append(step)
            return
        folder = step_folder(self.config.directory, step)
        path = export_path(folder, self._rank)
        started = time.monotonic()
        try:
            write_part(copy, path)
            if self._on_written is not None:
                self._on_written(step, path)
        except (OSError, ReplicaError) as exc:
            self._failed(step, exc)
            return
        self.stats.seconds += time.monotonic() - started
        nbytes = path.stat().st_size
        self.stats.bytes += nbytes
        self.stats.parts += 1
        self.stats.written.append(step)
        assert copy.digests is not None  # _copy returns only a copy it checked against its digests
        digest = combine_digests(copy.digests, [hi - lo for lo, hi in copy.layout.buckets()])
        self._store.put(
            keys.floor_part(step, self._rank),
            FloorPart(
                rank=self._rank,
                step=step,
                file=str(path.relative_to(self.config.directory)),
                nbytes=nbytes,
                digest=digest,
                fingerprint=copy.layout.fingerprint,
            ),
        )
        if self._store.count(keys.floor_parts(step), 1) == self._world_size:
            self._complete(step)
        logger.info(
            "[standby rank %d] durable floor: wrote its part of step %d (%d bytes, %.2f s)",
            self._rank,
            step,
            nbytes,
            time.monotonic() - started,
        )

    def _committed(self, step: int) -> bool:
        """Wait until ``step`` is globally committed (a version is a global commit); False when it
        is not within ``_COMMIT_WAIT`` (a failover rolled back past it) or the floor closes."""
        deadline = Deadline.after(_COMMIT_WAIT)
        while not deadline.expired and not self._stop.is_set():
            last = self.mirror.record.last()
            if last is not None and last >= step:
                return True
            pause(_COMMIT_POLL, self._stop, deadline)
        return False

    def _copy(self, step: int) -> Snapshot | None:
        """A host copy of the mirror's version of ``step``, checked against its digests; None when
        the mirror no longer holds it or the next receive overwrote it during the copy."""
        try:
            version, digests = self.mirror.held(step)
        except ReplicaError:
            return None
        if digests is None:
            return None  # Config(verify=False): nothing to check a copy against
        if self._staging is None or self._staging.layout is not version.layout:
            self._staging = Snapshot(version.layout)
        self._staging.buffer.copy_(version.buffer)
        self._staging.step, self._staging.digests = step, digests
        try:
            self._staging.verify()
        except SnapshotCorruptedError:
            return None  # overtaken: the slot was reused while it was copied
        return self._staging

    def _complete(self, step: int) -> None:
        """This part completed version ``step``: its manifest, in the store and beside the files."""
        held = self._store.get_many([keys.floor_part(step, r) for r in range(self._world_size)])
        parts = [p for p in held if p is not None]
        if len(parts) < len(held):
            return
        version = FloorVersion(
            step=step,
            directory=str(self.config.directory),
            files=tuple(p.file for p in parts),
            nbytes=tuple(p.nbytes for p in parts),
            digests=tuple(p.digest for p in parts),
            fingerprints=tuple(p.fingerprint for p in parts),
            written_at=time.time(),
        )
        self._store.put(keys.floor_version(step), version)
        latest = self._store.get(keys.floor_latest())
        if latest is None or latest.value < step:
            self._store.put(keys.floor_latest(), Number(value=step))
        try:  # the copy beside the files: where the folder is shared, it names them all
            manifest = step_folder(self.config.directory, step) / MANIFEST
            tmp = manifest.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(manifest_file(version, self.mirror.config.token))
            tmp.replace(manifest)
        except OSError as exc:
            self._failed(step, exc)
        for dropped in drop_half_written(self.config.directory, step, self._store):
            logger.info(
                "[standby rank %d] durable floor: dropped the half-written version %d (%d is complete)",
                self._rank,
                dropped,
                step,
            )

    def _settle(self) -> bool:
        """The versions this standby wrote a part of that are complete now (their manifest is
        written, by whichever part came last); of them it keeps the newest ``keep``, and drops
        its parts of older ones, complete or not (a version a dead standby left half-written).
        True while a part newer than them waits."""
        waiting = [s for s in self.stats.written if s not in self.stats.complete]
        if not waiting:
            return False
        found = self._store.get_many([keys.floor_version(s) for s in waiting])
        self.stats.complete = sorted(
            {*self.stats.complete, *(s for s, v in zip(waiting, found, strict=False) if v is not None)}
        )
        if self.stats.complete:
            kept, newest = self.stats.complete[-self.config.keep :], self.stats.complete[-1]
            # Older than the kept ones, or never complete and older than the newest complete
            # version: every standby writes its versions in order, so none will complete it now.
            for old in [s for s in self.stats.written if s < kept[0] or (s < newest and s not in kept)]:
                self._remove(old)
            self.stats.complete = kept
        return any(s > (self.stats.complete or [-1])[-1] for s in self.stats.written)

    def _remove(self, step: int) -> None:
        folder = step_folder(self.config.directory, step)
        export_path(folder, self._rank).unlink(missing_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)
        self.stats.written = [s for s in self.stats.written if s != step]
        with contextlib.suppress(OSError):  # not empty: the last rank out removes the folder
            folder.rmdir()

    def _failed(self, step: int, exc: Exception) -> None:
        self.stats.errors += 1
        self._store.count(keys.floor_errors(), 1)
        code = _errno(exc)
        if code not in self._warned:
            self._warned.add(code)
            what = {
                errno.ENOSPC: "no space left",
                errno.EIO: "an I/O error",
                errno.EROFS: "a read-only file system",
                errno.EACCES: "no permission",
            }.get(code, "an error")
            logger.warning(
                "[standby rank %d] durable floor: could not write step %d to %s (%s: %s); the job goes on "
                "with its last complete version as its floor (warned once per kind of error)",
                self._rank,
                step,
                self.config.directory,
                what,
                exc,
            )


def drop_half_written(directory: Path, complete: int, store: JobStore) -> list[int]:
    """Deletes every rank's parts (in ``directory`` as this host sees it) of the versions older than
    ``complete`` that no manifest in ``store`` names, and returns their steps: none of them will
    ever complete now (every standby writes its versions in order, and each wrote its part of
    ``complete``). Their own standbys drop them too, but one that closed first (the job ended
    before ``complete`` did) leaves them to the standby whose part completes it."""
    older = sorted(
        int(m.group(1))
        for p in directory.iterdir()
        if (m := _STEP_FOLDER.fullmatch(p.name)) and int(m.group(1)) < complete
    )
    named = store.get_many([keys.floor_version(s) for s in older]) if older else []
    dropped = [step for step, version in zip(older, named, strict=True) if version is None]
    for step in dropped:
        folder = step_folder(directory, step)
        for part in folder.glob("rank*.safetensors"):  # export_path's files
            part.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # not when something else is in it
    return dropped


def _errno(exc: BaseException) -> int:
    """The OS error behind ``exc`` (safetensors' writer says it only in its message: "os error 28");
    -1 when there is none."""
    for cause in (exc, exc.__cause__, exc.__context__):
        if isinstance(cause, OSError) and cause.errno:
            return cause.errno
    found = re.search(r"os error (\d+)", str(exc))
    return int(found.group(1)) if found else -1


def write_part(snapshot: Snapshot, path: Path) -> Path:
    """A rank's part of a version as a standby writes it: ``write_export``'s file, on disk (the
    file and its folder's entry synced) before the part is counted."""
    write_export(snapshot, path)
    _fsync(path)
    return path


def _fsync(path: Path) -> None:
    """The file and its folder's entry on disk before the part is counted."""
    for target in (path, path.parent):
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
