"""What a role process learns from its environment (set by ``replica launch``,
or by hand / torchrun-style for multi-node jobs): read when a job starts,
never at import."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import socket
from dataclasses import dataclass, field

from replica.session.backends import parse_backends
from replica.jobstore.stores import StoreAddress

__all__ = ["ACTIONS", "Action", "Fault", "PHASES", "Phase", "ROLES", "Role", "RoleEnv", "check_faults",
           "configure_logging", "host_name", "parse_faults"]


class Role(enum.StrEnum):
    TRAINER = "trainer"
    STANDBY = "standby"
    ROLLOUT = "rollout"


class Action(enum.StrEnum):
    """What an injected fault does to its process."""

    KILL = "kill"  # SIGKILL (a host: every process its agent started, and the agent)
    FREEZE = "freeze"  # SIGSTOP
    STALL = "stall"  # a slow step
    PARTITION = "partition"  # a host's link down for a while, then up again (its agent does it)
    SLOW = "slow"  # a host's link slowed to a rate for the rest of the job (tc tbf)


HOST = "host"  # the target of host faults (kill, partition, slow): RANK is the host agent's --index
_HOST_ACTIONS = (Action.KILL, Action.PARTITION, Action.SLOW)


class Phase(enum.StrEnum):
    """Where in a step a fault fires."""

    FORWARD = "forward"
    BACKWARD = "backward"
    REDUCE_SCATTER = "reduce-scatter"
    OPTIMIZER = "optimizer"
    MIRROR = "mirror"
    COMMIT = "commit"


ROLES = tuple(r.value for r in Role)
ACTIONS = tuple(a.value for a in Action)
PHASES = tuple(p.value for p in Phase)


@dataclass(kw_only=True, frozen=True, slots=True)
class Fault:
    """``kill:ROLE:RANK@STEP[:PHASE][:gGEN]``: SIGKILL that process at that point.
    ``freeze:ROLE:RANK@STEP[:PHASE][:gGEN]``: SIGSTOP it there (alive but silent, as a
    hung machine or a partition: only a heartbeat deadline finds it; SIGCONT wakes it).
    ``stall:ROLE:RANK@STEP[:SECONDS][:gGEN]``: a slow but live step (default 3 s).
    ``gGEN`` fires it only in process-group generation GEN (a trainer's step redone
    after a failover, or a promoted trainer's: ``g1`` is the first failover's).

    Host faults, fired by host agent N (``replica agent --index N``) once trainer 0
    logged step STEP: ``kill:host:N@STEP`` (every process of the agent, and itself),
    ``partition:host:N@STEP[:SECONDS]`` (the link of the agent's address down that
    long, default 10 s, then up), ``slow:host:N@STEP[:MBIT]`` (that link limited to
    MBIT Mbit/s, default 100, until the agent ends). They need root where the agent runs."""

    action: Action = Action.KILL
    role: Role | str  # a Role, or HOST
    rank: int
    step: int
    phase: Phase = Phase.FORWARD
    seconds: float = 3.0
    generation: int | None = None

    def __str__(self) -> str:
        when = "" if self.generation is None else f":g{self.generation}"
        if self.action in ("stall", "partition", "slow"):
            return f"{self.action}:{self.role}:{self.rank}@{self.step}:{self.seconds:g}{when}"
        if self.role == HOST:
            return f"{self.action}:{self.role}:{self.rank}@{self.step}"
        return f"{self.action}:{self.role}:{self.rank}@{self.step}:{self.phase}{when}"


def check_faults(faults: tuple[Fault, ...], *, trainers: int, standbys: int, rollouts: int, first_step: int,
                 last_step: int, agents: int | None = None) -> None:
    """ValueError naming the first of ``faults`` that could never fire in this job: a rank
    it does not have, a step it does not run (``first_step`` .. ``last_step``), a host
    without an agent (``agents``: the number of host agents; None: no host faults here)."""
    counts = {Role.TRAINER: ("trainers", trainers), Role.STANDBY: ("standbys", standbys),
              Role.ROLLOUT: ("rollouts", rollouts)}
    for fault in faults:
        if fault.role == HOST:
            if agents is not None and not 0 <= fault.rank < agents:
                raise ValueError(f"fault {fault}: there are {agents} host agents (0 .. {agents - 1})")
        else:
            what, count = counts[Role(fault.role)]
            if not 0 <= fault.rank < count:
                raise ValueError(f"fault {fault}: the job has {count} {what} "
                                 f"({'none' if count == 0 else f'ranks 0 .. {count - 1}'}): it would never fire")
        if not first_step <= fault.step <= last_step:
            raise ValueError(f"fault {fault}: the job runs steps {first_step} .. {last_step}: it would never fire")
        if fault.generation is not None and fault.generation < 0:
            raise ValueError(f"fault {fault}: generations are numbered from 0")


def parse_faults(spec: str) -> tuple[Fault, ...]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            action, role, rest = item.split(":", 2)
            rank, _, when = rest.partition("@")
            step, *extra = when.split(":")
            generation = int(extra.pop()[1:]) if extra and extra[-1].startswith("g") else None
            if len(extra) > 1:
                raise ValueError("too many fields")
            if action in ("stall", "partition", "slow"):
                default = {"stall": 3, "partition": 10, "slow": 100}[action]
                fault = Fault(action=action, role=role, rank=int(rank), step=int(step),
                              seconds=float(extra[0] if extra else default), generation=generation)
            else:
                fault = Fault(action=action, role=role, rank=int(rank), step=int(step),
                              phase=extra[0] if extra else "forward", generation=generation)
        except ValueError as exc:
            raise ValueError(f"bad fault {item!r}: expected kill|freeze:ROLE:RANK@STEP[:PHASE][:gGEN], "
                             "stall:ROLE:RANK@STEP[:SECONDS][:gGEN], kill:host:N@STEP, "
                             "partition:host:N@STEP[:SECONDS] or slow:host:N@STEP[:MBIT]") from exc
        if action not in ACTIONS or fault.phase not in PHASES or (role not in ROLES and role != HOST):
            raise ValueError(f"bad fault {item!r}: action one of {ACTIONS}, role one of {ROLES} or {HOST}, phase "
                             f"one of {PHASES}")
        if (role == HOST and action not in _HOST_ACTIONS) or (role != HOST and action in ("partition", "slow")):
            raise ValueError(f"bad fault {item!r}: a host takes kill, partition or slow; partition and slow take "
                             "only a host")
        if fault.seconds <= 0:
            raise ValueError(f"bad fault {item!r}: its duration or rate must be > 0")
        faults.append(dataclasses.replace(fault, action=Action(action), role=HOST if role == HOST else Role(role),
                                          phase=Phase(fault.phase)))
    return tuple(faults)


@dataclass(kw_only=True, frozen=True, slots=True)
class RoleEnv:
    role: Role
    rank: int
    world_size: int
    store: StoreAddress  # the job store (``REPLICA_STORE``: HOST:PORT or etcd://HOST:PORT,...)
    token: bytes = field(repr=False)
    faults: tuple[Fault, ...] = ()
    host: str = "127.0.0.1"  # where this role's data-plane listeners bind (a routable address across nodes)
    rollouts: int = 0  # rollout engines in the job
    mirror_device: str = ""  # where a standby holds its mirror: "" = its model's device, or "cpu"
    export_dir: str = "replica-export"  # where a standby writes its versions when the job cannot go on
    resume: str = ""  # an export folder (one file per rank, one step) the trainers start from
    backends: tuple[str, ...] = ()  # Config.backends of every role's data plane; (): Config's default
    strict: bool = False  # a divergence after a failover ends the job (replica launch --strict)

    @classmethod
    def from_environ(cls) -> RoleEnv:
        env = os.environ
        missing = [k for k in ("REPLICA_ROLE", "REPLICA_TOKEN") if not env.get(k)]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: start role processes with `replica launch`")
        store = StoreAddress.parse(env.get("REPLICA_STORE") or
                                   env.get("MASTER_ADDR", "127.0.0.1") + ":" + env.get("REPLICA_STORE_PORT", "29400"))
        role = env["REPLICA_ROLE"]
        if role not in ROLES:
            raise RuntimeError(f"REPLICA_ROLE must be one of {ROLES}, got {role!r}")
        return cls(role=Role(role), rank=int(env.get("REPLICA_RANK", env.get("RANK", "0"))),
                   world_size=int(env.get("REPLICA_WORLD_SIZE", env.get("WORLD_SIZE", "1"))),
                   store=store, token=env["REPLICA_TOKEN"].encode(),
                   faults=parse_faults(env.get("REPLICA_INJECT", "")), host=env.get("REPLICA_HOST", "127.0.0.1"),
                   rollouts=int(env.get("REPLICA_ROLLOUTS", "0")), mirror_device=env.get("REPLICA_MIRROR_DEVICE", ""),
                   export_dir=env.get("REPLICA_EXPORT_DIR") or "replica-export", resume=env.get("REPLICA_RESUME", ""),
                   backends=parse_backends(env.get("REPLICA_BACKENDS", "")),
                   strict=env.get("REPLICA_STRICT", "") == "1")


def host_name() -> str:
    """The name the job knows this machine by: ``REPLICA_HOST_NAME`` where set (Ray sets its
    node's id, so nodes sharing one machine are told apart), else the hostname."""
    return os.environ.get("REPLICA_HOST_NAME") or socket.gethostname()


def configure_logging() -> None:
    """Log to stderr at ``REPLICA_LOG`` (default WARNING) in every role and the coordinator."""
    logging.basicConfig(level=os.environ.get("REPLICA_LOG", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
