"""Many hosts on one machine: a network-namespace cluster (tests/support/cluster.py),
its faults, and which way the data plane goes between and within hosts."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from replica.roles.exits import ExitCode
from replica.roles.report import compare_reports
from replica.timing import Deadline
from support import cluster as testcluster
from support import etcd as testetcd
from support.cluster import ClusterConfig, NetnsCluster
from support.etcd import EtcdCluster
from support.host_job import Job, python_on, reap
from support.launch import RL_STEPS, ROOT, STEPS
from support.vllm_engine import vllm_available

pytestmark = [pytest.mark.netns, pytest.mark.skipif(not testcluster.available(), reason="needs root and `ip netns`")]

PEER = ROOT / "tests" / "jobs" / "ucx_peer.py"
MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster():
    with NetnsCluster(ClusterConfig(hosts=6)) as c:
        yield c


def reaches(src, dst, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection from ``src`` to ``dst``'s listener on ``port`` opens."""
    code = (
        f"import socket\ntry:\n socket.create_connection(({dst.address!r}, {port}), timeout={timeout_s})\n"
        f"except OSError:\n raise SystemExit(1)"
    )
    return subprocess.run(src.command([sys.executable, "-c", code]), timeout=30).returncode == 0


def listener_on(host, port: int) -> subprocess.Popen:
    code = (
        f"import socket, time\ns = socket.socket(); s.bind(({host.address!r}, {port})); s.listen(16)\n"
        "print('up', flush=True)\ntime.sleep(600)"
    )
    proc = host.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_hosts_have_their_own_addresses_and_links_that_fail(cluster):
    a, b = cluster.hosts[0], cluster.hosts[1]
    assert [h.address for h in cluster.hosts] == [f"10.200.0.{i}" for i in range(2, 8)]
    # A host's address is its own: nobody else can bind it, not even the machine itself.
    with socket.socket() as s, pytest.raises(OSError):
        s.bind((a.address, 0))
    server = listener_on(b, 7001)
    try:
        assert reaches(a, b, 7001)
        b.partition()
        try:
            assert not reaches(a, b, 7001, timeout_s=1.0), "a partitioned host was reached"
        finally:
            b.heal()
        assert reaches(a, b, 7001, timeout_s=10.0)
    finally:
        server.kill()
        server.wait()


def test_killing_a_host_kills_everything_on_it(cluster):
    host = cluster.hosts[5]
    procs = [host.popen(["sleep", "600"]) for _ in range(3)]
    deadline = Deadline.after(timedelta(seconds=30))  # each is in the host once `ip netns exec` has entered it
    while not {p.pid for p in procs} <= set(host.pids()):
        assert not deadline.expired, f"{[p.pid for p in procs]} never all showed in {host.pids()}"
        time.sleep(0.02)
    killed = host.kill()
    assert {p.pid for p in procs} <= set(killed)
    assert [p.wait(timeout=10) for p in procs] == [-9, -9, -9]
    assert host.pids() == []


def transfer(src, dst, nbytes: int) -> tuple[int, str]:
    """Send ``nbytes`` from a process on ``src`` to one on ``dst``; returns the bytes
    ``src``'s link sent meanwhile, and what the receiver printed."""
    receiver = python_on(dst, str(PEER), "listen", dst.address, str(nbytes))
    try:
        line = receiver.stdout.readline().split()
        assert line[:1] == ["address"], line
        before = src.link_bytes()[1]
        sender = python_on(src, str(PEER), "send", line[1], str(nbytes))
        out = sender.communicate(timeout=120)[0]
        assert sender.returncode == 0 and "sent" in out, out[-3000:]
        received = receiver.communicate(timeout=60)[0]
        assert receiver.returncode == 0, received[-3000:]
        return src.link_bytes()[1] - before, received
    finally:
        receiver.kill()


