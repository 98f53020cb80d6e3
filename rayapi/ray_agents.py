"""``supervise.Agent`` on Ray: the job's roles are actors, and Ray's own signals are agent
reports. An actor's death (``ActorDiedError``: ``ray.kill``, a killed worker, a node
removed) is the role's exit; an actor Ray cannot reach (``ActorUnavailableError``) or a
node Ray declared dead makes its host silent, as a host agent that stopped beating
does. These come beside the job's own signals (transport reports, heartbeats), never
instead of them.

Placement: one placement group for the job's machines, a bundle per trainer and one per
rollout machine (standbys live on the rollout machines: rollout r's, standby r's unless
that is in trainer r's failure domain, a node or its ``Placement.domain_label`` label:
then another's), spread over distinct nodes by default. A replacement goes into a bundle of the
job's that has room for it (what its live actors leave free) on a node where no trainer
runs now (the coordinator's members say which: a promoted standby made its rollout machine
a trainer's): the replaced role's own bundle first, else the least loaded. A bundle whose
node was lost is moved by Ray to a healthy node once one has room; a machine whose trainer
died (its node alive) takes a standby or an engine."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import cast

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from replica.errors import PlacementError
from replica.ray.actor import RoleProcess, node_domain, node_host_name
from replica.roles.domains import pair_apart
from replica.roles.env import Role, member_environ
from replica.roles.probe import Verdict, by_host
from replica.roles.remote_agents import kept_apart_from, replacement_site
from replica.roles.spares import Replacements
from replica.timing import Deadline

__all__ = ["Placement", "RayAgents"]

logger = logging.getLogger(__name__)

_WAIT_SLICE = timedelta(seconds=1)  # how long an actor's wait() blocks before it answers "still running"
_NODE_SILENCE = timedelta(seconds=1)  # a node unreachable this long confirms a silent role's death
_NODES_EVERY = timedelta(milliseconds=500)  # how often Ray's node table is read for dead nodes
_RETRY_AFTER = timedelta(seconds=1)  # a replacement whose actor died before it started is placed again after this
_BOOKKEEPING = ("node:", "memory", "object_store_memory", "accelerator_type:")  # resources no role asks for


@dataclass(kw_only=True, frozen=True, slots=True)
class Placement:
    """Ray resources per role and how the job's machines are spread. ``strategy`` is Ray's
    placement-group strategy over the bundles (one per trainer, one per rollout machine):
    ``STRICT_SPREAD`` puts each on its own node, so no standby shares a trainer's fate."""

    trainer: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    rollout: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    standby: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    strategy: str = "STRICT_SPREAD"
    timeout: timedelta = timedelta(seconds=60)  # for the placement group to be placed
    # For each actor to run its role: a new Ray worker imports replica (torch) before it starts
    # the role, several at once on a loaded machine.
    start_timeout: timedelta = timedelta(minutes=3)
    # A Ray node label whose value is a node's failure domain (``ray start --labels '{"rack": "r7"}'``):
    # no standby in its trainer's rack. None: every node is a domain of its own.
    domain_label: str | None = None

    def bundles(self, *, trainers: int, rollouts: int, standbys: int) -> list[dict[str, float]]:
        """Bundles 0..trainers-1 for the trainers, then one per rollout machine."""
        machines = max(rollouts, standbys)
        return [dict(self.trainer) for _ in range(trainers)] + [
            _plus(self.rollout if r < rollouts else {}, self.standby if r < standbys else {}) for r in range(machines)
        ]


def _plus(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}


def _actor_options(resources: dict[str, float]) -> dict:
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {
        "num_cpus": cpus,
        "num_gpus": gpus,
        **({"resources": custom} if custom else {}),
        "max_concurrency": 1,
        "max_restarts": 0,
    }


@dataclass(kw_only=True, slots=True)
class _Actor:
    role: Role
    rank: int
    handle: ActorHandle[RoleProcess]
    resources: dict[str, float]
    bundle: int | None  # its bundle in the job's placement group (None: pinned to a node outside it)
    started: float
    pid: int | None = None
    node: str | None = None
    code: int | None = None  # its exit code, once reported
    unavailable_since: float | None = None
    killed: bool = False  # declared dead and killed: its bundle's share is free for a replacement
    replacement: bool = False  # started by _replace: placed again if its actor dies before its role starts
    spare: int | None = None  # a spare standby's index (no rank until bound: roles/spares.py)

    @property
    def host(self) -> str | None:
        return node_host_name(self.node) if self.node else None

    @property
    def holds_share(self) -> bool:
        """Running, as far as the job knows: it counts against its node and bundle."""
        return self.code is None and not self.killed


