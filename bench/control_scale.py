"""The control plane at scale, by simulation (``make bench-scale``): the real job store
(the coordinator's ``TCPStore``, or a real 3-member etcd), the real ``CommitRecord`` and
``EpochRecord``, driven by N simulated ranks (a trainer and a standby each) that do per
step what a rank does to the store and train nothing:

* each standby reads its trainer's epoch (``current_epoch``: the fence of each version)
  and acknowledges the step (``CommitRecord.acknowledge``: its ack, the ack counters,
  and for the last one the O(N) read that raises the commit);
* each trainer reads the generation twice (its loop: is a failover announced? its
  stream: is its step superseded?) and the commit (``CommitRecord.wait`` at its next
  commit, which finds the step committed when the stream is shorter than the step);
* the generation reads go through ``EpochRecord`` with the hint a role has from its
  heartbeat's answers (``replica.jobstore.commit.hint_generation``): each worker beats natively to
  the coordinator's liveness endpoint (a ``LivenessServer`` in the main process) and its
  roles' reads ask the store only when the answered generation number moved;
* observers (``READ_THREADS`` per worker, on connections not counted) wait for the
  commit as a trainer whose step is shorter than its stream does (``CommitRecord.wait``
  from the moment the acks start): the commit latency is when they see it;
* heartbeats, both ways, for a few seconds each: every role's signed heartbeat key written
  to the store each ``HEARTBEAT_PERIOD`` and the coordinator reading them all each
  ``SUPERVISE_POLL`` (the scheme before the liveness endpoint); then every role's native
  beat (``replica._C.NativeHeartbeatSender``, one thread each) sent to the liveness endpoint, which
  verifies and answers each, and the coordinator reading its table.

Two worker processes multiplex the simulated roles (the acks from 4 threads each, the
trainers' reads from 8, each request one role's own: the store sees the keys and bytes N
real roles would send). Reported per store kind and N: the commit latency (the
start of the step's last acknowledgement to the commit visible to every trainer), store
requests, keys and bytes per step, the per-step store time of the one full check, the
heartbeat writes per second asked and done and the coordinator's heartbeat scan, and the
fitted exponent of the per-step work's growth with N.

Then the real coordinator (``roles.coordinator.Coordinator``, hosting the TCPStore as
``replica launch`` does): 2N members join through the real join path (the join time of the
whole job), beat each ``HEARTBEAT_PERIOD`` from the workers (native beats to its liveness
endpoint; ``--beats store``: signed writes to the store) while the coordinator polls each
``SUPERVISE_POLL`` (its CPU per second, its poll's time, false deaths), then a trainer is
killed (its beats stop and its standby reports the connection lost: the transport's sign),
another frozen (its beats stop, nothing else) and a host's worth of 8 members falls silent
together: the time to each decision. Writes bench/results/control_scale.{json,md,png}.

    python bench/control_scale.py [--n 64,256,1024] [--stores tcp,etcd] [--steps 20] [--beats endpoint|store]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from replica.jobstore import Generation, Heartbeat, JobStore, keys
from replica.jobstore.commit import CommitRecord, EpochRecord, hint_generation, publish_generation
from replica.jobstore.stores import StoreAddress
from replica.roles import timing
from replica.roles.recovery import aim_beats
from replica.roles.timing import Deadlines
from replica.timing import Deadline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers (support)
from control_scale_report import merged, report

from support.children import spawn
from support.stores import CountingStore

TOKEN = b"control-scale-token"
T = timedelta(seconds=120)
WORKERS = 2
ACK_THREADS = 4
READ_THREADS = 8
HEARTBEAT_SECONDS = 3.0
PROBE = 1 << 40  # the member number of a worker's own beat (the hint of its roles' generation reads)
RESULTS = Path(__file__).resolve().parent / "results"


def _connect(address: str, etcd_env: dict[str, str]) -> dist.Store:
    import os

    os.environ.update(etcd_env)
    return StoreAddress.parse(address).connect(timeout=T)


def _split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


def _raise_open_files() -> None:
    """A native beat holds two descriptors: 1,024 beats in one process pass a soft limit of 1,024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _native_beats(store: JobStore, members: list[int], endpoint: tuple[str, int]) -> list:
    return [
        store.heartbeat_sender(
            m,
            period=timing.HEARTBEAT_PERIOD,
            io_timeout=timing.HEARTBEAT_IO,
            python_grace=timing.PYTHON_GRACE,
            store_after=timing.LIVENESS_STORE_AFTER,
            store_period=timing.LIVENESS_STORE_PERIOD,
            liveness=endpoint,
        )
        for m in members
    ]


