"""``RayJob``: a replica job driven from Python on a Ray cluster, for an RL framework's
single controller (verl, OpenRLHF, NeMo-RL style): the driver process hosts the
coordinator and the job store, the roles run the user's script in Ray actors."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from replica import envvars
from replica.errors import JobLifecycleError, JobWaitTimeoutError
from replica.jobstore import keys
from replica.ray.launch import ray_agents
from replica.ray.ray_agents import Placement, RayAgents
from replica.roles.coordinator import Coordinator
from replica.roles.election import Leadership
from replica.roles.env import HOST, Role, parse_faults, shared_domains_allowed
from replica.roles.local_agent import open_job, start_roles
from replica.roles.rollouts import Rollouts, Sampling, request_rollouts
from replica.roles.spares import SparePool
from replica.roles.supervise import JobSpec, supervise
from replica.roles.timing import Deadlines
from replica.session.backends import parse_backends

__all__ = ["RayJob", "RayJobConfig"]


@dataclass(kw_only=True, frozen=True, slots=True)
class RayJobConfig:
    """What ``replica launch`` takes, as a config. ``script``: the user's script and its
    arguments, run by every role; ``address``: the Ray cluster (None: the one ``ray.init``
    already joined, else ``"auto"``); ``host``: where the job store listens (on several
    machines, the driver's routable address); ``store``: keep the job's state in etcd
    instead (``etcd://H1:2379,H2:2379,H3:2379/NAMESPACE``, credentials in
    ``REPLICA_ETCD_USER``/``REPLICA_ETCD_PASSWORD``, ``REPLICA_ETCD_CA`` at the same path on
    every node); the namespace must hold no other job."""

    script: tuple[str, ...]
    trainers: int = 2
    standbys: int | None = None  # ranks 0..K-1 have standbys (default: all)
    rollouts: int = 0
    steps: int = 20
    replacements: int = -1  # new standbys or engines Ray may start in all (< 0: no limit)
    placement: Placement = field(default_factory=Placement)
    deadlines: Deadlines = field(default_factory=Deadlines)
    train_while_replacing: bool = False
    spares: int = 0  # spare standbys started ahead on nodes without a trainer (replica launch --spares)
    timeout: timedelta = timedelta(minutes=10)
    inject: str = ""
    report: Path | None = None
    export_dir: Path = Path("replica-export")
    mirror_device: str = "model"
    backends: str = ""  # every role's Config.backends, comma-separated ("": the default)
    strict: bool = False  # a step that diverges after a failover ends the job (replica launch --strict)
    address: str | None = None
    host: str = "127.0.0.1"
    store: str = ""  # etcd://HOSTS/NAMESPACE: the job's state in etcd (default: a store hosted by the driver)
    # A standby may share its trainer's failure domain (its node, or REPLICA_DOMAIN); else such a
    # job fails as set up wrong (ExitCode.USAGE). REPLICA_ALLOW_SHARED_DOMAIN=1 allows it too.
    allow_shared_domain: bool = False

    def __post_init__(self):
        standbys = self.trainers if self.standbys is None else self.standbys
        if not self.script:
            raise ValueError("script: the user's script (and its arguments) is required")
        if (
            self.trainers < 1
            or not 0 <= standbys <= self.trainers
            or self.rollouts < 0
            or self.steps < 1
            or self.spares < 0
        ):
            raise ValueError(
                f"need trainers >= 1, 0 <= standbys <= trainers, rollouts >= 0, steps >= 1, spares >= 0; "
                f"got {self.trainers}, {standbys}, {self.rollouts}, {self.steps}, {self.spares}"
            )
        parse_backends(self.backends)
        if any(f.role == HOST for f in parse_faults(self.inject)):
            raise ValueError("host faults are for `replica agent` hosts; on Ray, remove or kill a node instead")


class RayJob:
    """Start the job's roles on Ray, watch it from the driver, shut it down. The
    coordinator's loop runs on a thread of the driver; ``wait`` joins it."""

    def __init__(self, config: RayJobConfig):
        self.config = config
        self.coordinator: Coordinator | None = None
        self.agents: RayAgents | None = None
        self._thread: threading.Thread | None = None
        self._status: int | None = None
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        self._leadership: Leadership | None = None
        self._token = b""

    @property
    def standbys(self) -> int:
        return self.config.trainers if self.config.standbys is None else self.config.standbys

    def start(self) -> None:
        """Place the job (PlacementError within the placement deadline if the cluster cannot)
        and start every role; returns once they are started, the job going on."""
        if self.coordinator is not None:
            raise JobLifecycleError("this RayJob was started already")
        c = self.config
        self.coordinator, env, self._leadership = open_job(
            trainers=c.trainers,
            rollouts=c.rollouts,
            deadlines=c.deadlines,
            host=c.host,
            inject=c.inject,
            steps=c.steps,
            mirror_device=c.mirror_device,
            export_dir=c.export_dir,
            store=c.store,
            backends=c.backends,
            strict=c.strict,
            shared_domains=shared_domains_allowed(c.allow_shared_domain),
        )
        self._token = env[envvars.TOKEN].encode()  # the driver's requests reach the engines' desks with it
        try:
            self.agents = ray_agents(
                address=c.address or "auto",
                placement=c.placement,
                script=list(c.script),
                env=env,
                replacements=c.replacements,
                trainers=c.trainers,
                rollouts=c.rollouts,
                standbys=self.standbys,
                members=self.coordinator.members_for_placement,
                shared_domains=self.coordinator.shared_domains,
            )
            start_roles(self.coordinator, self.agents, trainers=c.trainers, standbys=self.standbys, rollouts=c.rollouts)
            self.agents.wait_started(c.placement.start_timeout)
        except BaseException:
            self.shutdown()
            raise
        spec = JobSpec(
            steps=c.steps,
            faults=parse_faults(c.inject),
            timeout=c.timeout,
            report=c.report,
            train_while_replacing=c.train_while_replacing,
            export_dir=c.export_dir,
        )
        self._thread = threading.Thread(
            target=self._supervise, args=(spec, self.coordinator, self.agents), name="replica-coordinator", daemon=True
        )
        self._thread.start()

    def _supervise(self, spec: JobSpec, coordinator: Coordinator, agents: RayAgents) -> None:
        try:
            leading = self._leadership.leading if self._leadership is not None else None
            # Placed from the coordinator's loop once every trainer joined (their nodes known).
            spares = SparePool(coordinator.store, self.config.spares, agents) if self.config.spares else None
            self._status = supervise(coordinator, spec, agents, cancel=self._cancel, leading=leading, spares=spares)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc

    def wait(self, timeout: timedelta | None = None) -> int:
        """The job's exit status once it ended (0: every trainer finished); JobWaitTimeoutError
        (a TimeoutError) after ``timeout`` (the job goes on)."""
        if self._thread is None:
            raise JobLifecycleError("start() the job first")
        self._thread.join(None if timeout is None else timeout.total_seconds())
        if self._thread.is_alive():
            raise JobWaitTimeoutError(f"the job is still running after {timeout}")
        if self._error is not None:
            raise self._error
        assert self._status is not None  # the loop ended without an error: it returned the status
        return self._status

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def commit(self) -> int | None:
        """The last global commit: the step every rank's state is safe at."""
        return self.coordinator.record.last() if self.coordinator else None

    def failovers(self) -> list[dict]:
        """The failovers so far: rank, generation, commit, reason and the timeline (ms)."""
        return [dataclasses.asdict(f) for f in self.coordinator.failovers] if self.coordinator else []

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling = Sampling(),
        *,
        num_shards: int | None = None,
        timeout: timedelta = timedelta(minutes=2),
    ) -> Rollouts:
        """Completions (token ids) of ``prompts`` from the job's rollout engines, with the
        newest weights the trainers pushed (``Rollouts.versions`` says which, per prompt).
        The trainers push (``rollouts.push(step)`` in the script): the weights go from
        their shards to the engines, never through the driver. Shards of the request
        (default: one per engine) go to live engines; an engine that dies meanwhile has its
        shard served by another. StoreWaitTimeoutError after ``timeout``."""
        if self.coordinator is None:
            raise JobLifecycleError("start() the job first")
        if self.config.rollouts < 1:
            raise ValueError("this job has no rollout engines (RayJobConfig.rollouts = 0)")
        return request_rollouts(
            self.coordinator.store,
            prompts,
            sampling,
            timeout=timeout,
            token=self._token,
            num_shards=num_shards or self.config.rollouts,
            num_engines=self.config.rollouts,
        )

    def weights_version(self) -> int | None:
        """The newest weight version every trainer pushed to the engines (None before the first)."""
        if self.coordinator is None:
            return None
        latest = self.coordinator.store.own().get(keys.latest_version())
        return None if latest is None else latest.value

    def roles(self) -> dict[str, str]:
        """Where each live role runs: ``"trainer 0"`` -> Ray node id."""
        return self.agents.nodes() if self.agents else {}

    def actor(self, role: str | Role, rank: int):
        """A role's live actor (a Ray handle), e.g. to kill it in a test."""
        return self.agents.actor(str(Role(role)), rank) if self.agents else None

    def shutdown(self) -> None:
        """End the job: the coordinator's loop stopped (the end announced, the report written),
        the roles' actors killed, the placement group freed."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self.agents is not None:
            self.agents.stop()
        if self._leadership is not None:
            self._leadership.resign()

    def __enter__(self) -> RayJob:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