def test_ucx_between_hosts_crosses_the_link_and_within_a_host_does_not(cluster):
    """UCX takes namespaces with one boot id for one machine; replica tells hosts apart
    by address, so bytes for another host go over its link (tcp), and bytes within a
    host stay off it (shared memory)."""
    a, b = cluster.hosts[0], cluster.hosts[1]
    nbytes = 64 * MiB
    sent, received = transfer(a, b, nbytes)
    assert f"received {7 * nbytes}" in received
    assert sent >= nbytes, f"{sent} bytes crossed the link for a {nbytes}-byte transfer to another host"
    sent, received = transfer(b, b, nbytes)  # to its own routable address
    assert f"received {7 * nbytes}" in received
    assert sent < MiB, f"{sent} bytes crossed the link for a transfer within one host"


def test_a_peer_host_cut_off_is_found_without_any_traffic(cluster):
    """An idle connection to a host that is cut off gets no reset and sees no failed
    send: the control socket's keepalive (EndpointConfig.peer_silence, 5 s) finds it."""
    a, b = cluster.hosts[0], cluster.hosts[1]
    listener = python_on(b, str(PEER), "listen", b.address, "0")
    holder = None
    try:
        line = listener.stdout.readline().split()
        assert line[:1] == ["address"], line
        holder = python_on(a, str(PEER), "hold", line[1], "0")
        assert "connected" in holder.stdout.readline()
        b.partition()
        cut = time.monotonic()
        try:
            out = holder.communicate(timeout=60)[0]
            found_after = time.monotonic() - cut
        finally:
            b.heal()
        assert holder.returncode == 0 and "lost" in out, out[-3000:]
        assert found_after < 5 * 5, f"a cut-off peer was found after {found_after:.1f} s"
        print(f"a cut-off peer was found after {found_after:.1f} s")
    finally:
        reap(listener, holder)


@pytest.mark.slow  # CI's 30 minutes; `make test` finds lost hosts in the agents and etcd-coordinator tests
def test_a_trainer_host_lost_whole_fails_over_bit_identically(cluster, tmp_path, reference):
    """Trainer 1's machine is lost in step 5 (its link goes silent, then everything on it
    dies): no connection is reset, so only deadlines find it. Its standby, on another
    host, is promoted and the job ends bit-identical to the run without the failure."""
    standby_rx = cluster.hosts[3].link_bytes()[0]
    # The trainer stops itself in step 5 so that the machine is lost at a known point.
    job = Job(cluster, tmp_path, inject="freeze:trainer:1@5:backward")
    doomed = job.procs["trainer1"]
    try:
        job.wait_stopped("trainer1", "step 5")
        lost = cluster.hosts[2].crash()
        assert doomed.pid in lost
        codes = job.finish()
    finally:
        job.kill()
        cluster.hosts[2].heal()
    assert codes == {"coordinator": 0, "standby0": 0, "standby1": 0, "trainer0": 0, "trainer1": -9}, (
        codes,
        job.outputs(),
    )
    result = json.loads(job.report.read_text())
    (failover,) = result["failovers"]
    assert failover["rank"] == 1, failover
    assert failover["timeline_ms"]["detect"] < 5 * 2500 + 5000, failover  # a 2.5 s deadline, 5x
    assert compare_reports(reference, result) == []
    assert result["last_commit"] == STEPS
    # Trainer 0 mirrored every step to its standby over the link, not through shared memory.
    mirrored = cluster.hosts[3].link_bytes()[0] - standby_rx
    print(f"failover {failover}; standby 0's host received {mirrored} bytes")
    assert mirrored > STEPS * MiB, f"standby 0's host received {mirrored} bytes in {STEPS} steps"


