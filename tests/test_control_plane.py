"""The control plane cannot be fooled: values in the job store are signed (a
process that reaches the store without the token changes nothing and crashes
nothing), and epochs fence a trainer that was declared dead but still runs (it
cannot reach its standby or move the commit, and its own commit raises)."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from fsdp_job import JobShape, build_job, train_step

import replica
from replica.errors import CommitTimeoutError, FencedError, JobStateError
from replica.jobstore import Commit, Epoch, Generation, Heartbeat, JobStore, keys
from replica.jobstore.commit import CommitRecord
from replica.roles import timing
from replica.roles.coordinator import Coordinator, Deadlines
from replica.roles.join import JoinRequest, post_request
from replica.timing import Deadline

TOKEN = b"control-plane-token"
T = timedelta(seconds=30)


def raw_client(port: int) -> dist.TCPStore:
    """What an attacker has: the store's port, not the token."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)


def test_values_are_signed_and_forgeries_read_as_absent(store, caplog):
    jobs = JobStore(store, token=TOKEN)
    jobs.put(keys.commit(), Commit(step=4, generation=0))
    assert jobs.get(keys.commit()) == Commit(step=4, generation=0)
    raw = store.get("replica/commit")
    assert TOKEN not in raw  # the token never goes into the store
    # Another job's token, a tampered value, garbage, and a valid value moved to another key: all refused.
    other = JobStore(store, token=b"another-job")
    other.put(keys.commit(), Commit(step=999, generation=0))
    assert jobs.get(keys.commit()) is None
    store.set("replica/commit", raw.replace(b'"step":4', b'"step":9'))
    assert jobs.get(keys.commit()) is None
    store.set("replica/commit", "x")
    assert jobs.get(keys.commit()) is None
    store.set("replica/ack/0/trainer", raw)
    assert jobs.get(keys.ack(0, "")) is None
    with pytest.raises(JobStateError):
        jobs.verify(keys.commit(), b"x")
    assert "ignored a value of replica/commit" in caplog.text and TOKEN.decode() not in caplog.text
    # A wrong type is refused on write, before it reaches the store.
    with pytest.raises(TypeError):
        jobs.put(keys.commit(), Heartbeat(member=1, beat=1))


def test_a_forged_commit_neither_counts_nor_blocks_the_real_one(store):
    record = CommitRecord(JobStore(store, token=TOKEN), world_size=2)
    raw_client(store.port).set("replica/commit", "999")
    raw_client(store.port).set("replica/ack/1/trainer", "999")
    assert record.last() is None
    with pytest.raises(CommitTimeoutError):
        record.wait(1, timedelta(milliseconds=200))
    assert record.acknowledge(0, 3) is None  # rank 1's forged ack is not an ack
    assert record.acknowledge(1, 2) == 2  # the real commit replaces the forged value
    assert JobStore(store, token=TOKEN).get(keys.commit()).step == 2


def test_acks_of_a_superseded_epoch_do_not_move_the_commit(store):
    jobs = JobStore(store, token=TOKEN)
    record = CommitRecord(jobs, world_size=2)
    jobs.put(keys.generation(), Generation(number=0, trainers=(1, 2)))
    e0, e1 = record.current_epoch(0), record.current_epoch(1)
    assert record.acknowledge(0, 5, e0) is None and record.acknowledge(1, 5, e1) == 5
    # Trainer 1 is declared dead; its standby (member 7) takes rank 1 in generation 1.
    jobs.put(keys.generation(), Generation(number=1, trainers=(1, 7)))
    assert record.acknowledge(1, 6, e1) == 5  # the zombie's ack is recorded but never counted
    assert record.acknowledge(0, 6, record.current_epoch(0)) == 5  # rank 1 has no current-epoch ack of 6
    assert record.acknowledge(1, 6, record.current_epoch(1)) == 6


