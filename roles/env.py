"""What a role process learns from its environment (set by ``replica launch``,
or by hand / torchrun-style for multi-node jobs): read when a job starts,
never at import."""

from __future__ import annotations

import enum
import functools
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from replica import envvars
from replica.errors import ReplicaError, RoleEnvironmentError
from replica.jobstore.stores import StoreAddress
from replica.mirror.floor import FloorConfig
from replica.session.backends import parse_backends

if TYPE_CHECKING:
    from replica.distributed import ResilientProcessGroup

__all__ = [
    "ACTIONS",
    "Action",
    "DEFAULT_STEPS",
    "Fault",
    "PHASES",
    "Phase",
    "ROLES",
    "Role",
    "RoleEnv",
    "RoleState",
    "base_environ",
    "check_faults",
    "configure_logging",
    "domain_name",
    "durable_of",
    "host_name",
    "job_environ",
    "member_environ",
    "parse_faults",
    "process_group",
    "role_name",
    "shared_domains_allowed",
]

#: The job's step count when the launcher is not told (``replica launch --steps``) and a
#: role's environment does not say (``RoleEnv.steps``).
DEFAULT_STEPS = 20


class Role(enum.StrEnum):
    TRAINER = "trainer"
    STANDBY = "standby"
    ROLLOUT = "rollout"


class RoleState(Protocol):
    """A role process as it is now, for its parts that read it while it changes (the job's
    ``Recovery`` and ``FaultPlan``; ``replica.roles.runtime.Job`` is one): ``role`` (a
    standby's becomes ``Role.TRAINER`` at its promotion) and ``group``, its process group
    (None until the job created it, and in a rollout engine)."""

    role: Role
    group: ResilientProcessGroup | None


def process_group(role: RoleState) -> ResilientProcessGroup:
    """``role.group``, which a trainer and a standby have from their join on; ReplicaError in a
    process without one (a rollout engine)."""
    group = role.group
    if group is None:
        raise ReplicaError(f"this {role.role} process has no process group")
    return group


class Action(enum.StrEnum):
    """What an injected fault does to its process."""

    KILL = "kill"  # SIGKILL (a host: every process its agent started, and the agent)
    FREEZE = "freeze"  # SIGSTOP
    STALL = "stall"  # a slow step
    PARTITION = "partition"  # a host's link down for a while, then up again (its agent does it)
    SLOW = "slow"  # a host's link slowed to a rate for the rest of the job (tc tbf)
    CORRUPT = "corrupt"  # a standby flips a byte of its durable part of the step once written (a rotting disk)