@pytest.mark.slow
def test_a_trainer_host_lost_with_its_standbys_host_resumes_from_the_floor(cluster, tmp_path, reference):
    """Rank 1's trainer host and the host of its standby are lost together in step 8 (the trainer
    stops itself there so that the loss comes at a known point, then both machines go): rank 1's
    state is in no memory any more. The standbys, on their own hosts, wrote every third commit to
    a folder every host sees: `replica coordinator` (which does not restart roles itself) ends the
    job saying the rank's state is lost, and a new job resumed from the floor's newest complete
    version (`--resume DIR`, as the failure message says) ends bit-identical to the failure-free
    run, its first attempt's steps included."""
    floor = tmp_path / "floor"
    first = Job(cluster, tmp_path, inject="freeze:trainer:1@8:backward", durable=floor)
    doomed = first.procs["trainer1"]
    try:
        first.wait_stopped("trainer1", "step 8")
        assert first.procs["standby1"].pid in cluster.hosts[4].crash()  # the standby's host, then the trainer's
        assert doomed.pid in cluster.hosts[2].crash()
        codes = first.finish()
    finally:
        first.kill()
        cluster.hosts[4].heal()
        cluster.hosts[2].heal()
    assert codes["coordinator"] == ExitCode.FAILED, (codes, first.outputs())
    lost = json.loads(first.report.read_text())
    assert "state is lost" in (lost["failure"] or ""), lost["failure"]
    versions = lost["floor"]["versions"]
    assert versions and versions[-1] in (3, 6), lost["floor"]  # written before the loss, by both standbys
    version = versions[-1]
    second = Job(cluster, tmp_path, durable=floor, resume=floor / f"step{version:08d}", name="resumed")
    try:
        codes = second.finish()
    finally:
        second.kill()
    assert codes["coordinator"] == 0, (codes, second.outputs())
    resumed = json.loads(second.report.read_text())
    assert resumed["last_commit"] == STEPS
    for rank in ("0", "1"):  # the first attempt's steps up to the version, the resumed job's after it
        assert lost["losses_hex"][rank][:version] == reference["losses_hex"][rank][:version], rank
        assert resumed["losses_hex"][rank][version:] == reference["losses_hex"][rank][version:], rank


@pytest.mark.slow
def test_host_agents_start_every_role_again_from_the_floor_after_a_pair_loss(cluster, tmp_path, reference):
    """The same loss under host agents: rank 1's trainer host (agent 1) and its standby's host
    (agent 3) are lost together in step 8. The job does not end: `replica coordinator` names the
    next attempt, the agents still alive (0, 2, 4) kill what they run and start what it orders,
    every role placed again (rank 1's trainer on the spare host 5, its standby apart from it), each
    from the floor's newest complete version; the whole run equals the failure-free one."""
    floor = tmp_path / "floor"
    job = Job(cluster, tmp_path, inject="freeze:trainer:1@8:backward", durable=floor, agents=True)
    try:
        job.lose_pair(cluster.hosts[2], cluster.hosts[4])
        codes = job.finish()
    finally:
        job.kill()
        cluster.hosts[4].heal()
        cluster.hosts[2].heal()
    assert codes["coordinator"] == 0, (codes, job.outputs())
    assert {codes[f"agent{i}"] for i in (0, 2, 4)} == {0}, (codes, job.outputs())
    report = json.loads(job.report.read_text())
    (resumed,) = [r for r in report["restarts"] if "resumed_from_floor" in r]
    assert resumed["resumed_from_floor"] in (3, 6) and "state is lost" in resumed["reason"], resumed
    assert "the job goes back to the durable floor's version" in job.output("agent0"), job.output("agent0")[-3000:]
    # Every role placed again on the agents left (rank 1's standby may be a replacement that came before
    # its trainer's host went: kept where it runs), rank 1's trainer and standby apart.
    again = job.output("coordinator").partition("attempt 1 of the job starts")[2]
    where = {role: int(agent) for agent, role in re.findall(r"asked agent (\d) to start (\w+ \d)\n", again)}
    assert set(where) == {"trainer 0", "trainer 1", "standby 0", "standby 1"}, again
    assert set(where.values()) <= {0, 2, 4} and where["trainer 1"] != where["standby 1"], where
    assert compare_reports(reference, report) == [], job.outputs()
    assert report["last_commit"] == STEPS