def test_a_replaced_standby_neither_counts_nor_displaces_its_successor(store):
    """Acks are kept per standby incarnation: a standby declared dead that still runs
    (frozen, then woken) acknowledges under its own key, which nothing reads any more.
    With one key per rank its late ack overwrote its successor's, and the coordinator
    then refused to promote the successor (it seemed not to hold the commit)."""
    record = CommitRecord(JobStore(store, token=TOKEN), world_size=1)
    old = record.publish_standby(0, "ucx", "old-address")
    assert record.acknowledge(0, 4, holder=old.nonce) == 4 and record.standby_holds(0, 4)
    new = record.publish_standby(0, "ucx", "new-address")  # its replacement registers
    assert not record.standby_holds(0, 4)  # it holds nothing yet
    assert record.acknowledge(0, 5, holder=new.nonce) == 5
    assert record.acknowledge(0, 9, holder=old.nonce) == 5  # the old one, still running, moves nothing
    assert record.standby_holds(0, 5) and not record.standby_holds(0, 6)
    assert record.acknowledge(0, 6, holder="") == 6  # the trainer acknowledging itself (unprotected) counts


def _forge_everything(port: int) -> None:
    """Everything a process without the token tried against the old store."""
    raw = raw_client(port)
    for key, value in [
        ("replica/commit", "999"),
        ("replica/commit", "x"),
        ("replica/ack/0/trainer", "999"),
        ("replica/generation", "7"),
        ("replica/failover/7", "3"),
        ("replica/promote/0", "7"),
        ("replica/fatal", "forged fatal error"),
        ("replica/finished", "1"),
        ("replica/done/0", "1"),
        ("replica/lost/0", "50"),
        ("replica/unprotected/0", "1"),
        ("replica/hb/1", "1000"),
        # the counters the coordinator reads before the keys they announce
        ("replica/done_count", "7"),
        ("replica/lost_count", "9"),
        ("replica/regroup_count", "3"),
    ]:
        raw.set(key, value)


def test_the_coordinator_ignores_forged_state_and_survives_garbage():
    coord = Coordinator(world_size=1, token=TOKEN, deadlines=Deadlines(trainer=timedelta(seconds=2)))
    jobs = JobStore(raw_client(coord.port), token=TOKEN)
    # A real trainer joins (the join protocol by hand: no process needed).
    request = JoinRequest(role="trainer", rank=0, host="h", pid=12345, nonce="n1")
    seq = post_request(jobs, request, TOKEN)
    assert coord.poll() == []
    assert jobs.get(keys.join_reply(seq)).admitted
    assert jobs.get(keys.generation()) == Generation(number=0, trainers=(seq,))
    # A pre-written reply for the next join is not an admission, and a forged join is refused.
    forged = raw_client(coord.port)
    nxt = seq + 1
    forged.set(f"replica/join/{nxt}/reply", json.dumps({"admitted": True, "reason": None, "generation": 0}))
    assert jobs.get(keys.join_reply(nxt)) is None
    _forge_everything(coord.port)
    jobs.put(keys.heartbeat(seq), Heartbeat(member=seq, beat=1))
    for _ in range(5):
        assert coord.poll() == []  # no failure, no death, no exception
        time.sleep(0.05)
    assert coord.record.last() is None and not coord.finished() and not coord.all_done()
    # The forged generation record was put back by the coordinator.
    assert coord.generation == 0 and jobs.get(keys.generation()) == Generation(number=0, trainers=(seq,))
    assert coord.unprotected == set() and coord.failovers == []
    # The forged heartbeat counter keeps nothing alive: the trainer is declared dead on its deadline
    # (before the first commit, which fails the job: the fault fired and was decided on real beats only).
    deadline = Deadline.after(timedelta(seconds=30))
    decisions = []
    while not decisions and not deadline.expired:
        decisions = coord.poll()
        time.sleep(0.05)
    assert [d.kind for d in decisions] == ["failed"] and "no heartbeat" in decisions[0].reason


