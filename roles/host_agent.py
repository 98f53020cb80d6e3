"""``replica agent``: one per host of a many-host job. It starts that host's role
processes (the same script everywhere, as ``replica launch`` does on one machine),
reports each exit to the coordinator through the job store at once (a dead
process is found in tens of milliseconds instead of at its heartbeat deadline),
starts the replacements the coordinator orders and kills what it is told is
dead. Its children die with it (``PR_SET_PDEATHSIG``): losing the agent is
losing the host.

    replica agent --store ADDRESS --index N [--address A] [--roles standby:0,rollout:1] -- SCRIPT [ARGS...]
    replica agent --store ADDRESS --index N [--address A] --serve

With ``--serve`` it runs job after job: each ``replica coordinator ... SCRIPT`` that comes up at
``--store`` names its script and the roles' settings (a signed ``keys.served_job`` record) and
places every role on the agents; the agent starts what it is ordered, and once the job ended
waits for the next (``replica selftest --agents`` runs its matrix so).

The job's token (``REPLICA_TOKEN``), size (``REPLICA_WORLD_SIZE``) and anything
else the roles read come from the agent's environment; ``REPLICA_STORE`` and
``REPLICA_HOST`` (``--address``: the host's routable address, where its roles'
listeners bind) are set for them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from replica import envvars
from replica.errors import InterfaceNotFoundError, ReplicaError
from replica.jobstore import (
    AgentInfo,
    AgentOrder,
    Attempt,
    Flag,
    JobStore,
    Number,
    OrderKind,
    ProcessLooks,
    RoleExit,
    ServedJob,
    Stamp,
    keys,
)
from replica.jobstore.stores import StoreAddress, StoreKind
from replica.processes import start_server
from replica.roles import timing
from replica.roles.argparsing import (
    Parser,
    existing_file,
    non_negative_int,
    positive_float,
    shared_domain_option,
    start_options,
)
from replica.roles.env import (
    HOST,
    ROLES,
    Action,
    Fault,
    Role,
    base_environ,
    configure_logging,
    domain_name,
    host_name,
    parse_faults,
    shared_domains_allowed,
)
from replica.roles.exits import ExitCode
from replica.roles.local_agent import LocalAgent
from replica.roles.served import served_job_refusal
from replica.roles.stalls import StallLog
from replica.state.export import step_folder
from replica.timing import Deadline, pause

__all__ = ["HostAgent", "main", "parse_roles"]

logger = logging.getLogger(__name__)

AGENT_BEAT = timedelta(milliseconds=200)
_SERVE_POLL = timedelta(milliseconds=500)  # --serve: how often the next job is looked for
_CONNECT_SLICE = timedelta(seconds=5)  # --serve: a connection's wait for the store to come up
_TALKER_JOIN = timedelta(seconds=15)  # at close, for a talker's store call in progress to end


def parse_roles(spec: str) -> list[tuple[Role, int]]:
    """``trainer:0,standby:1`` -> [(trainer, 0), (standby, 1)]."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        role, _, rank = item.partition(":")
        if role not in ROLES or not rank.isdigit():
            raise ValueError(f"bad role {item!r}: expected ROLE:RANK with ROLE one of {ROLES}")
        out.append((Role(role), int(rank)))
    return out


