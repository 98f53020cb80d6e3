"""The heartbeat senders (``JobStore.heartbeat_sender``; the native one in csrc/heartbeat.cpp):
every kind a ``HeartbeatSender``, signed exactly as the job store signs, beating while the main
thread holds the GIL, stopping when the
interpreter shows no life, and saying when the store is gone. A real TCPStore, and a
real 3-member etcd cluster with authentication (the beat speaks its HTTP gateway)."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import hmac
import random
import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from replica import _C
from replica.errors import JobStateError
from replica.jobstore import Heartbeat, HeartbeatSender, JobStore, ThreadHeartbeatSender, keys
from replica.jobstore.etcd import EtcdStore
from replica.timing import Deadline
from support import etcd as testetcd
from support.children import wait_for
from support.etcd import EtcdCluster

TOKEN = b"heartbeat-test-token"
PERIOD = timedelta(milliseconds=20)
IO = timedelta(seconds=2)


@pytest.fixture(params=["tcp", "etcd"])
def store(request):
    if request.param == "tcp":
        raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    else:
        etcd = request.getfixturevalue("etcd")
        raw = EtcdStore(etcd.config(namespace=f"{etcd.namespace}heartbeat/"))
    return JobStore(raw, token=TOKEN)


# RFC 4231's HMAC-SHA256 test cases 1-4, 6 and 7 (5 truncates its output): key, data, digest.
RFC_4231 = [
    (b"\x0b" * 20, b"Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 20, b"\xdd" * 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
    (bytes(range(1, 26)), b"\xcd" * 50, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"),
    (
        b"\xaa" * 131,
        b"Test Using Larger Than Block-Size Key - Hash Key First",
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
    ),
    (
        b"\xaa" * 131,
        b"This is a test using a larger than block-size key and a larger than block-size data. The key "
        b"needs to be hashed before being used by the HMAC algorithm.",
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
    ),
]


def test_the_native_hmac_is_hmac_sha256():
    """csrc/signing.h's hand-written SHA-256 and HMAC against RFC 4231's vectors, and against
    Python's (OpenSSL's) on edge lengths and on random keys and messages: every length of a
    message around SHA-256's 64-byte block and its 55/56-byte padding edge."""
    for key, message, digest in RFC_4231:
        assert hmac.new(key, message, hashlib.sha256).hexdigest() == digest  # the vector itself
        assert _C.hmac_sha256_hex(key, message) == digest
    rng = random.Random(4231)
    cases = [
        (b"k" * 32, b'replica/hb/3\x00{"beat":1,"member":3}'),
        (b"x" * 100, b""),
        (b"", b"a" * 200),
        (bytes(range(32)), bytes(range(256)) * 3),
    ]
    cases += [(rng.randbytes(rng.choice([0, 1, 32, 63, 64, 65, 200])), rng.randbytes(n)) for n in range(0, 200)]
    for key, message in cases:
        assert _C.hmac_sha256_hex(key, message) == hmac.new(key, message, hashlib.sha256).hexdigest(), (key, message)


def test_one_signed_format_in_both_languages():
    """A value signed by the native threads (csrc/signing.h) is the bytes JobStore.put
    writes, JobStore verifies what they sign and they verify what it signs; a value
    changed anywhere, or under another key, verifies in neither."""
    store = JobStore(dist.HashStore(), token=TOKEN)
    rng = random.Random(7)
    for member in range(40):
        key = keys.heartbeat(member)
        value = Heartbeat(member=member, beat=rng.randrange(1 << 40))
        signed = store.sign(key, value)
        body = signed.rpartition(b"\n")[0]
        assert _C.sign_value(store._mac_key, store.full(key), body) == signed
        assert _C.verify_value(store._mac_key, store.full(key), signed) == body
        assert store.verify(key, _C.sign_value(store._mac_key, store.full(key), body)) == value
        at = rng.randrange(len(signed))
        tampered = signed[:at] + bytes([signed[at] ^ 1]) + signed[at + 1 :]
        assert _C.verify_value(store._mac_key, store.full(key), tampered) is None
        with pytest.raises(JobStateError):
            store.verify(key, tampered)
        assert _C.verify_value(store._mac_key, store.full(keys.heartbeat(member + 1)), signed) is None
    assert _C.verify_value(store._mac_key, "k", b"no signature") is None