HOST = "host"  # the target of host faults (kill, partition, slow): RANK is the host agent's --index
_HOST_ACTIONS = (Action.KILL, Action.PARTITION, Action.SLOW)
_TIMED = {Action.STALL: timedelta(seconds=3), Action.PARTITION: timedelta(seconds=10)}  # their default duration
_DEFAULT_RATE_MBIT = 100.0  # a slow link's default rate


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
    ``corrupt:standby:RANK@STEP``: that standby flips one byte of its part of the durable
    floor's version of STEP once it wrote it (``--durable``; a disk that rots).
    ``gGEN`` fires it only in process-group generation GEN (a trainer's step redone
    after a failover, or a promoted trainer's: ``g1`` is the first failover's).

    Host faults, fired by host agent N (``replica agent --index N``) once trainer 0
    logged step STEP: ``kill:host:N@STEP`` (every process of the agent, and itself),
    ``partition:host:N@STEP[:SECONDS]`` (the link of the agent's address down that
    long, default 10 s, then up), ``slow:host:N@STEP[:MBIT]`` (that link limited to
    MBIT Mbit/s, default 100, until the agent ends). They need root where the agent runs.

    Built from strings too (``Fault(action="stall", role="trainer", ...)``): they become
    the enums; ValueError for a fault that is not one of these."""

    action: Action = Action.KILL
    role: Role | str  # a Role, or HOST
    rank: int
    step: int
    phase: Phase = Phase.FORWARD  # kill, freeze: where in the step it fires
    duration: timedelta | None = None  # stall, partition (only): how long (None: their default, 3 s and 10 s)
    rate_mbit: float | None = None  # slow (only): the link's rate in Mbit/s (None: 100)
    generation: int | None = None

    def __post_init__(self) -> None:
        action, phase = Action(self.action), Phase(self.phase)
        role = HOST if self.role == HOST else Role(self.role)
        if (role == HOST and action not in _HOST_ACTIONS) or (
            role != HOST and action in (Action.PARTITION, Action.SLOW)
        ):
            raise ValueError("a host takes kill, partition or slow; partition and slow take only a host")
        if action == Action.CORRUPT and role != Role.STANDBY:
            raise ValueError("corrupt takes a standby (its part of a durable version)")
        duration, rate = self.duration, self.rate_mbit
        if action in _TIMED:
            duration = _TIMED[action] if duration is None else duration
            if duration <= timedelta(0):
                raise ValueError(f"{action}: its duration must be > 0, got {duration}")
        elif duration is not None:
            raise ValueError(f"{action} takes no duration")
        if action == Action.SLOW:
            rate = _DEFAULT_RATE_MBIT if rate is None else float(rate)
            if rate <= 0:
                raise ValueError(f"slow: its rate must be > 0 Mbit/s, got {rate:g}")
        elif rate is not None:
            raise ValueError(f"{action} takes no rate")
        for name, value in (
            ("action", action),
            ("role", role),
            ("phase", phase),
            ("duration", duration),
            ("rate_mbit", rate),
        ):
            object.__setattr__(self, name, value)

    def __str__(self) -> str:
        when = "" if self.generation is None else f":g{self.generation}"
        if self.duration is not None:
            return f"{self.action}:{self.role}:{self.rank}@{self.step}:{self.duration.total_seconds():g}{when}"
        if self.rate_mbit is not None:
            return f"{self.action}:{self.role}:{self.rank}@{self.step}:{self.rate_mbit:g}{when}"
        if self.role == HOST:
            return f"{self.action}:{self.role}:{self.rank}@{self.step}"
        return f"{self.action}:{self.role}:{self.rank}@{self.step}:{self.phase}{when}"


def check_faults(
    faults: tuple[Fault, ...],
    *,
    trainers: int,
    standbys: int,
    rollouts: int,
    first_step: int,
    last_step: int,
    agents: int | None = None,
    durable: bool | None = None,
) -> None:
    """ValueError naming the first of ``faults`` that could never fire in this job: a rank
    it does not have, a step it does not run (``first_step`` .. ``last_step``), a host
    without an agent (``agents``: the number of host agents; None: no host faults here), a
    durable part corrupted in a job without a floor (``durable`` False; None: not known here)."""
    counts = {
        Role.TRAINER: ("trainers", trainers),
        Role.STANDBY: ("standbys", standbys),
        Role.ROLLOUT: ("rollouts", rollouts),
    }
    for fault in faults:
        if fault.role == HOST:
            if agents is not None and not 0 <= fault.rank < agents:
                raise ValueError(f"fault {fault}: there are {agents} host agents (0 .. {agents - 1})")
        else:
            what, count = counts[Role(fault.role)]
            if not 0 <= fault.rank < count:
                raise ValueError(
                    f"fault {fault}: the job has {count} {what} "
                    f"({'none' if count == 0 else f'ranks 0 .. {count - 1}'}): it would never fire"
                )
        if not first_step <= fault.step <= last_step:
            raise ValueError(f"fault {fault}: the job runs steps {first_step} .. {last_step}: it would never fire")
        if fault.generation is not None and fault.generation < 0:
            raise ValueError(f"fault {fault}: generations are numbered from 0")
        if fault.action == Action.CORRUPT and durable is False:
            raise ValueError(f"fault {fault}: the job writes no durable floor (--durable): it would never fire")


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """The faults of an ``--inject`` spec (comma-separated, as ``Fault`` says); ValueError
    naming the first bad one. ``",".join(map(str, faults))`` gives the spec back."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            action, role, rest = item.split(":", 2)
            rank, _, when = rest.partition("@")
            step, *extra = when.split(":")
            generation = int(extra.pop()[1:]) if extra and extra[-1].startswith("g") else None
            if len(extra) > 1:
                raise ValueError("too many fields")
            if (
                action not in ACTIONS
                or (role not in ROLES and role != HOST)
                or (action not in (*_TIMED, Action.SLOW) and extra and extra[0] not in PHASES)
            ):
                raise ValueError(f"action one of {ACTIONS}, role one of {ROLES} or {HOST}, phase one of {PHASES}")
        except ValueError as exc:
            raise ValueError(
                f"bad fault {item!r}: expected kill|freeze:ROLE:RANK@STEP[:PHASE][:gGEN], "
                "stall:ROLE:RANK@STEP[:SECONDS][:gGEN], corrupt:standby:RANK@STEP, kill:host:N@STEP, "
                f"partition:host:N@STEP[:SECONDS] or slow:host:N@STEP[:MBIT] ({exc})"
            ) from exc
        try:
            common = functools.partial(Fault, action=Action(action), role=role, generation=generation)
            if action in _TIMED:
                fault = common(
                    rank=int(rank), step=int(step), duration=timedelta(seconds=float(extra[0])) if extra else None
                )
            elif action == Action.SLOW:
                fault = common(rank=int(rank), step=int(step), rate_mbit=float(extra[0]) if extra else None)
            else:
                fault = common(rank=int(rank), step=int(step), phase=Phase(extra[0]) if extra else Phase.FORWARD)
        except (ValueError, OverflowError) as exc:  # OverflowError: a duration timedelta cannot hold
            raise ValueError(f"bad fault {item!r}: {exc}") from exc
        faults.append(fault)
    return tuple(faults)