class HostAgent:
    """The agent. Its main thread owns the processes (starts them: ``PR_SET_PDEATHSIG``
    is tied to the starting thread; reaps them; fires host faults); a talker thread
    owns the store (reports exits until they are written, fetches orders, beats,
    watches for the fault steps and the job's end). A talker stuck in a call (a link
    that was down can hold a TCP store call long after it is back) is replaced by a
    new one on a new connection after ``STALL``; nothing it held is lost (exits stay
    queued until written) and nothing is done twice (orders are taken in sequence).

    When the job goes back to its durable floor (``keys.attempt`` moved: a rank lost every copy
    of its state), the agent kills what it runs, and serves the next attempt under that
    attempt's prefix: it starts what the coordinator orders (every role of the job is placed
    anew), each role starting from the floor's version (``REPLICA_RESUME``)."""

    STALL = timedelta(seconds=3)

    def __init__(
        self,
        *,
        store: JobStore,
        index: int,
        address: str,
        local: LocalAgent,
        faults: tuple[Fault, ...] = (),
        domain: str = "",
        serving: bool = False,
    ):
        """``serving`` (``--serve``): an injected host kill ends this agent's part in the job (its
        roles killed, nothing more said) instead of the agent, which goes on to the next job."""
        self.store, self.index, self.local, self.address = store, index, local, address
        self.serving = serving
        self.lost = False  # a host kill fired while serving
        self.base = store  # at the job's own prefix, where the attempt in progress is named
        self.attempt = 0
        self.host = host_name()
        self._lock = threading.Lock()
        self._next: Attempt | None = None  # the attempt the talker found, for the main thread
        # An agent started again on its host (the host came back) takes only new orders: the
        # earlier ones were for its previous incarnation and its processes, gone with it.
        self._orders_seen = store.count(keys.agent_orders(index))
        self._orders: list[AgentOrder] = []  # fetched, for the main thread
        self._faults = [f for f in faults if f.role == HOST and f.rank == index]  # not fired yet
        self._firing: list[Fault] = []  # their step came: for the main thread
        self._exits: list[tuple[int, int]] = []  # seen, not yet written (kept through store failures)
        self._killing: set[int] = set()  # pids killed as ordered whose exit was not seen yet
        self._talked_at = time.monotonic()  # the talker's last round that got through
        #: This agent's own stalls (gaps between its polls: a process start in the loop, its process
        #: stopped or starved); the store's silence in them is not counted, as the coordinator's.
        self._stalls = StallLog(after=timing.COORDINATOR_STALL, keep=timing.STALL_MEMORY)
        self._talker = 0  # the current talker's number; older ones stop
        self._talkers: list[threading.Thread] = []  # joined at close(): none may be inside the store's C++ at exit
        self.ended = threading.Event()
        self._slowed: str | None = None  # the interface a slow fault limited
        self.domain = domain or domain_name()
        if (attempt := store.get(keys.attempt())) is not None:  # started (again) after a return to the floor
            self._adopt(attempt)
        self._registered = -1  # the attempt whose store holds this agent's AgentInfo
        self._register(self.store)

    def _register(self, store: JobStore) -> None:
        store.put(
            keys.agent(self.index),
            AgentInfo(index=self.index, host=self.host, address=self.address, pid=os.getpid(), domain=self.domain),
        )
        self._registered = self.attempt

    # --- the main thread ---

    def run(self) -> int:
        """Until the job's end (0), or the store unreachable for STORE_LOST (``ExitCode.COORDINATOR_LOST``)."""
        # The store's silence counts from the talker's start, not from this object's: starting the
        # --roles before (the fork server's first start imports torch) takes seconds on a loaded
        # machine, and was taken for the store's silence (exit COORDINATOR_LOST at once).
        self._talked_at = time.monotonic()
        self._start_talker()
        while not self.ended.is_set():
            now = time.monotonic()
            self._stalls.tick(now)
            exits = [(pid, code) for pid, code, _ in self.local.exits()]
            with self._lock:
                self._exits.extend(exits)
                self._killing -= {pid for pid, _ in exits}
                orders, self._orders = self._orders, []
                firing, self._firing = self._firing, []
            if self._next is not None:
                self._begin(self._next)
                continue
            for order in orders:
                self._obey(order)
            for fault in firing:
                self._fire(fault)
            silent = self._stalls.silence(self._talked_at, now)  # this agent's own stalls are no silence of the store
            if silent > timing.STORE_LOST.total_seconds():
                # Its roles find the store gone too: they export what they hold and stop by themselves.
                print(
                    f"replica: agent {self.index}: the job store does not answer ({silent:.0f} s); waiting for "
                    "the roles to export and stop",
                    flush=True,
                )
                self.local.wait(timing.EXPORT_WAIT)
                return ExitCode.COORDINATOR_LOST
            if silent > self.STALL.total_seconds() and time.monotonic() - self._started_at > self.STALL.total_seconds():
                logger.warning(
                    "[agent %d] the job store has not answered for %.1f s: asking again on a new connection",
                    self.index,
                    silent,
                )
                self._start_talker()
            pause(timing.SUPERVISE_POLL, self.ended)
        return ExitCode.OK

    def _begin(self, attempt: Attempt) -> None:
        """The job went back to its durable floor: stop this host's roles (the attempt before's),
        then serve ``attempt``: talk under its prefix and start what its coordinator orders."""
        print(
            f"replica: agent {self.index}: the job goes back to the durable floor's version of step "
            f"{attempt.step} (attempt {attempt.number}): stopping this host's roles",
            flush=True,
        )
        self._talker += 1  # the attempt before's talker stops
        self.local.kill_all(timing.EXPORT_WAIT)
        self._adopt(attempt)
        self._talked_at = time.monotonic()
        self._start_talker()

    def _adopt(self, attempt: Attempt) -> None:
        """Serve ``attempt`` from now on (nothing of the attempt before is reported or obeyed)."""
        faults = [f for f in parse_faults(self.local.env.get(envvars.INJECT, "")) if str(f) not in attempt.fired]
        self.local = self.local.again(
            {
                envvars.ATTEMPT: str(attempt.number),
                envvars.RESUME: str(step_folder(attempt.directory, attempt.step)),
                envvars.INJECT: ",".join(map(str, faults)),
            }
        )
        self.attempt, self.store = attempt.number, self.base.attempt(attempt.number)
        with self._lock:
            self._next = None
            self._exits, self._orders, self._killing, self._firing = [], [], set(), []
            self._faults = [f for f in self._faults if str(f) not in attempt.fired]
        self._orders_seen = 0  # a fresh prefix: its orders start at 1

    def _obey(self, order: AgentOrder) -> None:
        if order.kind == OrderKind.START and order.role in ROLES and order.spare >= 0:
            pid = self.local.start(Role.STANDBY, -1, spare=order.spare)
            logger.warning("[agent %d] started spare standby %d (pid %d) as ordered", self.index, order.spare, pid)
        elif order.kind == OrderKind.START and order.role in ROLES:
            pid = self.local.start(Role(order.role), order.rank)
            logger.warning("[agent %d] started %s %d (pid %d) as ordered", self.index, order.role, order.rank, pid)
        elif order.kind == OrderKind.KILL and order.pid in self.local.procs:
            if self.local.procs[order.pid][1].poll() is None:  # its exit is still to come
                with self._lock:
                    self._killing.add(order.pid)
            self.local.kill(order.pid)
            logger.warning("[agent %d] killed pid %d as ordered (it was declared dead)", self.index, order.pid)

    def _fire(self, fault: Fault) -> None:
        logger.warning("[agent %d] injected fault %s fires", self.index, fault)
        device = interface_of(self.address)
        if fault.action == Action.KILL:
            for handler in logging.getLogger().handlers:
                handler.flush()
            for pid in list(self.local.procs):
                self.local.kill(pid)
            if self.serving:  # the host lost for this job only: silent in it from now on, then the next job
                self._talker += 1  # nothing more is reported, as from a lost host
                self.lost = True
                self.ended.set()
                return
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == Action.PARTITION:
            assert fault.duration is not None  # Fault gives every partition its duration (10 s unless told)
            _ip("link", "set", "dev", device, "down")
            heal = threading.Timer(fault.duration.total_seconds(), _ip, ("link", "set", "dev", device, "up"))
            heal.daemon = True
            heal.start()
        elif fault.action == Action.SLOW:
            _tc(
                "qdisc",
                "replace",
                "dev",
                device,
                "root",
                "tbf",
                "rate",
                f"{fault.rate_mbit:g}mbit",
                "burst",
                "256kb",
                "latency",
                "100ms",
            )
            self._slowed = device
            logger.warning(
                "[agent %d] the link of %s (%s) is limited to %g Mbit/s",
                self.index,
                self.address,
                device,
                fault.rate_mbit,
            )

    def close(self) -> None:
        """Stop talking; undo what faults left (a slowed link). The talkers are joined (a
        store connect in progress ends within its timeout): a thread still inside c10d's
        TCPStore constructor when the interpreter exits aborts the process."""
        self._talker += 1
        deadline = Deadline.after(_TALKER_JOIN)
        for thread in self._talkers:
            thread.join(timeout=deadline.remaining_s())
        if any(t.is_alive() for t in self._talkers):
            logger.warning("[agent %d] a talker is still in a store call after %s", self.index, _TALKER_JOIN)
        if self._slowed is not None:
            _tc("qdisc", "del", "dev", self._slowed, "root")
            self._slowed = None

    # --- the talker ---

    def _start_talker(self) -> None:
        self._talker += 1
        self._started_at = time.monotonic()
        thread = threading.Thread(
            target=self._talk, args=(self._talker,), name=f"replica-agent-talker-{self._talker}", daemon=True
        )
        thread.start()
        self._talkers = [t for t in self._talkers if t.is_alive()] + [thread]

    def _talk(self, number: int) -> None:
        base: JobStore | None = None  # the job's own prefix: the attempt in progress
        store: JobStore | None = None  # this agent's attempt's
        beat, beat_at = 0, 0.0
        while self._talker == number and not self.ended.is_set():
            try:
                if base is None or store is None:  # (set together)
                    base = self.base.reconnect(timing.HEARTBEAT_IO)
                    store = base.attempt(self.attempt)
                if self._registered != self.attempt:
                    self._register(store)
                with self._lock:
                    pending = list(self._exits)
                for pid, code in pending:
                    n = store.count(keys.agent_exits(self.index), 1)
                    store.put(
                        keys.agent_exit(self.index, n),
                        RoleExit(host=self.host, pid=pid, code=code, spare=self.local.spares.get(pid, -1)),
                    )
                    with self._lock:
                        if (pid, code) in self._exits:
                            self._exits.remove((pid, code))
                    logger.warning("[agent %d] pid %d exited with %d: reported", self.index, pid, code)
                while (order := store.get(keys.agent_order(self.index, self._orders_seen + 1))) is not None:
                    with self._lock:
                        if self._talker != number:
                            return  # replaced meanwhile: the new talker takes the orders from here
                        self._orders_seen += 1
                        self._orders.append(order)
                for fault in list(self._faults):
                    if store.has(keys.loss(0, fault.step)):
                        fired = store.has(keys.killed(str(fault)))  # by this host's agent before this one
                        if not fired:
                            store.put(keys.killed(str(fault)), Stamp(at=time.time()))
                        with self._lock:
                            self._faults.remove(fault)
                            if not fired:
                                self._firing.append(fault)
                if time.monotonic() - beat_at >= AGENT_BEAT.total_seconds():
                    # Its verdicts first: a fresh beat vouches for looks at least as fresh.
                    looks = self.local.looks()
                    store.put(
                        keys.agent_looks(self.index),
                        ProcessLooks(
                            pids=tuple(pid for pid, _, _ in looks),
                            verdicts=tuple(str(v) for _, v, _ in looks),
                            whys=tuple(why for _, _, why in looks),
                        ),
                    )
                    beat += 1
                    store.put(keys.agent_beat(self.index), Number(value=beat))
                    beat_at = time.monotonic()
                ended = store.has(keys.finished())
                # The coordinator names the next attempt before it ends this one: seen ended, seen moved.
                if (attempt := base.get(keys.attempt())) is not None and attempt.number > self.attempt:
                    with self._lock:
                        self._next = attempt
                    return  # the main thread stops this attempt's roles and starts a talker for the next
                if ended:
                    # The end: once what the coordinator ordered is done and every exit it caused is
                    # reported (a zombie of a partition, killed once back), the coordinator may stop.
                    with self._lock:
                        settled = not self._orders and not self._exits and not self._killing
                    if settled:
                        store.put(keys.agent_ended(self.index), Flag())
                        self.ended.set()
                self._talked_at = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the next round asks again, on a new connection
                logger.info("[agent %d] the job store: %s", self.index, exc)
                store = None
            pause(timing.SUPERVISE_POLL, self.ended)