def test_a_fenced_trainer_cannot_reach_its_standby_or_commit(store):
    jobs = JobStore(store, token=TOKEN)
    cfg = replica.Config(token=TOKEN, timeout=T, commit_timeout=T, bucket_bytes=16 << 10)
    shape = JobShape(layers=2)
    old, new = (build_job(shape, rank=0, world_size=1, fsdp=False, seed=0) for _ in range(2))
    jobs.put(keys.generation(), Generation(number=0, trainers=(1,)))
    zombie_epoch = Epoch(generation=0, member=1)
    with replica.Mirror(rank=0, world_size=1, store=store, config=cfg) as mirror:
        with replica.Replicator(
            old.model,
            old.optimizer,
            old.extra,
            store=store,
            config=cfg,
            rank=0,
            world_size=1,
            epoch=lambda: zombie_epoch,
        ) as zombie:
            for step in (1, 2):
                train_step(old)
                zombie.commit(step)
            assert zombie.wait_committed() == 2
            # Trainer 1 is declared dead while frozen; member 9 now holds rank 0 in generation 1.
            jobs.put(keys.generation(), Generation(number=1, trainers=(9,)))
            train_step(old)
            # The race: the generation moves on just after the zombie's own check, so its
            # version reaches the standby, which refuses it once its buckets are in.
            zombie._stream._superseded = lambda step, epoch: False
            zombie.commit(3)
            with pytest.raises(FencedError):
                zombie.wait_committed(timedelta(seconds=10))
            assert mirror.stats.fenced == 1  # the standby's fence fired
        # Nothing of step 3 is kept (its slot held step 1, which nothing needs: the commit is 2).
        assert mirror.held_steps() == [2] and CommitRecord(jobs, world_size=1).last() == 2
        # A zombie connecting afresh is refused before it can displace anyone.
        with replica.Replicator(
            new.model,
            new.optimizer,
            new.extra,
            store=store,
            config=cfg,
            rank=0,
            world_size=1,
            epoch=lambda: zombie_epoch,
        ) as again:
            train_step(new)
            again.commit(3)
            with pytest.raises(FencedError):
                again.wait_committed(timedelta(seconds=10))
        assert mirror.held_steps() == [2]
        # The rank's current trainer streams and commits as usual.
        current = Epoch(generation=1, member=9)
        with replica.Replicator(
            new.model, new.optimizer, new.extra, store=store, config=cfg, rank=0, world_size=1, epoch=lambda: current
        ) as rep:
            train_step(new)
            rep.commit(3)
            # Step 2 is released once the commit covers 3 (its slot takes step 4 early).
            assert rep.wait_committed() == 3 and mirror.held_steps()[-1] == 3


def test_an_engine_on_a_host_whose_agent_went_silent_is_dead_at_the_trainer_deadline():
    """An engine's own deadline allows long generations (60 s); on a host whose agent has
    gone silent too (the host is lost or cut off), it is dead at the trainer deadline."""
    from replica.jobstore import AgentInfo, Number
    from replica.roles.coordinator import DecisionKind
    from replica.roles.remote_agents import RemoteAgents

    deadlines = Deadlines(trainer=timedelta(milliseconds=300), rollout=timedelta(seconds=60))
    coord = Coordinator(world_size=1, token=TOKEN, rollouts=1, deadlines=deadlines)
    jobs = JobStore(raw_client(coord.port), token=TOKEN)
    request = JoinRequest(role="rollout", rank=0, host="h2", pid=23456, nonce="e1")
    seq = post_request(jobs, request, TOKEN)
    coord.poll()
    assert jobs.get(keys.join_reply(seq)).admitted
    jobs.put(keys.agent(0), AgentInfo(index=0, host="h2", address="10.200.0.3", pid=1))
    jobs.put(keys.agent_beat(0), Number(value=1))
    agents = RemoteAgents(coord.store, count=1, replacements=0, members=lambda: [])
    assert agents.silent_hosts(deadlines.trainer) == set()  # its first beat was just seen
    beat = 1
    until = Deadline.after(timedelta(seconds=1.0))
    while not until.expired:  # agent and engine beat: nothing happens
        beat += 1
        jobs.put(keys.agent_beat(0), Number(value=beat))
        jobs.put(keys.heartbeat(seq), Heartbeat(member=seq, beat=beat))
        assert agents.silent_hosts(deadlines.trainer) == set()
        assert coord.hosts_silent(agents.silent_hosts(deadlines.trainer)) == [] and coord.poll() == []
        time.sleep(0.05)
    # Both silent past the trainer deadline, far inside the engine's own; the coordinator
    # polls on meanwhile, as its loop does (it reads every beat each BEAT_SCAN).
    until = Deadline.after(deadlines.trainer + 2 * timing.BEAT_SCAN + timedelta(seconds=0.1))
    while not until.expired:
        coord.poll()
        time.sleep(0.05)
    silent = agents.silent_hosts(deadlines.trainer)
    assert silent == {"h2"}
    assert coord.hosts_silent({"other-host"}) == []
    (decision,) = coord.hosts_silent(silent)
    assert decision.kind == DecisionKind.ROLLOUT_LOST and decision.rank == 0
    assert "host's agent and it have been silent" in decision.reason
    assert coord.hosts_silent(silent) == []  # dead once