def _worker(pipe, address: str, etcd_env: dict[str, str], n: int, index: int, endpoint: tuple[str, int]) -> None:
    """Simulates ranks index, index + WORKERS, ...: their standbys and trainers."""
    _raise_open_files()
    client = CountingStore(_connect(address, etcd_env))
    store = JobStore(client, token=TOKEN)
    # The roles' generation reads go by what a beat's answers say (each role has its own beat;
    # here one beat of the worker's stands for them: the answers carry the same number).
    beating = JobStore(_connect(address, etcd_env), token=TOKEN)  # the beats' sinks (unused while answered)
    (probe,) = _native_beats(beating, [PROBE + index], endpoint)
    fresh = timing.LIVENESS_FRESH.total_seconds()
    hint_generation(store, lambda: probe.generation if probe.reply_age <= fresh and probe.generation >= 0 else None)

    def alive() -> None:  # a role's watch tells its beat the interpreter lives
        while True:
            probe.touch()
            time.sleep(timing.HEARTBEAT_PERIOD.total_seconds())

    threading.Thread(target=alive, daemon=True).start()
    watching = CommitRecord(JobStore(_connect(address, etcd_env), token=TOKEN), world_size=n)  # not counted
    ranks = list(range(index, n, WORKERS))
    records = {r: CommitRecord(store, world_size=n) for r in ranks}  # each role: its own record, as in its process
    epochs = {r: EpochRecord(store) for r in ranks}
    holders = {r: records[r].registration(r).nonce for r in ranks}
    # Threads that live as long as the worker, as a role's do: each keeps its store connections
    # (threads made anew each step opened ~40 connections a step, and a connect stalled 5 s).
    observing, acking, training = (ThreadPoolExecutor(k) for k in (READ_THREADS, ACK_THREADS, READ_THREADS))
    pipe.send(("ready",))
    while True:
        command = pipe.recv()
        if command[0] == "exit":
            return
        if command[0] == "beats":
            _beat(pipe, store, client, n, index, command[1])
            continue
        if command[0] == "native beats":
            _beat_native(pipe, beating, n, index, command[1], endpoint)
            continue
        step = command[1]
        client.reset()
        acked: list[float] = []
        seen: list[float] = []
        lock = threading.Lock()

        def observe() -> None:
            watching.wait(step, T)
            with lock:
                seen.append(time.time())

        spent: list[float] = []  # each trainer's time in the control plane this step

        def trainers(mine: list[int]) -> None:
            for r in mine:
                t = time.perf_counter()
                epochs[r].generation()  # the loop: a failover announced?
                records[r].current_epoch(r)  # the stream: its step superseded?
                assert records[r].wait(step, T) >= step  # at its next commit
                with lock:
                    spent.append(time.perf_counter() - t)

        def standbys(mine: list[int]) -> None:
            for r in mine:
                epoch = records[r].current_epoch(r)  # the fence of the version (the epoch BEGIN carried)
                started = time.time()
                records[r].acknowledge(r, step, epoch, holders[r])
                with lock:
                    acked.append(started)

        order = ranks[:]
        random.Random(step * 1000 + index).shuffle(order)
        running = [observing.submit(observe) for _ in range(READ_THREADS)]
        running += [acking.submit(standbys, part) for part in _split(order, ACK_THREADS)]
        for f in running:
            f.result()
        for f in [training.submit(trainers, part) for part in _split(ranks, READ_THREADS)]:
            f.result()
        pipe.send(
            (
                "step",
                max(acked),
                max(seen),
                client.total,
                client.keys,
                client.bytes,
                dict(client.requests),
                max((k for m, k in client.calls if m == "multi_get"), default=0),
                statistics.median(spent),
            )
        )


