"""Child-process roles for the mirror's multi-process tests and benchmark: a
trainer rank driven step by step over its pipe, and a standby that can be
promoted to trainer. (The roles layer will own this orchestration; here the
test plays coordinator.)"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_job import Job, JobShape, build_job, train_step

import replica
from replica import ops
from replica.mirror.floor import Floor, FloorConfig
from replica.session.backends import SHM_BACKEND
from replica.state import serialize
from replica.state.restore import bind_state
from replica.state.snapshot import Snapshot, collect_extras
from support.transfer import RawUcx

__all__ = ["Probe", "standby_main", "trainer_main"]

TOKEN = b"mirror-test-token"
GROUP_TIMEOUT = timedelta(seconds=20)
RAW_TIMEOUT = timedelta(seconds=120)


def _store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _join(store: dist.Store, generation: int | None, rank: int, world_size: int, resilient: bool = False) -> None:
    """Plain gloo: a new default group per generation. Resilient: one ResilientProcessGroup
    for the life of the process, re-configured per generation (None: not connected yet)."""
    if resilient:
        if not dist.is_initialized():
            replica.init_resilient_process_group(
                store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT, generation=None
            )
        if generation is not None:
            dist.group.WORLD.configure(generation)
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"gen{generation}", store),
        rank=rank,
        world_size=world_size,
        timeout=GROUP_TIMEOUT,
    )


def _die_in_backward(loss: torch.Tensor) -> None:
    # SIGKILL in the middle of backward: the hook runs once gradients reach the loss's input.
    loss.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))


def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            break
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


class Probe:
    """The benchmark's baselines, measured in a trainer's own process: a memcpy of
    a snapshot's bytes beside the snapshot pack in the same cache state, and raw
    UCX (no digests) to its standby's process."""

    def __init__(self) -> None:
        self._src = self._dst = None
        self._snapshot: Snapshot | None = None
        self._scratch = self._evict = None
        self._raw: RawUcx | None = None

    def pack(self, job: Job, layout: replica.StateLayout, rounds: int, *, shared: bool) -> dict[str, list[float]]:
        """Seconds of the snapshot pack (``Snapshot.capture`` with digests, as ``commit``
        runs it, into a snapshot of its own of ``layout``, in shared memory if ``shared``) and
        of one memcpy of as many bytes, in turns, ``rounds`` of each, with their sources
        in the same state: just read ("hot"), and pushed out of every cache ("cold", as
        a training step leaves a large part of them).

        Every cache is emptied before each call, so none pays for what another left
        behind: a memcpy of this size stores through the cache and leaves its target's
        lines to be written back later (by whatever runs next), where the pack streams
        its stores to memory and has paid for them when it returns. The sources are
        read with streaming stores (``ops.pack`` into a scratch buffer) for the same
        reason."""
        nbytes = layout.total_bytes
        tensors = bind_state(job.model, job.optimizer, rank=layout.rank, world_size=layout.world_size, like=layout)
        if self._snapshot is None or self._snapshot.layout != layout:
            self._snapshot = Snapshot(layout, shared=shared)
            self._src = torch.ones(nbytes, dtype=torch.uint8)
            self._dst = torch.zeros(nbytes, dtype=torch.uint8)
            self._scratch = torch.zeros(nbytes, dtype=torch.uint8)
            self._evict = torch.zeros(2 * _last_level_cache_bytes(), dtype=torch.uint8)
        extras = serialize.encode(collect_extras(job.optimizer, job.extra))  # as commit encodes them

        def memcpy() -> None:
            ctypes.memmove(self._dst.data_ptr(), self._src.data_ptr(), nbytes)

        def pack() -> None:
            self._snapshot.capture(tensors, extras, step=0, digests=True)

        sources = {"memcpy": ([self._src], [0]), "pack": (tensors, list(layout.offsets))}
        memcpy(), pack()  # untimed: the first call after a wait runs on a core that was idle
        seconds: dict[str, list[float]] = {}
        for turn in range(rounds):
            for state in ("hot", "cold"):
                for name, run in (("memcpy", memcpy), ("pack", pack))[:: 1 if turn % 2 else -1]:
                    self._evict.add_(1)
                    if state == "hot":
                        srcs, offsets = sources[name]
                        ops.pack(srcs, self._scratch, offsets)
                    start = time.perf_counter()
                    run()
                    seconds.setdefault(f"{name}_{state}_s", []).append(time.perf_counter() - start)
        return seconds

    def memcpy(self, nbytes: int, block_bytes: int) -> tuple[float, float]:
        """Seconds of a memcpy of ``nbytes``, and of the checksum of the copy (its
        digests per ``block_bytes``: what a pack with digests does besides the copy)."""
        if self._src is None or self._src.numel() != nbytes:
            self._src = torch.empty(nbytes, dtype=torch.uint8)
            self._dst = torch.zeros(nbytes, dtype=torch.uint8)
        # As the pack finds them: a source just written (the optimizer's step), a target
        # last written a step ago.
        self._src.fill_(1)
        start = time.perf_counter()
        ctypes.memmove(self._dst.data_ptr(), self._src.data_ptr(), nbytes)
        copied = time.perf_counter()
        ops.checksum(self._dst, block_bytes)
        return copied - start, time.perf_counter() - copied

    def raw_send(self, address: str, nbytes: int, bucket: int, rounds: int) -> list[float]:
        self._raw = self._raw or RawUcx(token=TOKEN, timeout=RAW_TIMEOUT)
        buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        return [self._raw.send(address, buf, bucket) for _ in range(rounds)]

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()