def interface_of(address: str) -> str:
    """The network interface that holds ``address`` on this host."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == address:
            return fields[1]
    raise InterfaceNotFoundError(f"no interface of this host holds {address}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, timeout=30)


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="replica agent", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="the job store: HOST:PORT or etcd://HOST:PORT,.../JOB")
    p.add_argument("--index", type=non_negative_int, required=True, help="this host's agent number, 0 .. --agents - 1")
    p.add_argument("--address", default="127.0.0.1", help="this host's routable address (REPLICA_HOST of its roles)")
    p.add_argument("--roles", default="", help="roles to start at once, e.g. trainer:0 or standby:1,rollout:1")
    p.add_argument(
        "--domain",
        default="",
        help=f"this host's failure domain (a rack, a switch, a zone: what fails together; {envvars.DOMAIN} "
        "of its roles); replacement standbys never go to a trainer's domain (default: the host)",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="serve job after job: each `replica coordinator ... SCRIPT` at --store names its script and "
        "settings and places every role (no SCRIPT and no --roles here); `replica selftest --agents` "
        "runs its matrix so",
    )
    p.add_argument(
        "--idle-timeout",
        type=positive_float,
        default=3600.0,
        metavar="SECONDS",
        help="with --serve: stop when no new job comes for this long (default: an hour)",
    )
    start_options(p)
    shared_domain_option(p)
    p.add_argument("script", type=existing_file, nargs="?", help="the job's script (the same on every host)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not os.environ.get(envvars.TOKEN):
        parser.error(f"set {envvars.TOKEN} to the job's secret token")
    if args.serve and (args.script or args.roles):
        parser.error(
            "--serve takes no SCRIPT and no --roles: each job's coordinator names its script and places its roles"
        )
    if not args.serve and not args.script:
        parser.error("the job's SCRIPT is required (or --serve, to run the jobs coordinators name)")
    try:
        address = StoreAddress.parse(args.store)
        roles = parse_roles(args.roles)
    except ValueError as exc:
        parser.error(str(exc))
    domain = args.domain or domain_name()
    both = sorted(
        {rank for role, rank in roles if role == Role.TRAINER} & {rank for role, rank in roles if role == Role.STANDBY}
    )
    if both and not shared_domains_allowed(args.allow_shared_domain):
        parser.error(
            f"--roles: the trainer and the standby of rank {both[0]} on one host (failure domain "
            f"{domain!r}): losing it would lose both copies of the rank; start the "
            "standby on another host, or pass --allow-shared-domain"
        )
    if args.index < 0:
        parser.error(f"--index must be >= 0, got {args.index}")
    if not args.exec_roles:
        start_server()  # a fork of this process, before the store's threads: the roles start from its imports
    configure_logging()
    token = os.environ[envvars.TOKEN].encode()
    # The rest of the job's variables (job_environ's) come from the agent's own environment.
    env = {**base_environ(), envvars.STORE: str(address), envvars.HOST: args.address}
    if args.domain:
        env[envvars.DOMAIN] = args.domain
    if args.serve:
        return _serve(args, address, token=token, env=env, domain=domain)
    # The coordinator may come up after the agents (ROLE_WAIT); the talker's connections fail fast.
    store = JobStore(address.connect(timeout=timing.ROLE_WAIT), token=token)
    local = LocalAgent(script=[args.script, *args.script_args], env=env, replacements=0, exec_roles=args.exec_roles)
    return _run(args, store, local, domain=domain, roles=roles)


def _run(
    args: argparse.Namespace, store: JobStore, local: LocalAgent, *, domain: str, roles: list[tuple[Role, int]]
) -> int:
    """One job: this host's part of it, until its end."""
    agent = HostAgent(
        store=store,
        index=args.index,
        address=args.address,
        local=local,
        faults=parse_faults(local.env.get(envvars.INJECT, "")),
        domain=domain,
        serving=args.serve,
    )
    print(f"replica: agent {args.index} on {agent.host} ({args.address}) for the job at {args.store}", flush=True)
    if agent.attempt == 0:  # in a later attempt the coordinator orders every role
        for role, rank in roles:
            local.start(role, rank)
    try:
        status = agent.run()
    finally:
        agent.close()
        agent.local.stop()
    said = "the job ended" if status == ExitCode.OK else "stopped"
    if agent.lost:
        said = "its host lost in the job (an injected fault): the roles it ran are killed; it serves the next job"
    print(f"replica: agent {args.index}: {said}", flush=True)
    return status