def _beat(pipe, store: JobStore, client: CountingStore, n: int, index: int, seconds: float) -> None:
    """This worker's share of 2N roles' heartbeats at HEARTBEAT_PERIOD, for ``seconds``."""
    members = list(range(index, 2 * n, WORKERS))
    period = timing.HEARTBEAT_PERIOD.total_seconds()
    client.reset()
    start = time.monotonic()
    beat = 0
    written = 0
    while time.monotonic() - start < seconds:
        round_start = time.monotonic()
        beat += 1
        for m in members:
            store.put(keys.heartbeat(m), Heartbeat(member=m, beat=beat))
            written += 1
        left = period - (time.monotonic() - round_start)
        if left > 0:
            time.sleep(left)
    elapsed = time.monotonic() - start
    pipe.send(("beats", written / elapsed, len(members) / period, client.bytes / elapsed))


def _beat_native(pipe, store: JobStore, n: int, index: int, seconds: float, endpoint: tuple[str, int]) -> None:
    """This worker's share of 2N roles' native beats to the liveness endpoint, for ``seconds``."""
    members = list(range(index, 2 * n, WORKERS))
    beats = _native_beats(store, members, endpoint)
    time.sleep(seconds)
    sent = sum(b.beats for b in beats)
    answered = sum(b.replies for b in beats)
    for b in beats:
        b.stop()
    pipe.send(
        ("native beats", sent / seconds, answered / seconds, len(members) / timing.HEARTBEAT_PERIOD.total_seconds())
    )


def _listen_to_beats(server, n: int, seconds: float) -> dict:
    """The coordinator's side of native beats: its endpoint's table read each SUPERVISE_POLL;
    the endpoint's datagrams and this process's CPU (the endpoint's thread) per second."""
    ids = list(range(2 * n))
    poll = timing.SUPERVISE_POLL.total_seconds()
    took = []
    received = server.received
    start = time.monotonic()
    cpu = time.process_time()
    while time.monotonic() - start < seconds:
        t = time.perf_counter()
        ages = server.ages(ids)
        server.beats(ids)
        took.append(time.perf_counter() - t)
        time.sleep(max(0.0, poll - took[-1]))
    elapsed = time.monotonic() - start
    return {
        "endpoint_datagrams_per_s": (server.received - received) / elapsed,
        "endpoint_rejected": server.rejected,
        "endpoint_cpu_per_s": (time.process_time() - cpu) / elapsed,
        "endpoint_scan_ms_median": statistics.median(took) * 1e3,
        "endpoint_heard": sum(1 for a in ages if 0 <= a < 1.0),
    }


def _scan_heartbeats(store: JobStore, n: int, seconds: float) -> dict:
    """The coordinator's side: every role's heartbeat read each SUPERVISE_POLL."""
    names = [keys.heartbeat(m) for m in range(2 * n)]
    poll = timing.SUPERVISE_POLL.total_seconds()
    took = []
    start = time.monotonic()
    cpu = time.process_time()
    while time.monotonic() - start < seconds:
        t = time.perf_counter()
        store.get_many(names)
        took.append(time.perf_counter() - t)
        left = poll - took[-1]
        if left > 0:
            time.sleep(left)
    return {
        "scan_ms_median": statistics.median(took) * 1e3,
        "scans_per_s": len(took) / (time.monotonic() - start),
        "scan_cpu_per_s": (time.process_time() - cpu) / (time.monotonic() - start),
    }