def _serve_raw(pipe, nbytes: int, bucket: int, rounds: int, raw: RawUcx) -> None:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        raw.receive(buf, bucket)
    pipe.send(("ok",))


def _serve_steps(
    pipe, job: Job, rep: replica.Replicator | None, store, rank, world_size, shape, resilient: bool = False
) -> None:
    """Run commands: ("step", s, die) / ("recover", generation) / ("stats",) / ("exit",),
    and the benchmark's probes."""
    probe = Probe()
    while True:
        cmd = pipe.recv()
        if cmd[0] == "step":
            _, step, die = cmd
            start = time.perf_counter()
            try:
                loss = train_step(job, before_backward=_die_in_backward if die == "backward" else None)
            except Exception as exc:  # noqa: BLE001 - a dead peer surfaces here; the test decides what follows
                pipe.send(("failed", step, repr(exc), "raised"))
                continue
            if resilient and dist.group.WORLD.errored is not None:  # the step ran on garbage: discard it
                pipe.send(("failed", step, repr(dist.group.WORLD.errored), "errored"))
                continue
            if rep is not None:
                rep.commit(step)
            pipe.send(("loss", step, loss, time.perf_counter() - start))
        elif cmd[0] == "recover" and resilient:
            # Survivor: the same FSDP2 module and group; own snapshot restored in place, next generation joined.
            step = rep.rollback()
            _join(store, cmd[1], rank, world_size, resilient)
            pipe.send(("recovered", step))
        elif cmd[0] == "recover":
            # Survivor: a new process group, the job rebuilt under it, the state from this rank's own snapshot.
            _join(store, cmd[1], rank, world_size)
            job = build_job(shape, rank=rank, world_size=world_size, seed=99)
            step = rep.rollback(model=job.model, optimizer=job.optimizer, extra=job.extra)
            pipe.send(("recovered", step))
        elif cmd[0] == "wait_committed":
            pipe.send(("committed", rep.wait_committed()))
        elif cmd[0] == "probe_memcpy":  # benchmark: memcpy of a snapshot's bytes, hot source, cold target
            pipe.send(("memcpy", *probe.memcpy(cmd[1], cmd[2])))
        elif cmd[0] == "probe_pack":  # benchmark: the snapshot pack and a memcpy, sources hot and cold
            shared = SHM_BACKEND in rep.config.backends  # as the replicator's own snapshots
            pipe.send(("pack", probe.pack(job, rep.layout, cmd[1], shared=shared)))
        elif cmd[0] == "raw_send":  # benchmark: raw UCX to a standby's raw listener (see _serve_raw)
            _, address, nbytes, bucket, rounds = cmd
            pipe.send(("raw", probe.raw_send(address, nbytes, bucket, rounds)))
        elif cmd[0] == "stats":
            pipe.send(
                (
                    "stats",
                    {
                        "wait_s": list(rep.stats.wait_s),
                        "extras_s": list(rep.stats.extras_s),
                        "pack_s": list(rep.stats.pack_s),
                        "stream_s": list(rep.stream_stats.stream_s),
                        "post_s": list(rep.stream_stats.post_s),
                        "flush_s": list(rep.stream_stats.flush_s),
                        "reply_s": list(rep.stream_stats.reply_s),
                        "snapshot_bytes": rep.layout.total_bytes,
                    }
                    if rep is not None
                    else {},
                )
            )
        elif cmd[0] == "exit":
            probe.close()
            if rep is not None:
                rep.close()
            dist.destroy_process_group()
            pipe.send(("bye",))
            return


