"""``replica.Config``: the settings of a Replicator and its Mirror."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from replica import envvars
from replica.ops import ALIGNMENT
from replica.transport.base import check_verify_threads

__all__ = ["Config", "DEVICE_BUCKET_BYTES", "HOST_BUCKET_BYTES", "token_from_env"]

#: ``Config.bucket_bytes`` when unset, for state in device memory: a bucket costs a few
#: frames and thread hops whatever its size, and a GPU moves 64 MiB in about a millisecond
#: (tens of microseconds per bucket were 15-40% of a 4 MiB bucket's time on an H100).
DEVICE_BUCKET_BYTES = 64 << 20
#: ``Config.bucket_bytes`` when unset, for state in host memory (CPU jobs): small enough
#: that hashing one bucket overlaps the transfer of the next on a few cores.
HOST_BUCKET_BYTES = 4 << 20


def token_from_env() -> bytes:
    """The job token from ``REPLICA_TOKEN`` (read when called, never at import)."""
    token = os.environ.get(envvars.TOKEN, "")
    if not token:
        raise ValueError(f"no job token: pass Config(token=...) or set {envvars.TOKEN}")
    return token.encode()


@dataclass(kw_only=True, frozen=True, slots=True)
class Config:
    """How a trainer rank mirrors its shard and how its standby receives it.

    ``token`` is the job's secret; it never appears in ``repr`` or logs.
    ``backends`` lists transports in order of preference; the first whose
    capabilities fit the snapshot's memory and the peer's locality is used. By
    default a GPU mirror on one node takes CUDA IPC (``"ipc"``), a host mirror on one
    node shared memory with one copy (``"shm"``: the trainer's host snapshots then live
    in shared memory), anything else UCX (NIXL where UCX is not installed and NIXL is,
    gloo where neither is; ``"nixl"``: docs/transports.md). A listener
    on ``"shm"`` also listens on the next backend that fits, for peers that cannot map
    its memory (another user or PID namespace), and they connect there instead.
    Every network wait is bounded by ``timeout``; ``commit_timeout`` bounds
    how long ``commit(N+1)`` waits for the global commit of N. A trainer
    waits up to ``standby_wait`` for its standby to be reachable: one not
    registered yet (at least ``timeout``), one it could not connect to (tried
    again with backoff), one that was lost (until a replacement registers; a
    coordinator starts one), then re-sends the last snapshot and goes on; with
    0 (the default) it gives up at the first failed connection and ``commit``
    raises StandbyLostError.

    With ``verify`` every bucket's 64-bit digest is checked on receipt and kept
    with the version it belongs to (digests at rest): restore, rollback, export
    and fetch re-check a version before using it, and a standby re-checks its
    committed version every ``scrub_interval`` (0 disables the scrub), asking
    its trainer to re-send a bucket that changed in memory. Without ``verify``
    no digest is taken, kept or checked. A receiver hashes each piece of a
    host-memory bucket on ``verify_threads`` threads while the next arrives (0,
    the default: every core the process may run on but two, at least one, at most
    eight).

    ``bucket_bytes`` is the unit a snapshot (and a weight push) is packed, hashed
    and sent in; unset (None, the default) it follows where the state lives:
    ``DEVICE_BUCKET_BYTES`` (64 MiB) for GPU state, ``HOST_BUCKET_BYTES`` (4 MiB) for
    host state (``bucket_bytes_for``). A trainer and its standby must agree (the
    standby checks it against the model it would restore into). Up to
    ``num_inflight_buckets`` are in flight at once (8: 512 MiB of device buckets,
    32 MiB of host ones).
    """

    token: bytes = field(repr=False)
    host: str = "127.0.0.1"
    backends: tuple[str, ...] = ("ipc", "shm", "ucx", "nixl", "gloo")
    bucket_bytes: int | None = None
    extras_capacity: int = 1 << 20
    num_inflight_buckets: int = 8
    max_resends: int = 3
    verify: bool = True
    verify_threads: int = 0
    timeout: timedelta = timedelta(seconds=30)
    commit_timeout: timedelta = timedelta(seconds=60)
    standby_wait: timedelta = timedelta(0)
    scrub_interval: timedelta = timedelta(seconds=60)
    store_prefix: str = "replica"

    def __post_init__(self) -> None:
        if not isinstance(self.token, bytes) or not self.token:
            raise ValueError("token must be non-empty bytes (the job's secret)")
        if self.bucket_bytes is not None and (
            isinstance(self.bucket_bytes, bool)
            or not isinstance(self.bucket_bytes, int)
            or self.bucket_bytes <= 0
            or self.bucket_bytes % ALIGNMENT
        ):
            raise ValueError(
                f"bucket_bytes must be a positive multiple of {ALIGNMENT} (or None: by the state's "
                f"device), got {self.bucket_bytes!r}"
            )
        if self.extras_capacity < 64:
            raise ValueError(f"extras_capacity must be >= 64, got {self.extras_capacity}")
        if self.num_inflight_buckets < 1:
            raise ValueError(f"num_inflight_buckets must be >= 1, got {self.num_inflight_buckets}")
        if self.max_resends < 0:
            raise ValueError(f"max_resends must be >= 0, got {self.max_resends}")
        check_verify_threads(self.verify_threads)
        if not self.backends:
            raise ValueError("backends must name at least one transport")
        if not isinstance(self.standby_wait, timedelta) or self.standby_wait < timedelta(0):
            raise ValueError(f"standby_wait must be a non-negative datetime.timedelta, got {self.standby_wait!r}")
        if not isinstance(self.scrub_interval, timedelta) or self.scrub_interval < timedelta(0):
            raise ValueError(
                f"scrub_interval must be a non-negative datetime.timedelta (0 disables the scrub), "
                f"got {self.scrub_interval!r}"
            )
        for name in ("timeout", "commit_timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ValueError(f"{name} must be a positive datetime.timedelta, got {value!r}")

    def bucket_bytes_for(self, device: torch.device | str) -> int:
        """The bucket size for state that lives on ``device``: ``bucket_bytes`` if set,
        else ``DEVICE_BUCKET_BYTES`` for an accelerator and ``HOST_BUCKET_BYTES`` for the host."""
        if self.bucket_bytes is not None:
            return self.bucket_bytes
        return HOST_BUCKET_BYTES if torch.device(device).type == "cpu" else DEVICE_BUCKET_BYTES
