"""The coordinator: hosts the job's store (commit record, membership,
heartbeats), declares roles dead and decides failovers. Runs inside the
``replica launch`` process, which also acts as the local agent that sees its
children exit."""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from replica.commit import CommitRecord

__all__ = ["Coordinator", "Failover"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Failover:
    rank: int
    generation: int
    commit: int | None
    reason: str
    decided_at: float
    killed_at: float | None = None
    timeline_ms: dict[str, float] = field(default_factory=dict)


class Coordinator:
    def __init__(self, *, world_size: int, host: str = "127.0.0.1", port: int = 0,
                 heartbeat_deadline: timedelta = timedelta(seconds=10)):
        # TCPStore binds every interface unless handed a socket: bind the configured host.
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            raise RuntimeError(f"cannot host the job store on {host}:{port}: {exc} "
                               "(is another coordinator running there?)") from exc
        self._listener.listen(128)
        self.host, self.port = self._listener.getsockname()[:2]
        self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                   master_listen_fd=self._listener.detach(), timeout=timedelta(seconds=60))
        self.world_size = world_size
        self.record = CommitRecord(self.store, world_size=world_size)
        self.generation = 0
        self.heartbeat_deadline = heartbeat_deadline.total_seconds()
        self.failovers: list[Failover] = []
        self.standbys_replaced: list[dict] = []
        self.store.set("replica/generation", "0")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stale(self, pid: int) -> bool:
        """True when process ``pid`` has heartbeated before but not within the deadline."""
        key = f"replica/hb/{pid}"
        if not self.store.check([key]):
            return False
        return time.time() - float(self.store.get(key)) > self.heartbeat_deadline

    def fail_trainer(self, rank: int, reason: str) -> Failover:
        """Trainer ``rank`` is dead: fix the commit to resume from, announce the next
        generation, promote the rank's standby."""
        decided = time.time()
        commit = self.record.last()
        self.generation += 1
        g = self.generation
        key = f"replica/standby/{rank}"
        if self.store.check([key]):
            self.store.delete_key(key)  # the promoted standby's address; its replacement publishes anew
        self.store.set(f"replica/failover/{g}", str(commit if commit is not None else -1))
        self.store.set(f"replica/promote/{rank}", str(g))
        self.store.set("replica/generation", str(g))
        failover = Failover(rank=rank, generation=g, commit=commit, reason=reason, decided_at=decided)
        self.failovers.append(failover)
        logger.warning("trainer %d is dead (%s): generation %d resumes from commit %s", rank, reason, g, commit)
        return failover

    def standby_lost(self, rank: int, reason: str) -> None:
        """A standby died: training goes on; its trainer waits for the replacement."""
        self.standbys_replaced.append({"rank": rank, "reason": reason, "at": time.time()})
        logger.warning("standby %d is dead (%s): starting a replacement", rank, reason)

    def fired(self, fault: str) -> float | None:
        """When an injected fault fired (its process records it just before dying)."""
        key = f"replica/killed/{fault}"
        return float(self.store.get(key)) if self.store.check([key]) else None

    def observe(self, failover: Failover, faults: list[str]) -> None:
        """Fill in the failover's timeline from what the roles recorded."""
        g = failover.generation
        killed = [t for t in map(self.fired, faults) if t is not None]
        failover.killed_at = max((k for k in killed if k <= failover.decided_at), default=None)
        t0 = failover.killed_at or failover.decided_at
        failover.timeline_ms["detect"] = (failover.decided_at - t0) * 1e3
        for name, key in (("promote", f"replica/restored/{g}"), ("reconnect", f"replica/reconnected/{g}"),
                          ("resumed", f"replica/resumed/{g}")):
            if self.store.check([key]):
                failover.timeline_ms[name] = (float(self.store.get(key)) - t0) * 1e3