def run(kind: str, n: int, steps: int, address: str, etcd_env: dict[str, str], store: JobStore) -> dict:
    setup = time.perf_counter()
    publish_generation(store, Generation(number=0, trainers=tuple(range(1, n + 1))))
    record = CommitRecord(store, world_size=n)
    for r in range(n):
        record.publish_standby(r, "shm", f"127.0.0.1:{20000 + r}")
    setup_s = time.perf_counter() - setup
    server = store.liveness_server("127.0.0.1")  # the coordinator's liveness endpoint
    server.set_generation(0)
    endpoint = ("127.0.0.1", server.port)
    with (
        spawn(_worker, address, etcd_env, n, 0, endpoint, name="sim-0") as w0,
        spawn(_worker, address, etcd_env, n, 1, endpoint, name="sim-1") as w1,
    ):
        workers = [w0, w1]
        for w in workers:
            assert w.recv(300) == ("ready",)
        rows = []
        for step in range(1, steps + 1):
            for w in workers:
                w.send("step", step)
            got = [w.recv(600) for w in workers]
            last_ack = max(g[1] for g in got)
            visible = max(g[2] for g in got)
            requests: dict[str, int] = {}
            for g in got:
                for method, count in g[6].items():
                    requests[method] = requests.get(method, 0) + count
            rows.append(
                {
                    "step": step,
                    "commit_ms": (visible - last_ack) * 1e3,
                    "requests": sum(g[3] for g in got),
                    "keys": sum(g[4] for g in got),
                    "bytes": sum(g[5] for g in got),
                    "by_method": requests,
                    "largest_read_keys": max(g[7] for g in got),
                    "trainer_ms": statistics.median(g[8] for g in got) * 1e3,
                }
            )
            assert record.last() == step
        for w in workers:
            w.send("beats", HEARTBEAT_SECONDS)
        scan = _scan_heartbeats(store, n, HEARTBEAT_SECONDS)
        beats = [w.recv(600) for w in workers]
        names = [keys.heartbeat(m) for m in range(2 * n)]
        in_store = store.get_many(names)
        for w in workers:
            w.send("native beats", HEARTBEAT_SECONDS)
        listened = _listen_to_beats(server, n, HEARTBEAT_SECONDS)
        native = [w.recv(600) for w in workers]
        # Answered beats leave the store alone: the heartbeat keys the store phase wrote, unchanged.
        listened["native_store_writes"] = sum(a != b for a, b in zip(in_store, store.get_many(names), strict=False))
        for w in workers:
            w.send("exit")
    server.stop()
    steady = rows[2:] if len(rows) > 4 else rows  # the first steps make the counters and connections
    latency = sorted(r["commit_ms"] for r in steady)
    return {
        "store": kind,
        "n": n,
        "roles": 2 * n,
        "steps": steps,
        "setup_s": setup_s,
        "commit_ms_median": statistics.median(latency),
        "commit_ms_p99": latency[min(len(latency) - 1, math.ceil(0.99 * len(latency)) - 1)],
        # A trainer's own control-plane time per step (its generation checks and its read of the
        # commit, median over trainers and steps), and with it the overhead on a 1 s step: that
        # time plus any part of the commit's latency longer than a step (a commit not visible by
        # the next commit makes the trainer wait there).
        "trainer_ms_median": statistics.median(r["trainer_ms"] for r in steady),
        "overhead_1s_pct": (
            statistics.median(r["trainer_ms"] for r in steady) + max(0.0, statistics.median(latency) - 1000.0)
        )
        / 10.0,
        "requests_per_step": statistics.median(r["requests"] for r in steady),
        "requests_each_step": [r["requests"] for r in rows],
        "requests_per_rank_step": statistics.median(r["requests"] for r in steady) / n,
        "keys_per_step": statistics.median(r["keys"] for r in steady),
        "bytes_per_step": statistics.median(r["bytes"] for r in steady),
        "largest_read_keys": max(r["largest_read_keys"] for r in steady),
        "by_method": steady[-1]["by_method"],
        "heartbeat_writes_per_s": sum(b[1] for b in beats),
        "heartbeat_writes_asked_per_s": sum(b[2] for b in beats),
        "heartbeat_bytes_per_s": sum(b[3] for b in beats),
        **scan,
        "native_beats_per_s": sum(b[1] for b in native),
        "native_answers_per_s": sum(b[2] for b in native),
        "native_asked_per_s": sum(b[3] for b in native),
        **listened,
    }