class RayAgents:
    """Starts the job's roles as Ray actors and reports what Ray sees of them. ``script``:
    the user's script and its arguments; ``env``: the roles' environment (the job store's
    address, token, ...); ``replacements`` < 0: no limit; ``members()``: the coordinator's
    live members as (role, rank, host, domain), which say where trainers run now;
    ``shared_domains``: a standby may be placed in its trainer's failure domain."""

    def __init__(
        self,
        *,
        script: list[str],
        env: dict[str, str],
        replacements: int,
        placement: Placement,
        trainers: int,
        rollouts: int,
        standbys: int,
        members: Callable[[], list[tuple[str, int, str, str]]],
        shared_domains: bool = False,
    ):
        self._script, self._env, self.placement = script, env, placement
        self._replacements = Replacements(replacements)
        # A site's failure domain is its node's (node_domain: the node, or its placement.domain_label
        # label), as each role's REPLICA_DOMAIN is: placement compares them with the members' domains.
        self._members = members
        self._shared_domains = shared_domains
        self._standby_site = list(range(standbys))  # standby r's rollout machine (reserve pairs them apart)
        self._trainers, self._rollouts, self._standbys = trainers, rollouts, standbys
        self._remote = ray.remote(RoleProcess)
        self._actors: list[_Actor] = []
        self._calls: dict[ray.ObjectRef, _Actor] = {}  # one where() or wait() in flight per live actor
        self._pg: PlacementGroup | None = None
        self._dead_nodes: set[str] = set()
        self._next_nodes_read = Deadline.now()  # when Ray's node table is read next
        self._retries: list[tuple[Deadline, _Actor]] = []  # (when, the replacement to place again)

    # --- placement ---

    def reserve(self) -> None:
        """Reserve the job's machines (a placement group); PlacementError if Ray cannot
        within ``placement.timeout``, naming what was asked and what the cluster has."""
        bundles = self.placement.bundles(trainers=self._trainers, rollouts=self._rollouts, standbys=self._standbys)
        self._pg = placement_group(bundles, strategy=self.placement.strategy, name=f"replica-{id(self):x}")
        if not self._pg.wait(int(self.placement.timeout.total_seconds())):
            remove_placement_group(self._pg)
            self._pg = None
            nodes = [
                {k: v for k, v in n["Resources"].items() if not k.startswith(_BOOKKEEPING)}
                for n in ray.nodes()
                if n["Alive"]
            ]
            raise PlacementError(
                f"the Ray cluster cannot place the job within {self.placement.timeout.total_seconds():g} s: "
                f"it asks for {len(bundles)} bundles {bundles} with strategy {self.placement.strategy} "
                f"({self._trainers} trainers, {max(self._rollouts, self._standbys)} rollout machines); "
                f"the cluster's {len(nodes)} live nodes have {nodes}"
            )
        if not self._shared_domains:
            self._pair_apart(self._pg)

    def _pair_apart(self, pg: PlacementGroup) -> None:
        """Which rollout machine each rank's standby takes: never one in its trainer's failure
        domain (rank r keeps machine r where it may); PlacementError, the job's machines freed,
        when the placed bundles allow no such pairing."""
        alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        nodes = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
        domain = [self._domain(nodes.get(b, ""), alive) for b in range(self._trainers + self._standbys)]
        trainers, sites = domain[: self._trainers], domain[self._trainers :]
        paired = pair_apart(trainers[: self._standbys], sites)
        if paired is None:
            remove_placement_group(pg)
            self._pg = None
            raise PlacementError(
                f"no standby can be kept out of its trainer's failure domain: the job's machines are in "
                f"{', '.join(f'trainer {r}: {d}' for r, d in enumerate(trainers))}; standbys' machines: "
                f"{', '.join(sites)} (a domain is a node, or its Ray label placement.domain_label="
                f"{self.placement.domain_label!r}); add nodes in other domains, or allow it (--allow-shared-domain)"
            )
        self._standby_site = paired

    def _domain(self, node: str, alive: dict[str, dict]) -> str:
        """Ray node ``node``'s failure domain, from its labels in ``alive`` (Ray's node table)."""
        return node_domain(node, alive.get(node, {}).get("Labels") or {}, self.placement.domain_label)

    def start(self, role: Role, rank: int) -> None:
        """A role in its bundle (after ``reserve``): trainer r in bundle r, rollout and standby r
        in bundle trainers + r (standby r in the one ``reserve`` paired it with: outside its
        trainer's failure domain). Replacements: ``_replace``."""
        resources = {
            Role.TRAINER: self.placement.trainer,
            Role.ROLLOUT: self.placement.rollout,
            Role.STANDBY: self.placement.standby,
        }[Role(role)]
        self._launch(role, rank, resources, self._own_bundle(Role(role), rank))

    def _own_bundle(self, role: Role, rank: int) -> int | None:
        """The bundle a role of ``rank`` was placed in first (a spare, rank -1, has none)."""
        if rank < 0:
            return None
        if role == Role.TRAINER:
            return rank
        return self._trainers + (self._standby_site[rank] if role == Role.STANDBY else rank)

    def _launch(
        self,
        role: Role,
        rank: int,
        resources: dict[str, float],
        bundle: int | None,
        node: str | None = None,
        *,
        started: float | None = None,
        spare: int | None = None,
    ) -> None:
        """An actor in ``bundle`` of the job's placement group, or (None) pinned to ``node``;
        ``started``: a replacement's first try (its start timeout counts from there)."""
        if bundle is not None:
            if self._pg is None:
                raise PlacementError(f"{role} {rank}: the job's machines are not reserved yet (reserve)")
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=bundle)
        else:
            assert node is not None  # _place pins an actor to a node where no bundle has room
            strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        env = {**self._env, **member_environ(role, rank, spare=spare)}
        actor_class = self._remote.options(scheduling_strategy=strategy, name=None, **_actor_options(resources))
        # cast: ray types what .remote() returns as ActorHandle | type[RoleProcess] (so that the class's
        # methods have types); it is the actor's handle
        handle = cast(ActorHandle[RoleProcess], actor_class.remote(self._script, env, self.placement.domain_label))
        actor = _Actor(
            role=Role(role),
            rank=rank,
            handle=handle,
            resources=resources,
            bundle=bundle,
            started=started or time.monotonic(),
            replacement=started is not None,
            spare=spare,
        )
        self._actors.append(actor)
        self._calls[handle.where.remote()] = actor

    def wait_started(self, timeout: timedelta) -> None:
        """Until every actor started so far runs its role; PlacementError after ``timeout``."""
        deadline = Deadline.after(timeout)
        while any(a.pid is None and a.code is None for a in self._actors) and not deadline.expired:
            self._take(0.05)
        late = [f"{a.role} {a.rank}" for a in self._actors if a.pid is None]
        if late:
            raise PlacementError(f"roles not started within {timeout.total_seconds():g} s: {', '.join(late)}")

    # --- supervise.Agent ---

    def exits(self) -> list[tuple[int, int, str | None]]:
        gone = self._take(0.0)
        now = time.monotonic()
        due = [a for when, a in self._retries if when.at <= now]
        self._retries = [(when, a) for when, a in self._retries if when.at > now]
        for actor in due:
            if (
                not self._place(actor.role, actor.rank, actor.resources, first_try=actor.started, spare=actor.spare)
                and now - actor.started < self.placement.start_timeout.total_seconds()
            ):
                # nowhere yet: a lost node's bundle may move
                self._retries.append((Deadline(now) + _RETRY_AFTER, actor))
        return gone

    def _take(self, timeout_s: float) -> list[tuple[int, int, str | None]]:
        """Collect the answers in: where() gives a role's pid and node, wait() its exit (or
        None: ask again), an error the actor's death or unreachability."""
        gone: list[tuple[int, int, str | None]] = []
        if not self._calls:
            return gone
        ready, _ = ray.wait(list(self._calls), num_returns=len(self._calls), timeout=timeout_s)
        now = time.monotonic()
        for ref in ready:
            actor = self._calls.pop(ref)
            try:
                answer = ray.get(ref)
            except ActorUnavailableError:  # not known dead: its node may be lost or cut off; ask again
                actor.unavailable_since = actor.unavailable_since or now
                self._ask(actor)
                continue
            except RayActorError as exc:
                actor.code = -9
                if (
                    actor.pid is None
                    and actor.replacement
                    and now - actor.started < self.placement.start_timeout.total_seconds()
                ):
                    # placed on a node that was dying (Ray had not declared it dead yet): place it again
                    logger.warning(
                        "the new %s %d's actor died before its role started (%s): placing it again",
                        actor.role,
                        actor.rank,
                        type(exc).__name__,
                    )
                    self._retries.append((Deadline(now) + _RETRY_AFTER, actor))
                elif actor.pid is None:
                    logger.error("%s %d's actor died before its role started: %s", actor.role, actor.rank, exc)
                else:
                    logger.warning(
                        "%s %d's actor died (%s): reported as its exit", actor.role, actor.rank, type(exc).__name__
                    )
                    gone.append((actor.pid, -9, actor.host))
                continue
            actor.unavailable_since = None
            if isinstance(answer, tuple):
                actor.pid, actor.node = answer
            elif answer is not None:  # the role ended: its actor goes too, freeing its bundle's share
                assert actor.pid is not None  # wait() is asked once where() answered
                actor.code = answer
                gone.append((actor.pid, answer, actor.host))
                ray.kill(actor.handle, no_restart=True)
                continue
            self._ask(actor)
        for actor in self._actors:  # an actor never placed (a replacement with nowhere to go) is given up
            if (
                actor.pid is None
                and actor.code is None
                and now - actor.started > self.placement.start_timeout.total_seconds()
            ):
                logger.error(
                    "%s %d could not be started within %g s: given up",
                    actor.role,
                    actor.rank,
                    self.placement.start_timeout.total_seconds(),
                )
                actor.code = -1
                ray.kill(actor.handle, no_restart=True)
                self._calls = {r: a for r, a in self._calls.items() if a is not actor}
        return gone

    def _ask(self, actor: _Actor) -> None:
        self._calls[actor.handle.wait.remote(_WAIT_SLICE.total_seconds())] = actor  # RoleProcess.wait takes seconds

    def replace_standby(self, rank: int) -> bool:
        return self._replace(Role.STANDBY, rank, self.placement.standby)

    def replace_rollout(self, index: int) -> bool:
        return self._replace(Role.ROLLOUT, index, self.placement.rollout)

    def _replace(self, role: Role, rank: int, resources: dict[str, float]) -> bool:
        if self._replacements.left == 0 or not self._place(role, rank, resources, first_try=time.monotonic()):
            return False
        return self._replacements.take()

    def start_spare(self, index: int) -> bool:
        """A spare standby ``index`` on a node without a trainer (it may be bound to any rank),
        with the standby's resources; False until every trainer has joined (their nodes are
        known) or while no node has room. Spares are not counted against the replacements;
        their refills are (``take_replacement``)."""
        if sum(role == Role.TRAINER for role, *_ in self._members()) < self._trainers:
            return False
        return self._place(Role.STANDBY, -1, self.placement.standby, first_try=time.monotonic(), spare=index)

    def take_replacement(self) -> bool:
        return self._replacements.take()

    def spare_of(self, pid: int, host: str | None = None) -> int | None:
        return next((a.spare for a in self._actors if a.pid == pid and (host is None or a.host == host)), None)

    def _place(
        self, role: Role, rank: int, resources: dict[str, float], *, first_try: float, spare: int | None = None
    ) -> bool:
        """Start a replacement where ``_bundle_for``/``_node_for`` say, on a node Ray has not
        declared dead and where none of the job's actors is unreachable now."""
        suspect = {a.node for a in self._actors if a.unavailable_since is not None and a.code is None}
        alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"] and n["NodeID"] not in suspect}
        avoid = kept_apart_from(spare=spare is not None)
        trainer_domains = {domain for r, _, _, domain in self._members() if r in avoid}
        own = self._own_bundle(role, rank)
        bundle = self._bundle_for(own, resources, alive, trainer_domains)
        node = self._node_for(resources, alive, trainer_domains) if bundle is None else None
        if bundle is None and node is None and self.placement.strategy != "STRICT_SPREAD" and spare is None:
            # The job was placed sharing nodes (PACK, SPREAD: a one-node cluster, say): beside a
            # trainer is better than nothing: it survives a process's death, not the node's.
            bundle = self._bundle_for(own, resources, alive, set())
            node = self._node_for(resources, alive, set()) if bundle is None else None
            if bundle is not None or node is not None:
                logger.warning(
                    "no live Ray node without a trainer has room for a new %s %d: it shares a trainer's "
                    "node (placement strategy %s), and does not survive that node's loss",
                    role,
                    rank,
                    self.placement.strategy,
                )
        if bundle is None and node is None:  # a spare is asked for again later: said once, by its pool
            logger.log(
                logging.ERROR if spare is None else logging.DEBUG,
                "no live Ray node without a trainer has room for a new %s %d (%s): it is not started",
                role,
                rank,
                resources,
            )
            return False
        if bundle is not None:
            where = f"in bundle {bundle} of the job's placement group"
        else:
            assert node is not None  # (neither: returned above)
            where = f"on Ray node {node[:12]} (no bundle of the job's has room)"
        self._launch(role, rank, resources, bundle, node, started=first_try, spare=spare)
        logger.warning("starting a new %s %s", f"{role} {rank}" if spare is None else f"spare standby {spare}", where)
        return True

    def _node_for(self, resources: dict[str, float], alive: dict[str, dict], trainer_domains: set[str]) -> str | None:
        """Outside the job's placement group: the live node in no trainer's failure domain whose
        resources (in all) cover ``resources`` and that runs the fewest of the job's roles."""
        load: dict[str, int] = {}
        for a in self._actors:
            if a.holds_share and a.node:
                load[a.node] = load.get(a.node, 0) + 1
        fits = [
            n
            for n, info in alive.items()
            if all(info["Resources"].get(k, 0.0) >= v for k, v in resources.items() if v > 0)
        ]
        return replacement_site(
            fits,
            domain=lambda n: self._domain(n, alive),
            trainer_domains=trainer_domains,
            load=lambda n: load.get(n, 0),
            order=lambda n: n,
        )

    def _bundle_for(
        self, own: int | None, resources: dict[str, float], alive: dict[str, dict], trainer_domains: set[str]
    ) -> int | None:
        """A bundle with room for ``resources`` (its capacity less its live actors') on a live node
        in no trainer's failure domain now: the role's ``own`` first, else the least loaded."""
        capacity = self.placement.bundles(trainers=self._trainers, rollouts=self._rollouts, standbys=self._standbys)
        nodes = ray.util.placement_group_table(self._pg).get("bundles_to_node_id", {}) if self._pg else {}
        live = [a for a in self._actors if a.holds_share]

        def room(b: int) -> bool:
            used: dict[str, float] = {}
            for a in live:
                if a.bundle == b:
                    used = _plus(used, a.resources)
            return all(capacity[b].get(k, 0.0) - used.get(k, 0.0) >= v - 1e-9 for k, v in resources.items() if v > 0)

        # on a live node (a lost node's bundle waits for Ray to move it) with room, without a trainer;
        # the role's own bundle ranks first
        fits = [b for b in range(len(capacity)) if nodes.get(b) in alive and room(b)]
        return replacement_site(
            fits,
            domain=lambda b: self._domain(nodes[b], alive),
            trainer_domains=trainer_domains,
            load=lambda b: -1 if b == own else sum(1 for a in live if a.bundle == b),
            order=lambda b: b,
        )

    def kill(self, pid: int, host: str | None = None) -> None:
        for actor in self._actors:
            if actor.pid == pid and (host is None or actor.host == host) and actor.code is None:
                ray.kill(actor.handle, no_restart=True)  # the role dies with its actor
                actor.killed = True

    def unaware_of_end(self) -> set[str]:
        return set()  # Ray's actors are this process's: nothing on the nodes waits for the store

    def silent_hosts(self, longer_than: timedelta) -> set[str]:
        now = time.monotonic()
        if self._next_nodes_read.expired:
            self._next_nodes_read = Deadline(now) + _NODES_EVERY
            self._dead_nodes = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
        silent = {node_host_name(n) for n in self._dead_nodes}
        silent |= {
            a.host
            for a in self._actors
            if a.host and a.unavailable_since is not None and now - a.unavailable_since > longer_than.total_seconds()
        }
        return silent

    def running(self, pids: set[int]) -> bool:
        return any(a.code is None for a in self._actors if a.pid in pids)

    def probe(self, pid: int, host: str | None = None) -> tuple[Verdict, str]:
        return by_host(host or "", self.silent_hosts(_NODE_SILENCE))

    # --- the end ---

    def wait(self, timeout: timedelta) -> None:
        """Until every role ended by itself, ``timeout`` at most."""
        deadline = Deadline.after(timeout)
        while any(a.code is None for a in self._actors) and not deadline.expired:
            self._take(0.1)

    def stop(self) -> None:
        """Let the standbys see the job's end and exit (5 s), kill whatever is left, free the machines."""
        live = [a for a in self._actors if a.code is None]
        stops: list[ray.ObjectRef] = [a.handle.stop.remote(5.0) for a in live]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=10.0)
        for actor in live:
            ray.kill(actor.handle, no_restart=True)
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def failed_codes(self, pids: set[int]) -> dict[int, int]:
        return {a.pid: a.code for a in self._actors if a.pid in pids and a.code}

    def nodes(self) -> dict[str, str]:
        """Where each role runs: ``"trainer 0"`` -> Ray node id (live roles; a spare standby,
        bound to a rank or not, is ``"spare N"``)."""
        return {
            f"spare {a.spare}" if a.spare is not None else f"{a.role} {a.rank}": a.node
            for a in self._actors
            if a.code is None and a.node
        }

    def actor(self, role: Role | str, rank: int):
        """The live actor handle of a role (None if it has none)."""
        return next(
            (a.handle for a in reversed(self._actors) if a.role == role and a.rank == rank and a.code is None), None
        )