def role_name(role: Role, rank: int) -> str:
    """A role process's name (``ps -o comm``): ``trainer 0``, ``standby 12``, ``rollout 3``."""
    return f"{role.value} {rank}"


def base_environ() -> dict[str, str]:
    """This process's environment with the defaults every role process starts with where
    the user set nothing else."""
    # Lazy gloo connections: a generation's group is built in ~1 ms and connects at its
    # first collective, instead of waiting out gloo's connect back-off (measured: ~150 ms
    # off every failover here). Set TORCH_GLOO_LAZY_INIT=0 to opt out.
    # UCX prints an error line of its own when an endpoint to a killed peer is closed
    # ("error during flush: Connection reset by remote peer"): replica reports and handles every
    # peer death itself. UCX_LOG_LEVEL=error (or any level) set by the user is kept.
    return {envvars.GLOO_LAZY_INIT: "1", envvars.UCX_LOG_LEVEL: "fatal", **os.environ}


def job_environ(
    *,
    store: str,
    token: str,
    world_size: int,
    steps: int = DEFAULT_STEPS,
    inject: str = "",
    rollouts: int = 0,
    mirror_device: str = "",
    export_dir: str = "",
    resume: str = "",
    backends: Sequence[str] = (),
    strict: bool = False,
    durable: FloorConfig | None = None,
    attempt: int = 0,
) -> dict[str, str]:
    """What every role of a job shares in its environment, as ``RoleEnv.from_environ`` reads
    it: the launchers' half of the contract (``member_environ`` adds each process's role and
    rank). ``inject``: the ``--inject`` spec; "" for ``mirror_device``, ``export_dir``: the
    reader's default. ``attempt``: the job's attempt (its returns to the durable floor so far)."""
    return {
        envvars.STORE: store,
        envvars.TOKEN: token,
        envvars.WORLD_SIZE: str(world_size),
        envvars.STEPS: str(steps),
        envvars.INJECT: inject,
        envvars.ROLLOUTS: str(rollouts),
        envvars.MIRROR_DEVICE: mirror_device,
        envvars.EXPORT_DIR: export_dir,
        envvars.RESUME: resume,
        envvars.BACKENDS: ",".join(backends),
        envvars.STRICT: "1" if strict else "",
        envvars.DURABLE: str(durable.directory) if durable is not None else "",
        envvars.DURABLE_EVERY: str(durable.every_steps) if durable is not None else "",
        envvars.DURABLE_INTERVAL: str(durable.interval.total_seconds()) if durable is not None else "",
        envvars.ATTEMPT: str(attempt) if attempt else "",
    }


def durable_of(env: Mapping[str, str]) -> FloorConfig | None:
    """The durable floor's settings in a role's environment (``job_environ``'s); None: no floor.
    ValueError for a value that does not parse."""
    if not env.get(envvars.DURABLE):
        return None
    defaults = FloorConfig(directory=Path(env[envvars.DURABLE]))
    every = env.get(envvars.DURABLE_EVERY)
    interval = env.get(envvars.DURABLE_INTERVAL)
    return FloorConfig(
        directory=defaults.directory,
        every_steps=int(every) if every else defaults.every_steps,
        interval=timedelta(seconds=float(interval)) if interval else defaults.interval,
    )


def member_environ(role: Role, rank: int, *, spare: int | None = None) -> dict[str, str]:
    """What one role process adds to its job's environment (``job_environ``): its role and rank
    (a spare standby: its index, and a rank it takes from its binding)."""
    return {
        envvars.ROLE: str(Role(role)),
        envvars.RANK: str(rank),
        **({envvars.SPARE: str(spare)} if spare is not None else {}),
    }