# In `make test-slow` (35-45 s). It failed 2 runs in 5 until 2026-11-26: when the job ended
# during the partition, the coordinator stopped its store at once; the cut-off agent, back, found
# no store (exit COORDINATOR_LOST) and the zombie's kill order was never carried out. The coordinator now keeps
# its store up until every agent heard from within STORE_LOST has seen the end (agent/{i}/ended,
# written once its ordered kills are done and reported), FINISH_LINGER at most: 5 runs in 5 pass.
@pytest.mark.slow
def test_a_partitioned_trainer_host_is_fenced_and_the_job_ends_bit_identical(cluster, tmp_path, reference):
    """Trainer 1's host cuts its own link for 8 s after step 3 (``--inject
    partition:host:1@3:8``, fired by its agent): alive, its processes running, no packet in
    or out. The coordinator finds it by its heartbeat deadline and promotes its standby;
    a replacement standby starts on the spare host. Healed, trainer 1 is killed by its agent
    on the coordinator's order (or, first, finds its rank given away and stops by itself)
    without having moved the commit; its agent reports its exit. The job ends bit-identical."""
    job = Job(cluster, tmp_path, inject="partition:host:1@3:8", agents=True)
    try:
        codes = job.finish()
    finally:
        job.kill()
    assert codes == {"coordinator": 0, "agent0": 0, "agent1": 0, "agent2": 0, "agent3": 0, "agent4": 0}, (
        codes,
        job.outputs(),
    )
    result = json.loads(job.report.read_text())
    assert all(f["fired_at"] is not None for f in result["faults"]), result["faults"]
    (failover,) = result["failovers"]
    assert failover["rank"] == 1 and "no heartbeat" in failover["reason"], failover
    assert failover["commit"] >= 2, failover  # what was committed before the cut stays
    # Healed, its agent kills it as ordered (-9), or it found its rank given away first (FENCED); cut
    # off for longer than the store's deadline, it could not tell a partition from the
    # coordinator's death and stopped too (COORDINATOR_LOST).
    (zombie,) = [e for e in result["late_exits"] if e["role"] == "trainer" and e["rank"] == 1]
    assert zombie["code"] in (-9, ExitCode.FENCED, ExitCode.COORDINATOR_LOST), result["late_exits"]
    if zombie["code"] == -9:
        assert "killed pid" in job.output("agent1"), job.output("agent1")[-4000:]
    new = [m for m in result["members"] if m["role"] == "standby" and m["rank"] == 1 and m["state"] != "dead"]
    assert [m["host"] for m in new] == [cluster.hosts[5].hostname], result["members"]
    assert compare_reports(reference, result) == []
    assert result["last_commit"] == STEPS
    print(f"failover {failover}; trainer 1 exited with {zombie['code']}")


@pytest.mark.slow  # 48 s: `make test-slow`
def test_a_partitioned_standby_host_leaves_its_rank_unprotected_until_a_new_standby_joins(cluster, tmp_path, reference):
    """Standby 1's host is cut off after step 3: its deadline passes, rank 1 trains on
    unprotected, and a new standby started on the spare host protects it again. Healed,
    the old standby finds its place taken and stops by itself. Bit-identical throughout."""
    # Steps 6 and 7 take 8 s more on both trainers: time for the new standby to join and build
    # its model; it is started ahead (held after its imports), as a scheduler keeps spares warm.
    job = Job(cluster, tmp_path, inject=",".join(f"stall:trainer:{r}@{s}:8" for r in (0, 1) for s in (6, 7)))
    job.start_role("standby1-new", "standby", 1, cluster.hosts[5], held=True)

    def while_cut_off() -> None:
        job.wait_for_key("replica/unprotected/1")
        job.release("standby1-new")
        job.wait_for_key(f"replica/loss/1/{STEPS - 1}")

    codes = job.partitioned(cluster.hosts[4], after="replica/loss/1/3", meanwhile=while_cut_off)
    old = job.output("standby1")
    # Healed near the end, it may see the job over (0) before it sees its place taken (FENCED).
    assert codes["standby1"] in (ExitCode.OK, ExitCode.FENCED, ExitCode.COORDINATOR_LOST), (codes, job.outputs())
    assert "Exception in thread" not in old, old[-4000:]  # every failure was handled where it happened
    assert {k: c for k, c in codes.items() if k != "standby1"} == {
        "coordinator": 0,
        "standby0": 0,
        "standby1-new": 0,
        "trainer0": 0,
        "trainer1": 0,
    }, (codes, job.outputs())
    result = json.loads(job.report.read_text())
    assert result["failovers"] == [], result["failovers"]
    (span,) = result["unprotected_spans"]
    assert span["rank"] == 1 and span["until_commit"] is not None, span  # protected again before the end
    assert result["unprotected"] == []
    assert compare_reports(reference, result) == []
    assert result["last_commit"] == STEPS
    print(f"unprotected {span}; the old standby exited with {codes['standby1']}")


