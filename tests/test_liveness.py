"""The coordinator's liveness endpoint (``JobStore.liveness_server``, csrc/liveness.cpp)
and the native beat aimed at it (``Heartbeat.aim``): beats as signed UDP datagrams that
leave the store alone while they are answered, answers that carry the generation number,
nothing counted that is not signed and rising, the store taking the beats again when the
endpoint goes silent, and the generation hint that saves the roles' store reads."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from replica.jobstore import Epoch, Generation, Heartbeat, JobStore, LivenessReply, keys
from replica.jobstore.commit import CommitRecord, EpochRecord, hint_generation, publish_generation
from replica.timing import Deadline
from support.children import wait_for
from support.stores import CountingStore

TOKEN = b"liveness-test-token"
PERIOD = timedelta(milliseconds=20)
IO = timedelta(seconds=2)
GRACE = timedelta(seconds=30)
STORE_AFTER = timedelta(milliseconds=300)


@pytest.fixture
def store():
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return JobStore(raw, token=TOKEN)


def _beat(store: JobStore, member: int):
    return store.heartbeat_sender(member, period=PERIOD, io_timeout=IO, python_grace=GRACE, store_after=STORE_AFTER)


def test_beats_go_to_the_endpoint_and_its_answers_carry_the_generation(store):
    server = store.liveness_server("127.0.0.1")
    beat = _beat(store, 7)
    try:
        wait_for(lambda: store.get(keys.heartbeat(7)) is not None, "a beat in the store before the aim")
        server.set_generation(3)
        beat.aim("127.0.0.1", server.port)
        wait_for(lambda: beat.generation == 3, "an answer with generation 3")
        assert 0 <= server.ages([7])[0] < 1.0 and server.ages([8]) == [-1.0]  # 8 never beat
        assert beat.reply_age < 1.0 and beat.replies >= 1
        in_store = store.get(keys.heartbeat(7)).beat
        heard = server.beats([7])[0]
        time.sleep(STORE_AFTER.total_seconds() * 2)
        # Answered: the beats rose at the endpoint and the store was left alone.
        assert server.beats([7])[0] >= heard + 5
        assert store.get(keys.heartbeat(7)).beat == in_store
        server.set_generation(5)
        server.set_generation(4)  # never lowered
        wait_for(lambda: beat.generation == 5, "an answer with generation 5")
        assert server.generation == 5 and server.rejected == 0
    finally:
        beat.stop()
        server.stop()


def test_a_silent_endpoint_sends_the_beats_back_to_the_store_and_a_new_one_takes_them(store):
    first = store.liveness_server("127.0.0.1")
    beat = _beat(store, 9)
    try:
        beat.aim("127.0.0.1", first.port)
        wait_for(lambda: beat.replies > 0, "an answer")
        first.stop()  # the coordinator is gone (the fault)
        stopped_at = time.monotonic()
        in_store = store.get(keys.heartbeat(9))  # None when the aim came before the first beat
        before = in_store.beat if in_store is not None else 0
        wait_for(
            lambda: (store.get(keys.heartbeat(9)) or Heartbeat(member=9, beat=0)).beat > before,
            "beats in the store again",
        )
        # STORE_AFTER without an answer (a test allows 5x plus a loaded machine's second)
        assert time.monotonic() - stopped_at < STORE_AFTER.total_seconds() * 5 + 1
        assert beat.reply_age > STORE_AFTER.total_seconds()
        second = store.liveness_server("127.0.0.1")  # its successor
        try:
            second.set_generation(1)
            beat.aim("127.0.0.1", second.port)
            wait_for(lambda: beat.generation == 1 and second.beats([9])[0] > before, "beats at the new endpoint")
            in_store = store.get(keys.heartbeat(9)).beat
            time.sleep(STORE_AFTER.total_seconds() * 2)
            assert store.get(keys.heartbeat(9)).beat == in_store  # answered again: the store is left alone
        finally:
            second.stop()
    finally:
        beat.stop()


def test_only_signed_rising_beats_count(store):
    server = store.liveness_server("127.0.0.1")
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.settimeout(0.5)
    try:
        at = ("127.0.0.1", server.port)
        signed = store.sign(keys.heartbeat(4), Heartbeat(member=4, beat=10))
        other = JobStore(store.raw, token=b"another job").sign(keys.heartbeat(4), Heartbeat(member=4, beat=11))
        renamed = store.sign(keys.heartbeat(5), Heartbeat(member=4, beat=12))  # signed for another member's key
        for datagram in [
            b"garbage",
            b"",
            b"x" * 4000,
            other,
            renamed,
            b'{"beat":99,"member":4}\n' + b"0" * 64,
            signed.replace(b'"beat":10', b'"beat":99'),
        ]:
            probe.sendto(datagram, at)
        wait_for(lambda: server.rejected == 7, "7 rejections")
        assert server.beats([4]) == [0]
        probe.sendto(signed, at)
        answer = probe.recv(512)  # the only answer: the verified beat, signed as the job store signs
        assert store.verify(keys.liveness_reply(4), answer) == LivenessReply(beat=10, generation=-1, member=4)
        assert server.beats([4]) == [10]
        received = server.received
        probe.sendto(signed, at)  # a replay: verified, moves nothing, not answered
        wait_for(lambda: server.received == received + 1, "the replay arrived")
        with pytest.raises(socket.timeout):
            probe.recv(512)
        assert server.beats([4]) == [10] and server.rejected == 7
    finally:
        probe.close()
        server.stop()


def test_the_generation_hint_saves_store_reads_and_the_commit_never_uses_it(store):
    counting = CountingStore(store.raw)
    jobs = JobStore(counting, token=TOKEN)
    publish_generation(jobs, Generation(number=2, trainers=(1,)))
    epochs = EpochRecord(jobs)
    heard: list[int | None] = [None]
    hint_generation(jobs, lambda: heard[0])
    try:
        assert epochs.generation().number == 2  # the first read: from the store
        counting.reset()
        heard[0] = 2
        for _ in range(10):
            assert epochs.generation().number == 2
        assert counting.total == 0  # vouched for by the hint: no request
        heard[0] = None  # stale: the store is asked
        epochs.generation()
        assert counting.total == 1
        publish_generation(jobs, Generation(number=3, trainers=(5,)))
        heard[0] = 3  # moved: the store is asked, the record read whole
        assert epochs.generation() == Generation(number=3, trainers=(5,))
        heard[0] = 3
        counting.reset()
        assert epochs.generation(fresh=True).number == 3 and counting.total == 1  # fresh: always the store
        # The commit's raise reads the epochs from the store, whatever the hint says.
        record = CommitRecord(jobs, world_size=1)
        record.publish_standby(0, "shm", "127.0.0.1:1")
        holder = record.registration(0).nonce
        heard[0] = 2  # a stale hint, claiming the generation before: the commit goes by the store's
        assert record.acknowledge(0, 1, Epoch(generation=3, member=5), holder) == 1
        # The fenced trainer of generation 2 streams step 2: its standby's ack never counts, hint or not.
        assert CommitRecord(jobs, world_size=1).acknowledge(0, 2, Epoch(generation=2, member=1), holder) == 1
    finally:
        hint_generation(jobs, None)


def _silenced_is_found(coord, beat, rank: int, deadline: timedelta) -> None:
    """Stop ``beat`` (trainer ``rank``'s, before the first commit) and poll ``coord`` until it
    decides: the job fails for that rank's silence, within 5x its deadline."""
    beat.stop()
    stopped = time.monotonic()
    decisions = []
    while not decisions and time.monotonic() - stopped < 30:
        decisions = coord.poll()
        time.sleep(0.02)
    took = time.monotonic() - stopped
    assert [(d.kind.value, d.rank) for d in decisions] == [("failed", rank)], decisions
    assert "no heartbeat" in decisions[0].reason
    assert took < deadline.total_seconds() * 5, took


def test_the_coordinator_times_beats_it_hears_and_reads_the_store_only_for_the_unheard():
    """A trainer that beats to the coordinator's endpoint only stays alive past its
    deadline with its store key untouched; one that beats to the store only (its
    datagrams cannot reach the endpoint) is timed from the store; once the first stops
    beating (the fault), it is declared dead at its deadline, the other is not."""
    from replica.roles.coordinator import Coordinator, Deadlines
    from replica.roles.join import JoinRequest, post_request

    deadline = timedelta(milliseconds=1500)
    coord = Coordinator(world_size=2, token=TOKEN, deadlines=Deadlines(trainer=deadline))
    jobs = JobStore(dist.TCPStore("127.0.0.1", coord.port, is_master=False, timeout=timedelta(seconds=30)), token=TOKEN)
    try:
        address = jobs.get(keys.liveness()).value
        assert address == f"127.0.0.1:{coord.liveness.port}"
        members = [
            post_request(jobs, JoinRequest(role="trainer", rank=r, host="h", pid=100 + r, nonce=f"n{r}"), TOKEN)
            for r in range(2)
        ]
        assert coord.poll() == []
        assert coord.liveness.generation == coord.generation  # answers carry the published generation
        udp, stored = (
            jobs.heartbeat_sender(
                m,
                period=timedelta(milliseconds=100),
                io_timeout=IO,
                python_grace=GRACE,
                store_after=timedelta(seconds=60),
            )
            for m in members
        )
        try:
            host, _, port = address.rpartition(":")
            udp.aim(host, int(port))
            wait_for(lambda: udp.replies > 0, "an answer")
            before_aim = jobs.get(keys.heartbeat(members[0])).beat  # 0 (the admission's) or the first beat
            end = Deadline.after(deadline * 2)
            while not end.expired:
                assert coord.poll() == []  # nobody is taken for dead
                time.sleep(0.02)
            assert jobs.get(keys.heartbeat(members[0])).beat == before_aim <= 1  # never written since the aim
            assert jobs.get(keys.heartbeat(members[1])).beat > 5  # the other's beats went to the store
            assert coord.liveness_report()["members_heard"] == 1
            _silenced_is_found(coord, udp, 0, deadline)  # the fault: the endpoint hears nothing more from member 0
        finally:
            udp.stop()
            stored.stop()
    finally:
        coord.close()


def test_a_beat_aimed_from_the_start_never_writes_the_store(store):
    server = store.liveness_server("127.0.0.1")
    beat = store.heartbeat_sender(
        12,
        period=PERIOD,
        io_timeout=IO,
        python_grace=GRACE,
        store_after=STORE_AFTER,
        liveness=("127.0.0.1", server.port),
    )
    try:
        wait_for(lambda: server.beats([12])[0] >= 10 and beat.replies >= 10, "ten answered beats")
        assert store.get(keys.heartbeat(12)) is None
    finally:
        beat.stop()
        server.stop()


def test_a_deadline_is_met_within_a_poll_not_a_scan_of_every_beat(monkeypatch):
    """Between the coordinator's reads of every beat (``BEAT_SCAN``, here longer than the
    test) a poll looks at the liveness endpoint's table and reads the store's beats of the
    members it shows overdue only: a member that stops beating to the endpoint is declared
    dead at its deadline, with no scan of every beat in between, and a member beating to
    the store only (never heard at the endpoint) is read there and kept alive."""
    from replica.roles import timing
    from replica.roles.coordinator import Coordinator, Deadlines
    from replica.roles.join import JoinRequest, post_request

    monkeypatch.setattr(timing, "BEAT_SCAN", timedelta(seconds=600))
    deadline = timedelta(seconds=1)
    coord = Coordinator(world_size=3, token=TOKEN, deadlines=Deadlines(trainer=deadline, standby=deadline))
    jobs = JobStore(dist.TCPStore("127.0.0.1", coord.port, is_master=False, timeout=timedelta(seconds=30)), token=TOKEN)
    beats = []
    try:
        host, _, port = jobs.get(keys.liveness()).value.rpartition(":")
        members = [
            post_request(jobs, JoinRequest(role="trainer", rank=r, host="h", pid=100 + r, nonce=f"n{r}"), TOKEN)
            for r in range(3)
        ]
        assert coord.poll() == []  # admits them, and reads every beat (the first scan)
        scanned_at = coord._liveness.beats_read_at
        assert scanned_at > 0
        for m in members:
            beats.append(
                jobs.heartbeat_sender(
                    m,
                    period=timedelta(milliseconds=100),
                    io_timeout=IO,
                    python_grace=GRACE,
                    store_after=timedelta(seconds=60),
                )
            )
        beats[0].aim(host, int(port))
        beats[1].aim(host, int(port))  # beats[2]: the store only
        wait_for(lambda: beats[0].replies > 0 and beats[1].replies > 0, "answers")
        end = Deadline.after(deadline * 3)
        while not end.expired:
            assert coord.poll() == []  # the store-only member is read when overdue, and alive
            time.sleep(0.02)
        assert jobs.get(keys.heartbeat(members[2])).beat > 10
        _silenced_is_found(coord, beats[1], 1, deadline)  # the fault
        assert coord._liveness.beats_read_at == scanned_at  # found by a poll's look, not by a scan of every beat
    finally:
        for b in beats:
            b.stop()
        coord.close()
