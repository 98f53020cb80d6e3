"""One contract for the job store, run against both backends: the embedded
``TCPStore`` and ``EtcdStore`` on a real 3-member etcd cluster with
authentication on. Everything the control plane relies on: blocking gets and
waits with deadlines, atomic counters under contention, compare-and-set, many
keys at once, prefixes, the signed ``JobStore`` view, and gloo's rendezvous."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from replica.jobstore import Commit, JobStore, Text, keys
from replica.jobstore.etcd import EtcdStore

TOKEN = b"store-contract-token"
_namespaces = iter(range(10**6))  # the session's etcd cluster (tests/conftest.py) is shared


@pytest.fixture(params=["tcp", "etcd"])
def store(request) -> dist.Store:
    """A fresh, empty store of each backend (etcd: a namespace of its own in the shared cluster)."""
    if request.param == "tcp":
        return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    cluster = request.getfixturevalue("etcd")
    # The job user may write only under the cluster's namespace: a fresh sub-namespace per test.
    return EtcdStore(
        cluster.config(namespace=f"{cluster.namespace}t{next(_namespaces)}/", timeout=timedelta(seconds=30))
    )


def client(store: dist.Store) -> dist.Store:
    """A client of the same store for another thread: a TCPStore client serves one blocking
    call at a time (JobStore.own does the same); an EtcdStore is thread-safe as it is."""
    return store.clone() if isinstance(store, dist.TCPStore) else store


def test_set_get_check_delete(store):
    store.set("a", b"\x00\xffbytes")
    assert store.get("a") == b"\x00\xffbytes"
    assert store.check(["a"]) and not store.check(["a", "b"])
    store.set("b", "text")
    assert store.multi_get(["a", "b"]) == [b"\x00\xffbytes", b"text"]
    store.multi_set(["c", "d"], [b"3", b"4"])
    assert store.get("d") == b"4"
    assert store.delete_key("a") and not store.delete_key("a")
    assert not store.check(["a"])
    assert store.num_keys() >= 3


def test_many_keys_at_once(store):
    """A job of many ranks reads and writes hundreds of keys in one call (every rank's
    registration and ack): etcd refuses a transaction of over 128 operations by default."""
    keys = [f"many/{i}" for i in range(300)]
    store.multi_set(keys, [str(i).encode() for i in range(300)])
    assert store.check(keys)
    assert store.multi_get(keys) == [str(i).encode() for i in range(300)]
    assert not store.check([*keys, "many/none"])


def test_a_read_that_cannot_write_answers_absent_or_the_value(store):
    """JobStore.read's one-request read: a compare-and-set whose expected value no key
    holds answers with that value (and writes nothing) where the key is absent, and with
    the key's value where it is present."""
    absent = b"\x00absent\x00"
    assert store.compare_set("cas", absent, absent) == absent
    assert not store.check(["cas"])
    store.set("cas", b"v")
    assert store.compare_set("cas", absent, absent) == b"v"
    assert store.get("cas") == b"v"


def test_get_blocks_until_the_key_is_set_and_waits_have_deadlines(store):
    threading.Timer(0.3, client(store).set, ("late", b"v")).start()
    started = time.monotonic()
    assert store.get("late") == b"v"
    assert time.monotonic() - started >= 0.25
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(milliseconds=300))
    waited = time.monotonic() - started
    assert 0.25 <= waited < 5 * 0.3 + 2, waited
    store.set_timeout(timedelta(milliseconds=300))
    with pytest.raises(dist.DistStoreError):
        store.get("never")


def test_add_is_atomic_under_contention(store):
    def adder() -> None:
        mine = client(store)
        for _ in range(25):
            mine.add("n", 1)

    threads = [threading.Thread(target=adder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("n", 0) == 100
    assert store.add("fresh", 5) == 5


def test_compare_set(store):
    assert store.compare_set("k", "", b"first") == b"first"  # absent and expected absent: written
    assert store.compare_set("k", "", b"again") == b"first"  # present: not written, the holder returned
    assert store.compare_set("k", b"wrong", b"x") == b"first"
    assert store.compare_set("k", b"first", b"second") == b"second"
    assert store.get("k") == b"second"
    assert store.compare_set("absent", b"expected", b"x") == b"expected"  # TCPStore's answer for an absent key
    assert not store.check(["absent"])


def test_compare_set_has_one_winner(store):
    wins = []

    def racer(i: int) -> None:
        if client(store).compare_set("race", "", f"r{i}".encode()) == f"r{i}".encode():
            wins.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and store.get("race") == f"r{wins[0]}".encode()


def test_prefix_store(store):
    inner = dist.PrefixStore("p", store)
    inner.set("k", b"v")
    assert store.get("p/k") == b"v" and inner.get("k") == b"v"


def test_job_store_signs_and_ignores_forgeries(store):
    job = JobStore(store, token=TOKEN)
    job.put(keys.commit(), Commit(step=3, generation=0))
    assert job.get(keys.commit()) == Commit(step=3, generation=0)
    store.set(job.full(keys.commit()), b'{"generation": 0, "step": 99}\n' + b"0" * 64)  # forged
    assert job.get(keys.commit()) is None
    other = JobStore(store, token=b"another-job")
    other.put(keys.fatal(), Text(value="stop"))
    assert job.get(keys.fatal()) is None  # signed under another token
    value, raw = job.compare_set(keys.members(), None, Text(value="a"))
    assert value == Text(value="a")
    held, _ = job.compare_set(keys.members(), None, Text(value="b"))
    assert held == Text(value="a")
    assert job.compare_set(keys.members(), raw, Text(value="b"))[0] == Text(value="b")
    threading.Timer(0.2, JobStore(client(store), token=TOKEN).put, (keys.finished(), keys.finished().value())).start()
    assert job.wait(keys.finished(), timedelta(seconds=10)) is not None


def test_gloo_rendezvous_over_the_store(store):
    """gloo's process group meets through the store (as the trainers' groups do)."""
    out: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", client(store)), r, 2, timedelta(seconds=30))
            t = torch.tensor([float(r + 1)])
            pg.allreduce([t]).wait()
            out[r] = t
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert out[0].item() == out[1].item() == 3.0


def test_a_job_stores_read_of_many_keys_some_absent_is_exact_and_on_etcd_a_few_requests(store):
    """JobStore.get_many with most keys absent (the coordinator's read of every rank's
    transport reports): the values present, None for the others and for a forged one; on
    etcd in one range over the keys' prefix, not a request per key."""
    from replica.jobstore import JobStore, LostReports, keys
    from support.stores import CountingStore

    jobs = JobStore(store, token=TOKEN)
    names = [keys.lost(r) for r in range(300)]
    for r in (3, 150, 299):
        jobs.put(keys.lost(r), LostReports(rank=r, count=r + 1))
    store.set(jobs.full(keys.lost(7)), b"forged")
    got = jobs.get_many(names)
    assert {r: v.count for r, v in enumerate(got) if v is not None} == {3: 4, 150: 151, 299: 300}
    if isinstance(store, EtcdStore):
        calls = []
        original = store._client.call
        store._client.call = lambda *a, **k: calls.append(a[0]) or original(*a, **k)
        try:
            jobs.get_many(names)
        finally:
            store._client.call = original
        assert calls == ["/v3/kv/range"], calls  # 300 keys: one range over their prefix
    else:
        counting = CountingStore(store)
        JobStore(counting, token=TOKEN).get_many(names)
        assert counting.total >= len(names)  # a TCPStore cannot read absent keys together: one each