def _serve(args: argparse.Namespace, address: StoreAddress, *, token: bytes, env: dict[str, str], domain: str) -> int:
    """``--serve``: the jobs named at ``address`` (``keys.served_job``), one after the other, until
    none comes for ``--idle-timeout``."""
    print(f"replica: agent {args.index} on {host_name()} ({args.address}) serves the jobs at {address}", flush=True)
    served = ""  # the id of the job served last
    idle = timedelta(seconds=args.idle_timeout)
    while (found := _next_job(address, token=token, served=served, within=idle, index=args.index)) is not None:
        store, job = found
        served = job.id
        if why := served_job_refusal(job):
            print(f"replica: agent {args.index}: refuses the job {job.id}: {why}", flush=True)
            continue
        print(f"replica: agent {args.index} serves the job {job.id} ({Path(job.script).name})", flush=True)
        local = LocalAgent(
            script=[job.script, *job.args], env={**env, **job.environ}, replacements=0, exec_roles=args.exec_roles
        )
        _run(args, store, local, domain=domain, roles=[])
        del found, store  # the job's connection (its last references): closed before its store goes away
        if address.kind == StoreKind.TCP:  # its coordinator keeps the store up until every role left
            _gone(address, within=2 * timing.STORE_LOST)
    print(f"replica: agent {args.index}: no new job for {args.idle_timeout:g} s; it stops", flush=True)
    return ExitCode.OK