def trainer_main(
    pipe,
    rank: int,
    world_size: int,
    port: int,
    shape: JobShape,
    config_kwargs: dict | None,
    replaces: int | None = None,
    resilient: bool = False,
) -> None:
    """Trainer ``rank``; with ``replaces=g`` a fresh process that takes the place of a
    dead one in generation g, its state fetched from the rank's standby. ``resilient``:
    over a ResilientProcessGroup (the survivor keeps its group and FSDP2 module)."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    store = _store(port)
    # A resilient replacement builds its model before it joins: joining waits for the survivors.
    _join(store, None if resilient and replaces else (replaces or 0), rank, world_size, resilient)
    job = build_job(shape, rank=rank, world_size=world_size, seed=0 if replaces is None else 55)
    rep = None
    config = replica.Config(token=TOKEN, **(config_kwargs or {}))
    if replaces is not None:
        snapshot = replica.fetch_mirror(rank=rank, world_size=world_size, store=store, config=config)
        replica.restore_snapshot(snapshot, job.model, job.optimizer, job.extra, rank=rank, world_size=world_size)
        if resilient:
            _join(store, replaces, rank, world_size, resilient)
        pipe.send(("recovered", snapshot.step))
    else:
        pipe.send(("ready",))
    if config_kwargs is not None:
        rep = replica.Replicator(job.model, job.optimizer, job.extra, store=store, config=config)
    _serve_steps(pipe, job, rep, store, rank, world_size, shape, resilient)


def standby_main(pipe, rank: int, world_size: int, port: int, shape: JobShape, config_kwargs: dict) -> None:
    """A Mirror; on ("promote", generation) it becomes trainer ``rank`` from its own memory."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    store = _store(port)
    config = replica.Config(token=TOKEN, **config_kwargs)
    mirror = replica.Mirror(rank=rank, world_size=world_size, store=store, config=config)
    pipe.send(("ready", mirror.address))
    raw = None  # the benchmark's raw UCX listener
    floor = None  # the benchmark's durable floor, while on
    while True:
        cmd = pipe.recv()
        if cmd[0] == "floor_on":  # ("floor_on", directory, every_steps, interval_s)
            floor = Floor(
                mirror, FloorConfig(directory=Path(cmd[1]), every_steps=cmd[2], interval=timedelta(seconds=cmd[3]))
            )
            pipe.send(("floor",))
        elif cmd[0] == "floor_off":  # its writing finished first; its stats
            floor.close()
            pipe.send(("floor", floor.stats.parts, floor.stats.errors, floor.stats.seconds))
            floor = None
        elif cmd[0] == "raw_listen":
            raw = raw or RawUcx(token=TOKEN, timeout=RAW_TIMEOUT)
            pipe.send(("raw", raw.listen()))
        elif cmd[0] == "raw_receive":
            _serve_raw(pipe, *cmd[1:], raw)
        elif cmd[0] == "held":
            pipe.send(("held", mirror.held_steps(), mirror.stats.corrupted_buckets))
        elif cmd[0] == "export":
            pipe.send(("exported", str(mirror.export(cmd[1]))))
        elif cmd[0] == "promote":
            _join(store, cmd[1], rank, world_size)
            job = build_job(shape, rank=rank, world_size=world_size, seed=77)  # weights differ until restored
            step = mirror.restore(job.model, job.optimizer, job.extra)
            mirror.close()
            rep = replica.Replicator(job.model, job.optimizer, job.extra, store=store, config=config)
            pipe.send(("recovered", step))
            _serve_steps(pipe, job, rep, store, rank, world_size, shape)
            return
        elif cmd[0] == "exit":
            if raw is not None:
                raw.close()
            if floor is not None:
                floor.close()
            mirror.close()
            pipe.send(("bye",))
            return