def test_every_kind_of_sender_is_a_heartbeat_sender(store):
    """The native sender (to a TCPStore, to etcd's HTTP gateway) and the Python thread's (made
    here on the same store; ``heartbeat_sender`` picks it for etcd over https, tested below)
    are ``HeartbeatSender``s: each has every member the roles use, of the type it promises."""
    members = sorted(name for name in vars(HeartbeatSender) if not name.startswith("_"))
    assert members == [
        "aim",
        "beats",
        "failing_for",
        "generation",
        "last_error",
        "paused",
        "replies",
        "reply_age",
        "stop",
        "touch",
    ]
    senders = [
        store.heartbeat_sender(30, period=PERIOD, io_timeout=IO, python_grace=timedelta(seconds=30)),
        ThreadHeartbeatSender(store.reconnect(IO), 31, period=PERIOD, python_grace=timedelta(seconds=30)),
    ]
    try:
        assert isinstance(senders[0], _C.NativeHeartbeatSender)
        for sender in senders:
            assert isinstance(sender, HeartbeatSender)
            sender.touch()
            wait_for(lambda s=sender: s.beats >= 2, f"beats from {type(sender).__name__}")
            assert sender.paused is False and sender.failing_for == 0.0 and sender.last_error == ""
            assert (sender.generation, sender.reply_age, sender.replies) == (-1, float("inf"), 0)  # never aimed
    finally:
        for sender in senders:
            sender.stop()

    class NoAim:  # every member but one: not a sender
        beats, paused, failing_for, last_error, generation, reply_age, replies = 0, False, 0.0, "", -1, 0.0, 0

        def touch(self) -> None: ...

        def stop(self) -> None: ...

    assert not isinstance(NoAim(), HeartbeatSender)


def test_beats_are_signed_rising_and_go_on_while_the_gil_is_held(store):
    beat = store.heartbeat_sender(7, period=PERIOD, io_timeout=IO, python_grace=timedelta(seconds=30))
    try:
        wait_for(lambda: store.get(keys.heartbeat(7)) is not None, "the first beat")
        first = store.get(keys.heartbeat(7))
        assert isinstance(first, Heartbeat) and first.member == 7 and first.beat >= 1  # verified as JobStore signs
        other = JobStore(store.raw, token=b"another job")
        assert other.get(keys.heartbeat(7)) is None  # another token cannot read it as valid

        before = beat.beats
        started = time.monotonic()
        sum(range(40_000_000))  # one C call that holds the GIL throughout
        held = time.monotonic() - started
        during = beat.beats - before
        assert held > 0.1 and during >= 1, (held, during)  # the beats did not wait for the GIL
        wait_for(lambda: store.get(keys.heartbeat(7)).beat > first.beat, "a later beat in the store")
    finally:
        beat.stop()
    stopped = beat.beats
    time.sleep(0.2)
    assert beat.beats == stopped  # stop() stops it


def test_beats_stop_when_the_interpreter_shows_no_life(store):
    beat = store.heartbeat_sender(8, period=PERIOD, io_timeout=IO, python_grace=timedelta(milliseconds=300))
    try:
        wait_for(lambda: beat.paused, "the beats to pause without touch()")
        paused_at = beat.beats
        time.sleep(0.3)
        assert beat.paused and beat.beats == paused_at  # a hung interpreter sends nothing
        for _ in range(20):
            beat.touch()
            time.sleep(0.02)
        assert beat.beats > paused_at  # alive again: beats again
    finally:
        beat.stop()


def test_a_store_gone_is_reported():
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    beat = JobStore(raw, token=TOKEN).heartbeat_sender(
        9, period=PERIOD, io_timeout=timedelta(milliseconds=300), python_grace=timedelta(seconds=30)
    )
    try:
        wait_for(lambda: beat.beats >= 2, "beats")
        assert beat.failing_for == 0.0 and beat.last_error == ""
        del raw  # the server goes with its last reference (the coordinator died)
        gc.collect()
        wait_for(lambda: beat.failing_for > 0.5, "the beats to fail")
        assert beat.last_error  # says why
    finally:
        beat.stop()


def test_bad_arguments_are_refused(store):
    with pytest.raises(RuntimeError, match="32-byte"):
        _C.NativeHeartbeatSender(
            host="127.0.0.1",
            port=29400,
            key="k",
            mac_key=b"short",
            member=1,
            period_s=0.1,
            io_timeout_s=1,
            python_grace_s=1,
        )
    with pytest.raises(RuntimeError, match="no etcd endpoint"):
        _C.NativeHeartbeatSender.on_etcd(
            endpoints=[],
            user="",
            password="",
            key="k",
            store_key="k",
            mac_key=b"k" * 32,
            member=1,
            period_s=0.1,
            io_timeout_s=1,
            python_grace_s=1,
        )
    with pytest.raises(RuntimeError, match="period must be > 0"):
        store.heartbeat_sender(1, period=timedelta(0), io_timeout=IO, python_grace=IO)