def test_a_replacement_goes_to_the_least_loaded_host_without_a_trainer():
    from replica.roles.remote_agents import replacement_site

    hosts = {"a": 0, "b": 2, "c": 1, "d": 1}  # host -> its live members

    def pick(trainer_hosts):
        return replacement_site(
            hosts,
            domain=lambda h: h,
            trainer_domains=trainer_hosts,
            load=hosts.get,
            order=lambda h: h,
        )

    assert pick(set()) == "a"
    assert pick({"a"}) == "c"  # c and d are as loaded: the first in order
    assert pick({"a", "c", "d"}) == "b"
    assert pick(set(hosts)) is None  # every host runs a trainer: nowhere
    # Hosts in racks: a trainer in rack 1 rules out every host of rack 1, however idle.
    rack = {"a": "rack1", "b": "rack2", "c": "rack1", "d": "rack2"}

    def in_racks(trainer_racks):
        return replacement_site(
            hosts,
            domain=rack.get,
            trainer_domains=trainer_racks,
            load=hosts.get,
            order=lambda h: h,
        )

    assert in_racks({"rack1"}) == "d"
    assert in_racks({"rack1", "rack2"}) is None


def test_a_replacement_standby_is_ordered_to_an_agent_outside_its_trainers_domain():
    """Members and agents carry their failure domain (REPLICA_DOMAIN, `replica agent
    --domain`): the coordinator's agents place a new standby on a host of another domain,
    even when a host of the trainer's own domain is idle. A join that names no domain is
    in its host's."""
    from replica.jobstore import AgentInfo, Number, OrderKind
    from replica.roles.remote_agents import RemoteAgents

    coord = Coordinator(world_size=2, token=TOKEN, deadlines=Deadlines(trainer=timedelta(seconds=60)))
    jobs = JobStore(raw_client(coord.port), token=TOKEN)
    for rank, (host, domain) in enumerate((("h1", "rack1"), ("h4", ""))):
        seq = post_request(
            jobs,
            JoinRequest(role="trainer", rank=rank, host=host, pid=100 + rank, nonce=f"d{rank}", domain=domain),
            TOKEN,
        )
        coord.poll()
        assert jobs.get(keys.join_reply(seq)).admitted
    assert [(m["host"], m["domain"]) for m in coord.membership()] == [("h1", "rack1"), ("h4", "h4")]
    assert sorted(d for *_, d in coord.members_for_placement()) == ["h4", "rack1"]
    for index, (host, domain) in enumerate((("h2", "rack1"), ("h3", "rack2"), ("h4", ""))):
        jobs.put(keys.agent(index), AgentInfo(index=index, host=host, address=f"10.0.0.{index}", pid=1, domain=domain))
        jobs.put(keys.agent_beat(index), Number(value=1))
    agents = RemoteAgents(coord.store, count=3, replacements=-1, members=coord.members_for_placement)
    assert len(agents.live()) == 3
    assert agents.replace_standby(0)
    assert jobs.get(keys.agent_order(0, 1)) is None  # h2 is idle, but in trainer 0's rack
    assert jobs.get(keys.agent_order(2, 1)) is None  # h4 runs trainer 1
    order = jobs.get(keys.agent_order(1, 1))
    assert (order.kind, order.role, order.rank) == (OrderKind.START, "standby", 0)
    # Every other domain holds a trainer: nowhere to go.
    jobs.put(keys.agent(1), AgentInfo(index=1, host="h3", address="10.0.0.1", pid=1, domain="rack1"))
    agents = RemoteAgents(coord.store, count=3, replacements=-1, members=coord.members_for_placement)
    assert not agents.replace_standby(1)
    coord.close()