@dataclass(kw_only=True, frozen=True, slots=True)
class RoleEnv:
    """What a role process learns from its environment (``from_environ``); the launchers
    write it with ``job_environ`` and ``member_environ`` (``to_environ`` is both)."""

    role: Role
    rank: int
    world_size: int
    store: StoreAddress  # the job store (``REPLICA_STORE``: HOST:PORT or etcd://HOST:PORT,...)
    token: bytes = field(repr=False)
    faults: tuple[Fault, ...] = ()
    host: str = "127.0.0.1"  # where this role's data-plane listeners bind (a routable address across nodes)
    steps: int = DEFAULT_STEPS  # the job's step count (``replica launch --steps``), for the script
    rollouts: int = 0  # rollout engines in the job
    mirror_device: str = ""  # where a standby holds its mirror: "" = its model's device, or "cpu"
    export_dir: str = "replica-export"  # where a standby writes its versions when the job cannot go on
    resume: str = ""  # an export folder (one file per rank, one step) the trainers start from
    backends: tuple[str, ...] = ()  # Config.backends of every role's data plane; (): Config's default
    strict: bool = False  # a divergence after a failover ends the job (replica launch --strict)
    durable: FloorConfig | None = None  # the durable floor the standbys write (replica launch --durable)
    spare: int | None = None  # a spare standby's index (--spares): bound to a rank by the launcher later
    attempt: int = 0  # the job's attempt: its state is under keys.attempt_prefix (a return to the floor)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RoleEnv:
        """Read from ``environ`` (default: this process's environment); RoleEnvironmentError
        when it names no role or token or an unknown role, ValueError for a value that does not
        parse."""
        env = os.environ if environ is None else environ
        missing = [k for k in (envvars.ROLE, envvars.TOKEN) if not env.get(k)]
        if missing:
            raise RoleEnvironmentError(f"{', '.join(missing)} not set: start role processes with `replica launch`")
        store = StoreAddress.parse(
            env.get(envvars.STORE)
            or env.get(envvars.MASTER_ADDR, "127.0.0.1") + ":" + env.get(envvars.STORE_PORT, "29400")
        )
        role = env[envvars.ROLE]
        if role not in ROLES:
            raise RoleEnvironmentError(f"{envvars.ROLE} must be one of {ROLES}, got {role!r}")
        return cls(
            role=Role(role),
            rank=int(env.get(envvars.RANK, env.get(envvars.TORCH_RANK, "0"))),
            world_size=int(env.get(envvars.WORLD_SIZE, env.get(envvars.TORCH_WORLD_SIZE, "1"))),
            store=store,
            token=env[envvars.TOKEN].encode(),
            faults=parse_faults(env.get(envvars.INJECT, "")),
            host=env.get(envvars.HOST, "127.0.0.1"),
            steps=int(env.get(envvars.STEPS) or DEFAULT_STEPS),
            rollouts=int(env.get(envvars.ROLLOUTS, "0")),
            mirror_device=env.get(envvars.MIRROR_DEVICE, ""),
            export_dir=env.get(envvars.EXPORT_DIR) or "replica-export",
            resume=env.get(envvars.RESUME, ""),
            backends=parse_backends(env.get(envvars.BACKENDS, "")),
            strict=env.get(envvars.STRICT, "") == "1",
            durable=durable_of(env),
            spare=int(env[envvars.SPARE]) if env.get(envvars.SPARE) else None,
            attempt=int(env.get(envvars.ATTEMPT) or 0),
        )

    def to_environ(self) -> dict[str, str]:
        """This role's variables as the launchers write them: ``from_environ`` of them is this."""
        return {
            **job_environ(
                store=str(self.store),
                token=self.token.decode(),
                world_size=self.world_size,
                steps=self.steps,
                inject=",".join(map(str, self.faults)),
                rollouts=self.rollouts,
                mirror_device=self.mirror_device,
                export_dir=self.export_dir,
                resume=self.resume,
                backends=self.backends,
                strict=self.strict,
                durable=self.durable,
                attempt=self.attempt,
            ),
            **member_environ(self.role, self.rank, spare=self.spare),
            envvars.HOST: self.host,
        }


def host_name() -> str:
    """The name the job knows this machine by: ``REPLICA_HOST_NAME`` where set (Ray sets its
    node's id, so nodes sharing one machine are told apart), else the hostname."""
    return os.environ.get(envvars.HOST_NAME) or socket.gethostname()


def domain_name() -> str:
    """The failure domain of this process's roles: ``REPLICA_DOMAIN`` where set (a rack, a
    switch, a zone: what fails together), else its host (``host_name``). A standby is placed
    outside its trainer's domain (replica.roles.domains)."""
    return os.environ.get(envvars.DOMAIN) or host_name()


def shared_domains_allowed(flag: bool = False) -> bool:
    """Whether a job may place a standby in its trainer's failure domain: ``--allow-shared-domain``
    (``flag``) or ``REPLICA_ALLOW_SHARED_DOMAIN=1``. Losing that domain then loses both copies of
    the rank's state; one-machine demos and tests allow it."""
    return flag or os.environ.get(envvars.ALLOW_SHARED_DOMAIN) == "1"


def configure_logging() -> None:
    """Log to stderr at ``REPLICA_LOG`` (default WARNING) in every role and the coordinator."""
    logging.basicConfig(
        level=os.environ.get(envvars.LOG, "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