def test_on_etcd_a_lost_member_moves_the_beat_to_another(etcd_own):
    etcd = etcd_own  # it stops members: a cluster of its own
    store = JobStore(EtcdStore(etcd.config(namespace=f"{etcd.namespace}heartbeat/")), token=TOKEN)
    beat = store.heartbeat_sender(
        10, period=PERIOD, io_timeout=timedelta(milliseconds=500), python_grace=timedelta(seconds=30)
    )
    assert not isinstance(beat, ThreadHeartbeatSender)  # the native beat
    first = etcd.members[0]  # the beat starts with the first member
    try:
        wait_for(lambda: beat.beats >= 2, "beats")
        first.kill()
        before = beat.beats
        wait_for(lambda: beat.beats > before + 5, "beats through another member")
        assert store.get(keys.heartbeat(10)).beat >= before + 5
    finally:
        beat.stop()
        etcd.start(first)
        etcd.wait_member(first, timedelta(seconds=30))


@pytest.mark.skipif(not testetcd.available(), reason="etcd is not installed (make test installs etcd-server)")
def test_on_etcd_over_https_the_beat_is_a_python_thread(tmp_path):
    with EtcdCluster(addresses=["127.0.0.1"], tls=True) as etcd:
        store = JobStore(EtcdStore(etcd.config()), token=TOKEN)
        beat = store.heartbeat_sender(11, period=PERIOD, io_timeout=IO, python_grace=timedelta(seconds=30))
        try:
            assert isinstance(beat, ThreadHeartbeatSender) and isinstance(beat, HeartbeatSender)
            wait_for(lambda: beat.beats >= 3, "beats")
            assert store.get(keys.heartbeat(11)).beat >= 3
        finally:
            beat.stop()


def test_while_unanswered_the_store_takes_a_beat_each_store_period(store):
    """Aimed at an endpoint that never answers, the datagrams go on every beat and the store
    takes one beat each ``store_period`` once ``store_after`` passed (a coordinator's death
    sends every role's beats to the store at once: at every beat, 2,048 roles overran etcd)."""
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sink.setblocking(False)
    with pytest.raises(ValueError, match="at least the period"):
        store.heartbeat_sender(
            20, period=PERIOD, io_timeout=IO, python_grace=timedelta(seconds=30), store_period=PERIOD / 2
        )
    store_period = timedelta(milliseconds=400)
    beat = store.heartbeat_sender(
        20,
        period=PERIOD,
        io_timeout=IO,
        python_grace=timedelta(seconds=30),
        store_after=timedelta(milliseconds=100),
        store_period=store_period,
        liveness=sink.getsockname(),
    )
    seen, datagrams = set(), 0
    try:
        watched = Deadline.after(timedelta(seconds=2))
        while not watched.expired:
            beat.touch()
            value = store.get(keys.heartbeat(20))
            if value is not None:
                seen.add(value.beat)
            try:
                while sink.recv(4096):
                    datagrams += 1
            except BlockingIOError:
                pass
            time.sleep(0.01)
        beats = beat.beats
    finally:
        beat.stop()
        sink.close()
    assert beats >= 20, beats  # every 20 ms (fewer on a loaded machine)
    assert datagrams >= beats // 2, (datagrams, beats)  # each beat's datagram went out
    # At most one write each 400 ms in 2 s (at every beat it would have been ~100); at least two.
    assert 2 <= len(seen) <= 2 / store_period.total_seconds() + 1, sorted(seen)


def test_on_etcd_the_beat_writes_with_the_tokens_of_its_store(etcd):
    """The native beat starts with the simple tokens the role's store holds (etcd renews them
    as that store uses them) and authenticates nowhere: given a wrong password it still beats,
    where a beat without the tokens is refused (an authentication per role, all at once after
    a coordinator's death, held etcd for seconds)."""
    raw = EtcdStore(etcd.config(namespace=f"{etcd.namespace}heartbeat-tokens/"))
    store = JobStore(raw, token=TOKEN)
    store.put(keys.heartbeat(21), Heartbeat(member=21, beat=0))  # the store authenticates (its token)
    raw.config = dataclasses.replace(raw.config, password="not-the-password")  # what the beat is given
    beat = store.heartbeat_sender(21, period=PERIOD, io_timeout=IO, python_grace=timedelta(seconds=30))
    config = raw.config
    refused = _C.NativeHeartbeatSender.on_etcd(
        endpoints=list(config.endpoints),
        user=config.user,
        password=config.password,
        key="k",
        store_key=config.namespace + "k",
        mac_key=b"k" * 32,
        member=22,
        period_s=0.02,
        io_timeout_s=2,
        python_grace_s=30,
    )
    try:
        wait_for(lambda: beat.beats >= 3, "beats with the store's tokens")
        assert store.get(keys.heartbeat(21)).beat >= 3
        assert beat.failing_for == 0, beat.last_error
        wait_for(lambda: refused.failing_for > 0, "the beat without tokens refused")
        assert refused.beats == 0 and "refused the beat's user" in refused.last_error, refused.last_error
    finally:
        beat.stop()
        refused.stop()