def test_the_active_coordinators_host_lost_with_etcd_another_takes_over(cluster, tmp_path, reference):
    """The job's state in a 3-member etcd cluster (members on hosts 0, 3, 4), coordinators
    on hosts 0 and 5. Host 0 is lost whole in step 3, with the active coordinator and an
    etcd member: the one on host 5 takes over from the state in etcd while training goes
    on, then handles trainer 1's death in step 8; the run is bit-identical."""
    if not testetcd.available():
        pytest.skip("etcd is not installed (make test installs etcd-server)")
    hosts = [cluster.hosts[i] for i in (0, 3, 4)]
    with EtcdCluster(
        addresses=[h.address for h in hosts],
        base_port=2379,
        spawns=[h.popen for h in hosts],
        via=[h.command for h in hosts],
    ) as etcd:
        job = Job(cluster, tmp_path, inject="kill:trainer:1@8:backward", etcd=etcd)
        lost_at, codes = job.crash_after("replica/loss/1/3", cluster.hosts[0], holding="coordinator")
    assert codes == {
        "coordinator": -9,
        "coordinator-b": 0,
        "standby0": 0,
        "standby1": 0,
        "trainer0": 0,
        "trainer1": -9,
    }, (codes, job.outputs())
    result = json.loads((tmp_path / "run-b.json").read_text())
    takeover = result["takeover"]
    took = takeover["at"] - lost_at
    # Commits are raised in the store by the trainers: training went on without a coordinator.
    gap = [t for t in result["step_end_times"]["0"] if t is not None and lost_at < t < takeover["at"]]
    print(f"took over {took:.2f} s after host 0 was lost, at {takeover}; {len(gap)} steps ended meanwhile")
    assert 0 < took < 5 * 5.0, takeover  # the target is 5 s
    assert result["regroups"] == []  # no step was redone for the coordinator's loss
    # Every role still running found the new coordinator's liveness endpoint (on host 5) and beat to it.
    liveness = result["liveness"]
    assert liveness["endpoint"].startswith(cluster.hosts[5].address + ":"), liveness
    assert liveness["members_heard"] == liveness["members"] and liveness["rejected"] == 0, liveness
    (failover,) = result["failovers"]
    assert failover["rank"] == 1 and failover["generation"] == takeover["generation"] + 1, failover
    assert compare_reports(reference, result) == []
    assert result["last_commit"] == STEPS