def _member_beats(
    pipe,
    address: str,
    environ: dict[str, str],
    n: int,
    index: int,
    members: list[int],
    seconds: float,
    endpoint: tuple[str, int] | None,
) -> None:
    """Beat for ``members`` at HEARTBEAT_PERIOD until told to stop some, then the rest: native
    beats to the coordinator's liveness endpoint, or (``endpoint`` None) signed store writes."""
    _raise_open_files()
    store = JobStore(_connect(address, environ), token=TOKEN)
    if endpoint is not None:
        beats = dict(zip(members, _native_beats(store, members, endpoint), strict=False))
        pipe.send(("ready",))
        end = Deadline.after(timedelta(seconds=seconds))
        aimed, aimed_at, reaim = f"{endpoint[0]}:{endpoint[1]}", time.monotonic(), timing.LIVENESS_REAIM.total_seconds()
        while not end.expired:
            for b in beats.values():
                b.touch()  # a role's watch: the interpreter lives
            # and, while no answer comes, it points its beat at the endpoint the coordinator published
            # (one read here for the simulated roles, each role's own in a job: a coordinator that moved)
            if time.monotonic() - aimed_at > reaim and any(b.reply_age > reaim for b in beats.values()):
                aimed_at = time.monotonic()
                aimed = aim_beats(list(beats.values()), store, aimed, f"beater {index}")
            while pipe.poll():
                command = pipe.recv()
                if command[0] == "silence":
                    for m in command[1]:
                        if m in beats:
                            beats.pop(m).stop()
                    pipe.send(("silenced", time.monotonic()))
                elif command[0] == "exit":
                    for b in beats.values():
                        b.stop()
                    return
            time.sleep(timing.HEARTBEAT_PERIOD.total_seconds())
        pipe.send(("late",))
        return
    period = timing.HEARTBEAT_PERIOD.total_seconds()
    silent: set[int] = set()
    beat = 0
    pipe.send(("ready",))
    end = Deadline.after(timedelta(seconds=seconds))
    while not end.expired:
        round_start = time.monotonic()
        while pipe.poll():
            command = pipe.recv()
            if command[0] == "silence":
                silent.update(command[1])
                pipe.send(("silenced", time.monotonic()))
            elif command[0] == "exit":
                return
        beat += 1
        for m in members:
            if m not in silent:
                store.put(keys.heartbeat(m), Heartbeat(member=m, beat=beat))
        left = period - (time.monotonic() - round_start)
        if left > 0:
            time.sleep(left)
    pipe.send(("late",))


def _why(decision) -> str:
    """A death the coordinator decided, for the report: who, and its reason."""
    return f"{decision.dead.role} {decision.dead.rank}: {decision.reason}"


