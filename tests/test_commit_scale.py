"""The commit record's per-step cost is O(N) in the number of ranks, and its result is
the one the O(N^2) record gave: the minimum over ranks of the acks that count (the
registered standby's or the rank's own trainer's, in the rank's current epoch), whatever
order the acks come in, with standbys replaced and fenced trainers acknowledging."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
import torch.distributed as dist

import replica.jobstore.commit as commit
from replica.errors import CommitTimeoutError
from replica.jobstore import Generation, JobStore, keys
from replica.jobstore.commit import CommitRecord
from support.stores import CountingStore

TOKEN = b"commit-scale-token"
T = timedelta(seconds=30)


def _client(master: dist.TCPStore) -> CountingStore:
    return CountingStore(dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=T))


@pytest.mark.parametrize("n", [8, 64, 100])
def test_a_steps_acknowledgements_cost_o_n_store_requests(server, n):
    client = _client(server)
    jobs = JobStore(client, token=TOKEN)
    jobs.put(keys.generation(), Generation(number=0, trainers=tuple(range(1, n + 1))))
    # Each simulated standby: its own commit record (as in its own process) and registration.
    standbys = [CommitRecord(jobs, world_size=n) for _ in range(n)]
    holders = [s.publish_standby(r, "shm", f"127.0.0.1:{1000 + r}").nonce for r, s in enumerate(standbys)]
    epochs = [standbys[0].current_epoch(r) for r in range(n)]
    order = list(range(n))
    for step in (1, 2, 3):
        random.Random(step).shuffle(order)
        client.reset()
        for r in order:
            standbys[r].acknowledge(r, step, epochs[r], holders[r])
        assert standbys[0].last() == step
        reads = [keys_named for method, keys_named in client.calls if method == "multi_get"]
        groups = -(-n // commit._GROUP)
        if groups == 1:
            # One acknowledger (the last) reads every registration and ack; before, every one did (~3N^2).
            assert reads == [n, n], client.calls  # the registrations, then the acks
        else:
            # Each group's last acknowledger reads its group's (the registrations, then the acks),
            # the last group's reads every group's summary: no read of every rank's keys.
            sizes = [min(commit._GROUP, n - g * commit._GROUP) for g in range(groups)]
            assert sorted(reads) == sorted([groups] + [size for size in sizes for _ in (0, 1)]), client.calls
        # (The first step counts its acks from step 0 too: no commit yet says where they start.)
        assert client.total <= (4 * n + 16 if step > 1 else 5 * n + 32), (step, client.total, client.requests)


@pytest.mark.parametrize("group", [32, 2, 3])
def test_the_commit_is_the_minimum_of_the_acks_that_count(server, monkeypatch, group):
    """Random interleavings of acks across steps; a standby replaced mid-run (its
    predecessor still acknowledging), a trainer fenced by a new generation (still
    acknowledging, in its old epoch), a rank left unprotected (its trainer acknowledges
    itself). After every ack the commit is what the full rule says it is: with the ranks
    in one group, and in groups of 2 and of 3 (summaries raised, of a generation gone)."""
    monkeypatch.setattr(commit, "_GROUP", group)
    n, rng = 4, random.Random(7 + group)
    jobs = JobStore(_client(server), token=TOKEN)
    members = [1, 2, 3, 4]
    jobs.put(keys.generation(), Generation(number=0, trainers=tuple(members)))
    observer = CommitRecord(jobs, world_size=n)
    registered = {r: CommitRecord(jobs, world_size=n).publish_standby(r, "shm", f"a{r}").nonce for r in range(n)}
    counted: dict[int, int] = {}  # rank -> the step of its ack that counts
    generation = 0
    for step in range(1, 25):
        events = list(range(n))
        rng.shuffle(events)
        for r in events:
            if step == 8 and r == 1:  # rank 1's standby is replaced: the old one keeps acknowledging
                old = registered[1]
                registered[1] = CommitRecord(jobs, world_size=n).publish_standby(1, "shm", "new").nonce
                counted.pop(1, None)
                CommitRecord(jobs, world_size=n).acknowledge(1, step, observer.current_epoch(1), old)
            if step == 14 and r == 2:  # rank 2's trainer is declared dead: a new member, generation + 1
                zombie = observer.current_epoch(2)
                generation += 1
                members[2] = 10 + step
                jobs.put(keys.generation(), Generation(number=generation, trainers=tuple(members)))
                counted.clear()  # every rank's epoch is of the new generation: only its acks count now
                CommitRecord(jobs, world_size=n).acknowledge(2, step + 5, zombie, registered[2])  # never counts
            epoch = observer.current_epoch(r)
            if step >= 18 and r == 3:  # rank 3 unprotected: its trainer acknowledges itself
                CommitRecord(jobs, world_size=n).acknowledge(3, step, epoch, "")
            else:
                CommitRecord(jobs, world_size=n).acknowledge(r, step, epoch, registered[r])
            counted[r] = step
            want = min(counted.values()) if len(counted) == n else None
            got = observer.last()
            assert got == want or (want is None and got is not None and got < step), (step, r, got, want, counted)
        if len(counted) == n:  # (not in the step a new generation began: the others acked it in the old one)
            assert observer.last() == step


@pytest.mark.parametrize("group", [32, 2])
def test_a_waiter_raises_a_commit_its_raiser_never_did_and_only_then(server, monkeypatch, group):
    """The last acknowledger (the last summarizer, with the ranks in groups) dies between
    its ack and the raise (the fault: its raise is skipped): a trainer waiting for the
    step raises the commit itself within _RECHECK of seeing the counter complete, and does
    not read every ack while acks are still coming. With the counter tampered with
    (lowered), its full check every _RECHECK_FULL still raises it."""
    monkeypatch.setattr(commit, "_GROUP", group)
    monkeypatch.setattr(commit, "_RECHECK", timedelta(milliseconds=200))
    monkeypatch.setattr(commit, "_RECHECK_FULL", timedelta(seconds=2))
    n = 4
    last_raise = "_raise_to" if group >= n else "_raise_from_summaries"  # the last ack's raise
    jobs, records, holders, epochs = _all_but_the_last_acked(server, n)
    client = CountingStore(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=T))
    waiter = CommitRecord(JobStore(client, token=TOKEN), world_size=n)
    with pytest.raises(CommitTimeoutError):  # one ack missing: no commit, and no full read
        waiter.wait(1, timedelta(milliseconds=900))
    assert not any(method == "multi_get" for method, _ in client.calls), client.calls
    raised = []
    with monkeypatch.context() as fault:
        fault.setattr(CommitRecord, last_raise, lambda self, step, *_: raised.append(step) or self.last_seen())
        records[n - 1].acknowledge(n - 1, 1, epochs[n - 1], holders[n - 1])  # the last ack; its raise never happens
    assert raised == [1] and waiter.last() is None  # the fault fired: the raiser "died"
    assert waiter.wait(1, timedelta(seconds=5)) == 1  # raised by the waiter
    # Step 2: every ack in, the raiser dead again, and the counter lowered by someone without the token.
    for r in range(n):
        records[r].store.put(
            keys.ack(r, holders[r]),
            records[r]
            .store.get(keys.ack(r, holders[r]))
            .__class__(rank=r, step=2, generation=epochs[r].generation, member=epochs[r].member, holder=holders[r]),
        )
    jobs.count(keys.ack_count(2, 0) if group >= n else keys.summary_count(2), 1)  # far below: acks still coming
    assert waiter.wait(2, timedelta(seconds=10)) == 2  # the full check every _RECHECK_FULL raised it


def test_a_group_whose_summarizer_died_is_raised_by_the_next_ack_or_the_full_check(server, monkeypatch):
    """Ranks in groups of 2: the last acknowledger of group 1 dies before it writes the
    group's summary (the fault: its summary is skipped). The commit waits, then rises when
    the group's next ack comes (a replaced standby's first) or, without one, at a waiter's
    full check every _RECHECK_FULL."""
    monkeypatch.setattr(commit, "_GROUP", 2)
    monkeypatch.setattr(commit, "_RECHECK", timedelta(milliseconds=200))
    monkeypatch.setattr(commit, "_RECHECK_FULL", timedelta(seconds=2))
    n = 4
    jobs, records, holders, epochs = _all_but_the_last_acked(server, n)
    summarized = []
    with monkeypatch.context() as fault:
        fault.setattr(CommitRecord, "_summarize", lambda self, g, t: summarized.append((g, t)) or self.last_seen())
        records[n - 1].acknowledge(n - 1, 1, epochs[n - 1], holders[n - 1])
    assert summarized == [(1, 1)] and records[0].last() is None  # the fault fired
    # Its replacement registers and acknowledges: the group's counter passes its size again.
    replacement = CommitRecord(jobs, world_size=n)
    nonce = replacement.publish_standby(n - 1, "shm", "127.0.0.1:2000").nonce
    assert replacement.acknowledge(n - 1, 1, epochs[n - 1], nonce) == 1
    # Step 2: the same fault, and no ack after it: a waiter's full check raises it.
    for r in range(n - 1):
        records[r].acknowledge(r, 2, epochs[r], holders[r])
    with monkeypatch.context() as fault:
        fault.setattr(CommitRecord, "_summarize", lambda self, g, t: summarized.append((g, t)) or self.last_seen())
        replacement.acknowledge(n - 1, 2, epochs[n - 1], nonce)
    assert summarized[-1] == (1, 2) and records[0].last() == 1
    waiter = CommitRecord(
        JobStore(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=T), token=TOKEN), world_size=n
    )
    assert waiter.wait(2, timedelta(seconds=10)) == 2


def _all_but_the_last_acked(server, n: int):
    """A job of ``n`` ranks (one commit record each, as in its own process), every
    standby registered and every rank but the last acknowledged step 1."""
    jobs = JobStore(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=T), token=TOKEN)
    jobs.put(keys.generation(), Generation(number=0, trainers=tuple(range(1, n + 1))))
    records = [CommitRecord(jobs, world_size=n) for _ in range(n)]
    holders = [rec.publish_standby(r, "shm", f"127.0.0.1:{1000 + r}").nonce for r, rec in enumerate(records)]
    epochs = [records[0].current_epoch(r) for r in range(n)]
    for r in range(n - 1):
        records[r].acknowledge(r, 1, epochs[r], holders[r])
    return jobs, records, holders, epochs