@pytest.mark.slow
def test_a_later_attempt_is_taken_over_by_another_coordinator_on_etcd(cluster, tmp_path, reference):
    """The pair loss under host agents (rank 1's trainer and standby hosts lost in step 8) with the job's
    state in etcd (members on hosts 0, 1 and 3, away from the pair) and a second coordinator on host 5:
    attempt 1 starts from the floor, and in it host 0 is lost whole with the leading coordinator and an
    etcd member. The one on host 5, which waited on through the return to the floor, takes attempt 1
    over, with what attempt 0 left in the store (its steps, its fault, why it ended); the run equals the
    failure-free one."""
    if not testetcd.available():
        pytest.skip("etcd is not installed (make test installs etcd-server)")
    hosts = [cluster.hosts[i] for i in (0, 1, 3)]
    with EtcdCluster(
        addresses=[h.address for h in hosts],
        base_port=2379,
        spawns=[h.popen for h in hosts],
        via=[h.command for h in hosts],
    ) as etcd:
        job = Job(
            cluster, tmp_path, inject="freeze:trainer:1@8:backward", durable=tmp_path / "floor", agents=True, etcd=etcd
        )
        try:
            job.lose_pair(cluster.hosts[2], cluster.hosts[4])
            _, codes = job.crash_after("replica/attempt1/loss/1/7", cluster.hosts[0], holding="coordinator")
        finally:
            job.kill()
            cluster.hosts[4].heal()
            cluster.hosts[2].heal()
    assert codes["coordinator"] == -9 and codes["coordinator-b"] == 0, (codes, job.outputs())
    assert {codes[f"agent{i}"] for i in (0, 2, 4)} == {0}, (codes, job.outputs())
    result = json.loads((tmp_path / "run-b.json").read_text())
    assert result["takeover"]["attempt"] == 1, result["takeover"]
    (resumed,) = result["restarts"]
    assert resumed["resumed_from_floor"] in (3, 6) and "state is lost" in resumed["reason"], resumed
    assert resumed["faults_fired"] == ["freeze:trainer:1@8:backward"], resumed
    assert [(f["fault"], f["fired_at"] is not None) for f in result["faults"]] == [
        ("freeze:trainer:1@8:backward", True)
    ], result["faults"]
    assert compare_reports(reference, result) == [], job.outputs()
    assert result["last_commit"] == STEPS


def test_host_agents_report_exits_and_start_replacements(cluster, tmp_path, reference):
    """A `replica agent` per host starts its roles. Standby 0's process is killed in step 3:
    its agent reports the exit at once (no deadline to wait for) and the coordinator has it
    start a replacement. Standby 1's host is killed whole in step 6 (``kill:host:3@6``: its
    agent kills every process it started, then itself): the deadline finds the standby, and
    the replacement starts on the spare host's agent.
    The trainers wait for the replacements (no commit with one copy); the run is bit-identical."""
    # The spare host's link is slowed to 50 Mbit/s from step 2 on: its new standby's copy crosses it.
    job = Job(cluster, tmp_path, inject="kill:standby:0@3,kill:host:3@6,slow:host:4@2:50", agents=True)
    try:
        codes = job.finish()
    finally:
        job.kill()
    assert codes == {"coordinator": 0, "agent0": 0, "agent1": 0, "agent2": 0, "agent3": -9, "agent4": 0}, (
        codes,
        job.outputs(),
    )
    result = json.loads(job.report.read_text())
    first, second = result["standbys_replaced"]
    # Reported by its agent (host 3's, agent index 2) at once; on a loaded machine a standby whose
    # beats were already late when it died can meet its deadline first, which is as good.
    assert first["rank"] == 0 and (first["reason"] == "exit code -9" or "no heartbeat" in first["reason"]), first
    assert "exited with -9: reported" in job.output("agent2"), job.output("agent2")
    assert second["rank"] == 1 and "no heartbeat" in second["reason"], second  # its agent died with it
    standbys = [m for m in result["members"] if m["role"] == "standby"]
    hosts = {(m["rank"], m["state"] == "dead"): m["host"] for m in standbys}
    assert len(standbys) == 4, standbys
    assert hosts[(0, True)] == hosts[(0, False)] == cluster.hosts[3].hostname, standbys  # same host: it lives
    assert hosts[(1, True)] == cluster.hosts[4].hostname and hosts[(1, False)] == cluster.hosts[5].hostname, standbys
    assert result["failovers"] == [] and result["unprotected_spans"] == [] and result["unprotected"] == []
    assert all(f["fired_at"] is not None for f in result["faults"]), result["faults"]
    assert "limited to 50 Mbit/s" in job.output("agent4"), job.output("agent4")
    assert compare_reports(reference, result) == []
    assert result["last_commit"] == STEPS
    print(f"replaced {result['standbys_replaced']}")