def run_coordinator(
    n: int, seconds: float = 8.0, beats: str = "endpoint", etcd: tuple[str, dict[str, str]] | None = None
) -> dict:
    """The real coordinator with 2N members (N >= 12): joins, polls under beats (``endpoint``:
    native beats to its liveness endpoint; ``store``: signed store writes), a kill, a freeze
    and a lost host. ``etcd``: the job's state in etcd (its address, a fresh namespace, and the
    environment with its credentials) instead of the coordinator's TCPStore."""
    if n < 12:
        raise ValueError(f"the coordinator run needs N >= 12 (its faults hit ranks 2 .. 11), got {n}")
    from replica.roles.coordinator import Coordinator
    from replica.roles.join import JoinRequest, post_request
    from replica.roles.probe import Verdict

    deadlines = Deadlines()
    if etcd is not None:
        import os

        os.environ.update(etcd[1])
        coord = Coordinator(
            world_size=n,
            token=TOKEN,
            deadlines=deadlines,
            liveness=beats == "endpoint",
            store=StoreAddress.parse(etcd[0]),
        )
        address, environ = etcd
    else:
        coord = Coordinator(world_size=n, token=TOKEN, deadlines=deadlines, liveness=beats == "endpoint")
        address, environ = f"127.0.0.1:{coord.port}", {}
    store = JobStore(_connect(address, environ), token=TOKEN)
    # The agents' view of the processes, simulated as the members are (no agent runs here): what
    # a host agent would say of each fault's members once it is set; of every other member,
    # nothing (UNKNOWN: the deadline alone decides, so a false death still counts as one).
    views: dict[int, tuple[Verdict, str]] = {}
    coord.probe = lambda member: views.get(member.id, (Verdict.UNKNOWN, ""))
    endpoint = None if coord.liveness is None else ("127.0.0.1", coord.liveness.port)
    # The members' join numbers come first, so that they beat from the moment they are admitted.
    first = store.count(keys.join_seq()) + 1
    order = [(role, rank) for role in ("standby", "trainer") for rank in range(n)]  # standbys are up first
    members = {who: first + i for i, who in enumerate(order)}
    ids = sorted(members.values())
    total = seconds + 180 + 4 * deadlines.trainer.total_seconds()  # the joins included (2,048 on etcd: ~1 min)
    with (
        spawn(_member_beats, address, environ, n, 0, ids[0::2], total, endpoint, name="beats-0") as b0,
        spawn(_member_beats, address, environ, n, 1, ids[1::2], total, endpoint, name="beats-1") as b1,
    ):
        beaters = [b0, b1]
        for b in beaters:
            assert b.recv(300) == ("ready",)
        start = time.perf_counter()
        for i, (role, rank) in enumerate(order):
            seq = post_request(
                store,
                JoinRequest(role=role, rank=rank, host=f"h{rank % 64}", pid=100000 + i, nonce=f"{role}{rank}"),
                TOKEN,
            )
            assert seq == members[(role, rank)], "another join got in between"
        while len(coord.alive()) < 2 * n:
            coord.poll()
        join_s = time.perf_counter() - start
        # Every rank's standby holds step 1, globally committed: a death has a commit to fail over to.
        record = CommitRecord(store, world_size=n)
        for r in range(n):
            registration = record.publish_standby(r, "shm", f"127.0.0.1:{20000 + r}")
            record.acknowledge(r, 1, record.current_epoch(r), registration.nonce)
        assert record.last() == 1
        poll_s, decisions = [], []
        cpu, wall = time.process_time(), time.monotonic()

        def loop(until: Deadline, coordinator=coord, decided=decisions, polls=poll_s) -> None:
            while not until.expired:
                t = time.perf_counter()
                decided.extend((time.monotonic(), d) for d in coordinator.poll())
                polls.append(time.perf_counter() - t)
                time.sleep(max(0.0, timing.SUPERVISE_POLL.total_seconds() - polls[-1]))

        loop(Deadline.after(timedelta(seconds=seconds)))  # beats and polls, nobody dies
        steady_cpu = (time.process_time() - cpu) / (time.monotonic() - wall)
        false_deaths = len(decisions)
        steady_poll = sorted(poll_s)
        # A kill (beats stop, the standby reports its connection gone), a freeze (beats stop),
        # a lost host (its members' beats stop together: here every member of host h1).
        # A rollout machine lost: the standbys of 8 ranks other than the killed and frozen ones.
        killed, frozen = members[("trainer", 2)], members[("trainer", 3)]
        host = [members[("standby", r)] for r in range(4, min(n, 12))]
        faults = {"kill": [killed], "freeze": [frozen], "lost host": host}
        views.update(
            {
                killed: (Verdict.GONE, "its process is gone (simulated)"),
                frozen: (Verdict.DEAD, "its process is stopped (simulated)"),
            }
        )
        views.update({m: (Verdict.GONE, "its host's agent is silent too (simulated)") for m in host})
        at = time.monotonic()
        for b in beaters:
            b.send("silence", [m for group in faults.values() for m in group])
        record.report_lost(2)
        loop(Deadline.after(2 * deadlines.trainer + timedelta(seconds=1)))
        # The faults took effect when the beaters stopped the beats (a loaded beater takes a
        # while to act on the order): detection runs from then.
        silenced = [b.recv(60) for b in beaters]
        assert all(m[0] == "silenced" for m in silenced), silenced
        applied = max(m[1] for m in silenced)
        takeover = None
        if etcd is not None:  # the coordinator dies; one elected after it takes over from the job's state in etcd
            coord.close()
            t = time.perf_counter()
            successor = Coordinator(
                world_size=n,
                token=TOKEN,
                deadlines=deadlines,
                liveness=beats == "endpoint",
                store=StoreAddress.parse(etcd[0]),
            )
            took = time.perf_counter() - t
            successor.probe = coord.probe
            after, polls_after = [], []
            # Its members' deadlines run from the takeover; the roles find its endpoint within LIVENESS_REAIM.
            loop(Deadline.after(2 * deadlines.trainer + timedelta(seconds=1)), successor, after, polls_after)
            successor.close()
            takeover = {
                "takeover_s": took,
                "members": len(successor.members),
                "alive": len(successor.alive()),
                "false_deaths": len(after),
                "reasons": [_why(d) for _, d in after if d.dead is not None][:8],
                "poll_ms_median": statistics.median(polls_after) * 1e3,
            }
        for b in beaters:
            b.send("exit")
    found = {}
    for what, group in faults.items():
        times = [t for t, d in decisions if d.dead is not None and d.dead.id in group]
        found[what] = (min(times) - applied) * 1e3 if times else None
    others = [d for _, d in decisions if d.dead is not None and all(d.dead.id not in g for g in faults.values())]
    failed = [d.reason for _, d in decisions if d.kind == "failed"]
    coord.close()
    return {
        "n": n,
        "store": "tcp" if etcd is None else "etcd",
        "roles": 2 * n,
        "beats": beats,
        "join_s": join_s,
        "coordinator_cpu_per_s": steady_cpu,
        "fault_lag_ms": (applied - at) * 1e3,
        "poll_ms_median": statistics.median(steady_poll) * 1e3,
        "poll_ms_p99": steady_poll[min(len(steady_poll) - 1, math.ceil(0.99 * len(steady_poll)) - 1)] * 1e3,
        "false_deaths": false_deaths + len(others),
        "job_failed": failed,
        "false_death_reasons": [_why(d) for _, d in decisions[:false_deaths] if d.dead is not None][:8]
        + [_why(d) for d in others][:8],
        "detect_kill_ms": found["kill"],
        "detect_freeze_ms": found["freeze"],
        "detect_lost_host_ms": found["lost host"],
        "takeover": takeover,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", default="64,256,1024", help="simulated ranks, comma-separated")
    parser.add_argument("--stores", default="tcp,etcd", help="tcp (the coordinator's TCPStore) and/or etcd")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--coordinator", default="", help="N values (>= 12) to run the real coordinator at (default: --n); 0: none"
    )
    parser.add_argument(
        "--coordinator-stores",
        default="tcp",
        help="where the coordinator runs keep the job's state: tcp (its TCPStore) and/or etcd",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the runs already in --out's JSON that this one does not redo (same store and N; "
        "same N, store and beats for the coordinator's)",
    )
    parser.add_argument(
        "--beats",
        default="endpoint,store",
        help="how the coordinator runs' members beat: endpoint (native beats to its liveness "
        "endpoint) and/or store (signed writes, the scheme before it)",
    )
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.n.split(",")]
    results = []
    for kind in [k for k in args.stores.split(",") if k]:  # (--stores "": the coordinator's runs only)
        for n in sizes:
            print(f"control_scale: {kind} store, N = {n} ...", flush=True)
            if kind == "tcp":
                master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
                results.append(run(kind, n, args.steps, f"127.0.0.1:{master.port}", {}, JobStore(master, token=TOKEN)))
                del master
            elif kind == "etcd":
                from support import etcd as testetcd

                if not testetcd.available():
                    print("control_scale: etcd is not installed; skipped", flush=True)
                    continue
                with testetcd.EtcdCluster(addresses=["127.0.0.1"] * 3) as cluster:
                    import os

                    os.environ.update(cluster.environ())
                    address = f"etcd://{cluster.endpoints}/{cluster.namespace.rstrip('/')}"
                    client = StoreAddress.parse(address).connect(timeout=T)
                    results.append(run(kind, n, args.steps, address, cluster.environ(), JobStore(client, token=TOKEN)))
            else:
                parser.error(f"unknown store {kind!r}")
            print(f"control_scale: {json.dumps(results[-1])[:400]}", flush=True)
    coordinators = []
    sizes = [int(x) for x in (args.coordinator or args.n).split(",") if x and int(x)]
    for kind in args.coordinator_stores.split(",") if sizes else []:
        if kind not in ("tcp", "etcd"):
            parser.error(f"unknown --coordinator-stores {kind!r}")
        for n in sizes:
            for beats in args.beats.split(","):
                if beats not in ("endpoint", "store"):
                    parser.error(f"unknown --beats {beats!r}")
                print(f"control_scale: the coordinator on {kind}, N = {n}, beats to the {beats} ...", flush=True)
                if kind == "tcp":
                    coordinators.append(run_coordinator(n, beats=beats))
                else:
                    from support import etcd as testetcd

                    if not testetcd.available():
                        print("control_scale: etcd is not installed; skipped", flush=True)
                        continue
                    with testetcd.EtcdCluster(addresses=["127.0.0.1"] * 3) as cluster:
                        address = f"etcd://{cluster.endpoints}/{cluster.namespace.rstrip('/')}"
                        coordinators.append(run_coordinator(n, beats=beats, etcd=(address, cluster.environ())))
                print(f"control_scale: {json.dumps(coordinators[-1])}", flush=True)
    if args.merge:
        results, coordinators = merged(args.out / "control_scale.json", results, coordinators)
    report(results, args.out, coordinators)
    return 0


if __name__ == "__main__":
    sys.exit(main())