def test_a_replacement_standby_late_to_start_leaves_its_rank_training_unprotected():
    """After a failover training waits for the rank's new standby; one not up within the
    coordinator's REPLACEMENT_WAIT (shorter than the trainer's own STANDBY_WAIT, after which
    the trainer would give up and the job fail) has its rank marked unprotected until it
    joins: training goes on. A standby that registers in time is simply waited for."""
    from replica.jobstore.registry import publish
    from replica.roles.supervise import ReplacementWatch

    assert timing.REPLACEMENT_WAIT < timing.STANDBY_WAIT
    coord = Coordinator(world_size=2, token=TOKEN)
    watch = ReplacementWatch(coord, wait=timedelta(seconds=90))
    old = publish(coord.store, keys.standby(0), "ucx", "127.0.0.1:1")  # rank 0's standby died, still registered
    watch.started(0, now=0.0)
    watch.started(1, now=0.0)  # rank 1's standby was promoted: no registration
    assert watch.check(now=89.0) == [] and not coord.unprotected
    publish(coord.store, keys.standby(1), "ucx", "127.0.0.1:2")  # rank 1's new standby is up in time
    assert coord.record.registration(0) == old
    assert watch.check(now=91.0) == [0]  # rank 0's stale registration is not a new standby: overdue
    assert coord.unprotected == {0} and coord.record.unprotected(0)
    assert watch.check(now=500.0) == []  # each rank once


def test_trainers_whose_done_keys_came_after_the_last_poll_finish_done():
    """The supervisor ends its loop on all_done(): the last trainers' done keys may come
    after its last poll, which marks members done. finish() marks them; they were left
    alive in the report (seen once in CI: both ranks finished within a millisecond)."""
    from replica.jobstore import Flag
    from replica.roles.coordinator import MemberState

    coord = Coordinator(world_size=1, token=TOKEN)
    jobs = JobStore(raw_client(coord.port), token=TOKEN)
    request = JoinRequest(role="trainer", rank=0, host="h1", pid=34567, nonce="t0")
    seq = post_request(jobs, request, TOKEN)
    coord.poll()
    assert jobs.get(keys.join_reply(seq)).admitted
    (member,) = coord.members
    jobs.put(keys.done(0), Flag())  # after the last poll (and its counter, as a trainer does)
    jobs.count(keys.done_count(), 1)
    assert coord.all_done() and member.state == MemberState.ALIVE
    coord.finish()
    assert member.state == MemberState.DONE and coord.finished()


def test_a_regroup_waits_while_a_trainer_is_silent_and_its_death_decides():
    """A trainer asks for a regroup (its collective failed) while its peer has gone silent:
    the regroup's grace ends first, but the silent peer's deadline decides: a failover,
    not a regroup "with no death" followed by one (seen in CI right after a coordinator
    took over: both clocks started together, the request's one poll earlier)."""
    from replica.jobstore import Regroup
    from replica.roles.coordinator import DecisionKind

    coord = Coordinator(world_size=2, token=TOKEN, deadlines=Deadlines(trainer=timedelta(seconds=1)))
    jobs = JobStore(raw_client(coord.port), token=TOKEN)
    seqs = []
    for rank in (0, 1):
        request = JoinRequest(role="trainer", rank=rank, host="h1", pid=45670 + rank, nonce=f"t{rank}")
        seqs.append(post_request(jobs, request, TOKEN))
    coord.poll()
    assert all(jobs.get(keys.join_reply(s)).admitted for s in seqs)
    jobs.put(keys.commit(), Commit(step=3, generation=0))
    beats = {s: 1 for s in seqs}

    def beat(*which: int) -> None:
        for s in which:
            beats[s] += 1
            jobs.put(keys.heartbeat(s), Heartbeat(member=s, beat=beats[s]))

    beat(*seqs)
    assert coord.poll() == []
    jobs.put(keys.regroup(0), Regroup(rank=0, generation=coord.generation))
    assert coord.poll() == []  # the regroup's grace starts here
    time.sleep(0.2)
    beat(*seqs)  # rank 1's last beat, after the grace started
    decisions = []
    until = Deadline.after(timedelta(seconds=5))
    while not decisions and not until.expired:
        beat(seqs[0])
        decisions = coord.poll()
        time.sleep(0.02)
    (decision,) = decisions
    # No standby here: the death fails the job; what matters is that it decides, not a regroup.
    assert decision.kind == DecisionKind.FAILED and decision.rank == 1 and "no heartbeat" in decision.reason
    assert coord.regroups == []