@pytest.mark.slow  # 40-60 s; `make test` covers spares under `replica launch` (tests/test_spares.py)
def test_host_agents_start_a_spare_where_no_trainer_runs_and_it_is_bound_after_a_kill(cluster, tmp_path, reference):
    """`replica coordinator --agents 5 --spares 1`: once both trainers joined, host 5's agent (no
    trainer's domain, no member) starts a spare standby. Trainer 0 stalls 8 s in steps 2 and 3 (below
    gloo's timeout: the spare's imports) and 6 and 7 (its model and the rank's state); trainer 1 is
    killed in step 4's backward: its standby is promoted and the spare becomes rank 1's new standby
    (the pool starts a new spare in its place). Bit-identical, rank 1 protected again at the end."""
    job = Job(
        cluster,
        tmp_path,
        inject="stall:trainer:0@2:8,stall:trainer:0@3:8,kill:trainer:1@4:backward,"
        "stall:trainer:0@6:8,stall:trainer:0@7:8",
        agents=True,
        spares=1,
    )
    try:
        job.wait_output("agent4", "started spare standby 0", timeout_s=120)
        codes = job.finish()
    finally:
        job.kill()
    assert codes["coordinator"] == 0, (codes, job.outputs())
    result = json.loads(job.report.read_text())
    assert [(b["rank"], b["spare"]) for b in result["spares_bound"]] == [(1, 0)], (result, job.outputs())
    assert [f["rank"] for f in result["failovers"]] == [1] and result["standbys_replaced"] == []
    standbys = [m for m in result["members"] if m["role"] == "standby" and m["rank"] == 1]
    assert [m["host"] for m in standbys] == [cluster.hosts[5].hostname], standbys  # the first is trainer 1 now
    spans = result["unprotected_spans"]
    assert [s["rank"] for s in spans] == [1] and spans[0]["until_commit"] is not None, spans
    assert result["unprotected"] == []
    assert compare_reports(reference, result) == []
    assert result["last_commit"] == STEPS


@pytest.mark.slow
def test_a_rollout_host_lost_whole(cluster, tmp_path, rl_reference):
    """The RL loop across hosts: FSDP2 trainers on hosts 1 and 2, a vLLM engine beside each
    standby on hosts 3 and 4 and one on host 5, all started by host agents. Host 4 (standby 1
    and engine 1) is killed whole in step 3 (``kill:host:3@3``). The other engines take engine
    1's shards, standby 1's replacement starts on a host without a trainer, and the losses and
    rewards are bit-identical to the failure-free run."""
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    job = Job(cluster, tmp_path, inject="kill:host:3@3", rl=True)
    try:
        codes = job.finish(timeout_s=300)
    finally:
        job.kill()
    assert codes == {"coordinator": 0, "agent0": 0, "agent1": 0, "agent2": 0, "agent3": -9, "agent4": 0}, (
        codes,
        job.outputs(),
    )
    result = json.loads(job.report.read_text())
    assert all(f["fired_at"] is not None for f in result["faults"]), result["faults"]
    assert [r["rank"] for r in result["standbys_replaced"]] == [1], result["standbys_replaced"]
    new = [m for m in result["members"] if m["role"] == "standby" and m["rank"] == 1 and m["state"] != "dead"]
    assert [m["host"] for m in new] == [cluster.hosts[5].hostname], result["members"]  # beside engine 2
    shards = result["rollout_shards"]
    assert all(s["version"] == s["needed"] for s in shards)  # each made with the weights pushed for it
    assert {s["step"] for s in shards} == set(range(1, RL_STEPS + 1))
    assert not any(s["engine"] == 1 and s["step"] > 4 for s in shards), shards  # nothing from the lost host
    assert compare_reports(rl_reference, result) == []
    assert result["last_commit"] == RL_STEPS
    print(f"standby replaced {result['standbys_replaced']}; engines lost {result['rollouts_lost']}")