def _next_job(
    address: StoreAddress, *, token: bytes, served: str, within: timedelta, index: int
) -> tuple[JobStore, ServedJob] | None:
    """The job store at ``address`` and the job it names, once that is not ``served`` (nor ended);
    None when none comes ``within``. The store comes and goes with each job's coordinator: one
    connection is kept while it answers, and a hosted store is connected to only once its port
    accepts (c10d's own retries would fill the log between jobs)."""
    deadline = Deadline.after(within)
    store: JobStore | None = None
    said = ""
    while not deadline.expired:
        try:
            if store is None and (address.kind == StoreKind.ETCD or _accepts(address.host, address.port)):
                store = JobStore(address.connect(timeout=min(_CONNECT_SLICE, deadline.remaining())), token=token)
            if store is not None:
                job = store.get(keys.served_job())  # None too when it is not signed with this job's token
                if job is not None and job.id != served and not store.has(keys.finished()):
                    return store, job
        except (ReplicaError, RuntimeError, OSError) as exc:  # the store went away, or is not up yet
            store = None
            if isinstance(exc, ReplicaError) and str(exc) != said:
                said = str(exc)
                print(f"replica: agent {index}: the job store at {address}: {exc}", flush=True)
        pause(_SERVE_POLL, deadline=deadline)
    return None


def _gone(address: StoreAddress, *, within: timedelta) -> None:
    """Until the hosted store at ``address`` no longer accepts connections (its job's coordinator
    ended), ``within`` at most."""
    deadline = Deadline.after(within)
    while not deadline.expired and _accepts(address.host, address.port):
        pause(_SERVE_POLL, deadline=deadline)


def _accepts(host: str, number: int) -> bool:
    """Whether a TCP connection to ``host``:``number`` opens now."""
    try:
        with socket.create_connection((host, number), timeout=_SERVE_POLL.total_seconds()):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
