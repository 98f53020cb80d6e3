"""The job's control state: every key any role or the library reads or writes
in the job store, with its typed value, and the ``JobStore`` that signs and
verifies them.

The store (a torch.distributed ``TCPStore``, later etcd) has no authentication of
its own: anyone who reaches its port can write any key. So every value a role
acts on is signed: HMAC-SHA256 under a key derived from the job token, over the
full key and the value (which carries its epoch where it has one). A value that
fails verification, or does not parse, is ignored and logged (which key, never
the token): readers see it as absent, and a writer replaces it. Only plain
counters (``JobStore.count``) are unsigned: they allocate numbers (join
requests, request ids) and carry nothing a role trusts.

Keys, under ``Config.store_prefix`` (default ``replica``), are built by the
functions below and nowhere else. Values are frozen dataclasses encoded as JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# TCPStore is torch.distributed's documented API, but torch/distributed/__init__.py imports it from the
# private torch._C._distributed_c10d without re-exporting it (no alias, no __all__): pyright calls it private.
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]
from torch.distributed.distributed_c10d import PrefixStore, Store

from replica import _C
from replica.errors import JobStateError, StoreWaitTimeoutError
from replica.jobstore.bounded import BoundedMap
from replica.jobstore.codec import T, decode_value, encode_value
from replica.jobstore.etcd import EtcdStore
from replica.jobstore.heartbeat import HeartbeatSender, ThreadHeartbeatSender
from replica.jobstore.keys import Key, attempt_prefix, keys
from replica.timing import Backoff, Deadline, pause

__all__ = ["JobStore"]

logger = logging.getLogger(__name__)


_MAC_HEX = 64
_VERIFIED_KEPT = 16384  # verified values remembered: a job's registrations and a step's acks
_LOGGED_KEPT = 4096  # bad values remembered as logged already (each is logged once)
_POLL_FIRST = timedelta(microseconds=50)  # a poll's first pause, doubling up to _POLL_MOST
_POLL_MOST = timedelta(milliseconds=2)
_BLOCK_SLICE = timedelta(milliseconds=50)  # a wait with abort() or a period blocks in the store this long at a time
_BLOCK_LEAST = timedelta(milliseconds=1)

# What JobStore.read expects and would write in its compare-and-set, never a value the
# store holds (values are signed JSON): the answer when the key is absent.
_ABSENT = b"\x00replica:absent\x00"

_KEY_LABEL = b"replica job store v1"


def _quietly_timed(raw: Store) -> bool:
    """Whether a wait on ``raw`` may time out every ``_BLOCK_SLICE`` without a trace: etcd's
    (a poll of its own, every 20 ms at most), not a TCPStore's (each wait that times out logs
    two warnings from torch's C++, which no Python call silences: its waiters check instead)."""
    return isinstance(getattr(raw, "inner", raw), EtcdStore)


class JobStore:
    """A torch.distributed ``Store`` seen through the schema: values are signed on
    write and verified on read; the prefix is applied here and nowhere else.

    Reads never raise on what is in the store: a forged, unsigned or malformed
    value is logged (once per key and value) and read as absent. Waits have
    deadlines. Thread-safe as far as the underlying store client is; give a
    thread that must never wait behind another (heartbeats) a store of its own
    (``reconnect``)."""

    def __init__(self, store: Store, *, token: bytes, prefix: str = "replica"):
        if not isinstance(token, bytes) or not token:
            raise ValueError("the job store needs the job's token")
        self.raw = store
        self.prefix = prefix
        self._mac_key = hmac.new(token, _KEY_LABEL, hashlib.sha256).digest()
        self._token = token
        self._logged: BoundedMap[tuple[str, bytes], None] = BoundedMap(_LOGGED_KEPT)
        # Values verified here, by key and signed bytes (a signature covers both, and the job's key
        # does not change): the registrations every commit's raise reads again, unchanged, are
        # verified once, not at each raise (1,024 ranks: half of the raise's 40 ms of verifying).
        # Values are frozen records, shared safely.
        self._verified: BoundedMap[tuple[str, bytes], Any] = BoundedMap(_VERIFIED_KEPT)
        self._local = threading.local()  # each thread's own connection (``own``)

    @classmethod
    def of(cls, store: Store | JobStore, *, token: bytes, prefix: str = "replica") -> JobStore:
        """``store`` itself if it is a JobStore already, else a view of it."""
        return store if isinstance(store, JobStore) else cls(store, token=token, prefix=prefix)

    def __repr__(self) -> str:  # never the token
        return f"JobStore(prefix={self.prefix!r})"

    @property
    def job(self) -> str:
        """Which job this is (its token and prefix), as a name that reveals neither: what
        per-job state in a process is keyed by (``replica.jobstore.commit.hint_generation``)."""
        return hmac.new(self._mac_key, b"job\0" + self.prefix.encode(), hashlib.sha256).hexdigest()[:32]

    def reconnect(self, timeout: timedelta) -> JobStore:
        """The same job store on a connection of its own (a ``TCPStore`` client, or an
        ``EtcdStore`` whose calls time out after ``timeout``)."""
        if isinstance(self.raw, EtcdStore):
            config = dataclasses.replace(self.raw.config, request_timeout=timeout, unreachable_after=timeout)
            return self._view(EtcdStore(config, fence=self.raw.fence))
        tcp = self._tcp()
        return self._view(TCPStore(tcp.host, tcp.port, is_master=False, timeout=timeout))

    def heartbeat_sender(
        self,
        member: int,
        *,
        period: timedelta,
        io_timeout: timedelta,
        python_grace: timedelta,
        store_after: timedelta = timedelta(seconds=1),
        liveness: tuple[str, int] | None = None,
        store_period: timedelta | None = None,
    ) -> HeartbeatSender:
        """Start writing ``Heartbeat(member, beat)`` with a rising ``beat`` every ``period``
        from a native thread on a TCP connection of its own (TCPStore only), signed as
        ``put`` signs: it needs no GIL, so a main thread busy in Python does not delay
        it. It beats while ``touch()`` was called within ``python_grace`` (a hung
        interpreter is a dead role); ``stop()`` ends it. Returns the sender, a
        ``replica._C.NativeHeartbeatSender`` (``HeartbeatSender`` says what every kind has).

        ``aim(host, port)`` sends the beats to the coordinator's liveness endpoint
        (``liveness_server``, one UDP datagram each, the same signed value) instead of the
        store, which then takes them only while no answer came for ``store_after``, one each
        ``store_period`` (default: every beat) while the datagrams go on every ``period``;
        each answer carries the job's generation number (``generation``, ``reply_age``).
        ``liveness``: aimed there from the first beat.

        On etcd the native thread speaks the members' HTTP gateway; over https
        (``EtcdConfig.ca_file``) the beat comes from a Python thread with the same
        contract (``ThreadHeartbeatSender``), which waits for the GIL behind a busy main thread
        and writes to the store only."""
        if isinstance(self.raw, EtcdStore) and self.raw.config.ca_file:
            return ThreadHeartbeatSender(self.reconnect(io_timeout), member, period=period, python_grace=python_grace)
        options = {"liveness_host": liveness[0], "liveness_port": liveness[1]} if liveness is not None else {}
        if store_period is not None:
            if store_period < period:
                raise ValueError(f"store_period ({store_period}) must be at least the period ({period})")
            options["store_period_s"] = store_period.total_seconds()
        if isinstance(self.raw, EtcdStore):
            config, full = self.raw.config, self.full(keys.heartbeat(member))
            first, tokens = self.raw.tokens()
            return _C.NativeHeartbeatSender.on_etcd(
                endpoints=list(config.endpoints),
                user=config.user,
                password=config.password,
                tokens=tokens,
                first=first,
                key=full,
                store_key=config.namespace + full,
                mac_key=self._mac_key,
                member=member,
                period_s=period.total_seconds(),
                io_timeout_s=io_timeout.total_seconds(),
                python_grace_s=python_grace.total_seconds(),
                store_after_s=store_after.total_seconds(),
                **options,
            )
        tcp = self._tcp()
        return _C.NativeHeartbeatSender(
            host=tcp.host,
            port=tcp.port,
            key=self.full(keys.heartbeat(member)),
            mac_key=self._mac_key,
            member=member,
            period_s=period.total_seconds(),
            io_timeout_s=io_timeout.total_seconds(),
            python_grace_s=python_grace.total_seconds(),
            store_after_s=store_after.total_seconds(),
            **options,
        )

    def _tcp(self) -> TCPStore:
        """The store as the TCPStore client it is when it is no EtcdStore: its address, to
        connect to again (``reconnect``, the native beat's own connection)."""
        if not isinstance(self.raw, TCPStore):
            raise TypeError(f"{type(self.raw).__name__} has no address to connect to again")
        return self.raw

    def liveness_server(self, host: str, port: int = 0):
        """The coordinator's liveness endpoint: a native thread on a UDP socket bound to
        ``host:port`` (0: any free port) that verifies each role's beat (the value
        ``heartbeat_sender`` signs), keeps when each member's beat last rose (``ages``,
        ``beats``) and answers it with the generation number set by ``set_generation``.
        Returns the ``replica._C.LivenessServer``; ``stop()`` ends it."""
        return _C.LivenessServer(host=host, port=port, prefix=self.prefix, mac_key=self._mac_key)

    def full(self, key: Key | str) -> str:
        return f"{self.prefix}/{key}"

    def attempt(self, number: int) -> JobStore:
        """The store of the job's attempt ``number`` (``attempt_prefix``) on this connection;
        this store must be at the job's own prefix (attempt 0's)."""
        view = self._view(self.raw)
        view.prefix = attempt_prefix(self.prefix, number)
        view._logged, view._verified = BoundedMap(_LOGGED_KEPT), BoundedMap(_VERIFIED_KEPT)
        return view

    def sub(self, name: str) -> Store:
        """A raw store under ``{prefix}/{name}`` for torch's own rendezvous (unsigned)."""
        return PrefixStore(self.full(name), self.raw)

    # signing

    def sign(self, key: Key[T], value: T) -> bytes:
        if not isinstance(value, key.value):
            raise TypeError(f"{key.path} holds {key.value.__name__}, not {type(value).__name__}")
        body = encode_value(value)
        return body + b"\n" + self._mac(key, body).encode()

    def verify(self, key: Key[T], raw: bytes) -> T:
        """The value ``raw`` holds under ``key``; JobStateError if unsigned, forged or malformed.
        A value verified before under the same key is not verified again (``_verified``)."""
        known = self._verified.get((key.path, raw))
        if known is not None:
            return known
        body, sep, mac = raw.rpartition(b"\n")
        if not sep or len(mac) != _MAC_HEX:
            raise JobStateError(f"{self.full(key)} is not signed")
        if not hmac.compare_digest(mac.decode("ascii", "replace"), self._mac(key, body)):
            raise JobStateError(f"{self.full(key)} carries a wrong signature")
        value = decode_value(key.value, body)
        self._verified.put((key.path, raw), value)
        return value

    def _mac(self, key: Key, body: bytes) -> str:
        return hmac.digest(self._mac_key, self.full(key).encode() + b"\0" + body, "sha256").hex()

    def _ignored(self, key: Key, raw: bytes, exc: JobStateError) -> None:
        if self._logged.first_time((key.path, raw)):
            logger.warning("ignored a value of %s in the job store: %s", self.full(key), exc)

    # typed access

    def put(self, key: Key[T], value: T) -> None:
        # (torch's stub types values as str; the binding takes bytes, as every store here stores them)
        self.raw.set(self.full(key), self.sign(key, value))  # pyright: ignore[reportArgumentType]

    def read(self, key: Key[T]) -> tuple[T | None, bytes | None]:
        """(verified value or None, raw bytes or None when absent). One request: a
        compare-and-set that can never write (``_ABSENT`` is no signed value) answers
        with the value, or with ``_ABSENT`` when there is none (a ``get`` of a missing
        key blocks, so a read was a ``check`` and a ``get``: two requests)."""
        raw = self.read_raw(self.full(key))
        if raw is None:
            return None, None
        try:
            return self.verify(key, raw), raw
        except JobStateError as exc:
            self._ignored(key, raw, exc)
            return None, raw

    def read_raw(self, name: str) -> bytes | None:
        """The bytes under the full key ``name`` as they are (unverified: a plain counter,
        a join request signed its own way), or None when absent; one request (``read``)."""
        raw = self.raw.compare_set(name, _ABSENT, _ABSENT)  # pyright: ignore[reportArgumentType] (as in put)
        return None if raw == _ABSENT else raw

    def get(self, key: Key[T]) -> T | None:
        """The verified value under ``key``, or None (absent, or not trustworthy: logged)."""
        return self.read(key)[0]

    @property
    def reads_absent_together(self) -> bool:
        """Whether ``get_many`` reads keys that may be absent in a few requests (etcd), not
        one request each once any is absent (a TCPStore: its multi-get waits for every key)."""
        return getattr(self.raw, "get_present", None) is not None

    def read_raw_many(self, names: Sequence[str]) -> list[bytes | None]:
        """``read_raw`` of each full key in ``names``: in a few requests on etcd (absent keys
        too, in one range each 128), in one on a TCPStore when every key is present (its
        multi-get waits for absent ones), else one each."""
        names = list(names)
        present = getattr(self.raw, "get_present", None)
        if present is not None:
            return list(present(names))
        if not self.raw.check(names):
            return [self.read_raw(name) for name in names]
        return list(self.raw.multi_get(names))

    def get_many(self, keys_: Sequence[Key[T]]) -> list[T | None]:
        values = self.read_raw_many([self.full(k) for k in keys_]) if keys_ else []
        out: list[T | None] = []
        for key, raw in zip(keys_, values, strict=False):
            if raw is None:
                out.append(None)
                continue
            try:
                out.append(self.verify(key, raw))
            except JobStateError as exc:
                self._ignored(key, raw, exc)
                out.append(None)
        return out

    def has(self, key: Key) -> bool:
        """True when ``key`` holds a verified value."""
        return self.get(key) is not None

    def delete(self, key: Key) -> None:
        self.raw.delete_key(self.full(key))

    def compare_set(self, key: Key[T], expected: bytes | None, value: T) -> tuple[T | None, bytes]:
        """Write ``value`` if ``key`` still holds ``expected`` (raw bytes as read; None:
        absent); returns what it holds after, verified (None if not trustworthy) and raw."""
        new = self.sign(key, value)
        expected_raw = b"" if expected is None else expected
        raw = self.raw.compare_set(self.full(key), expected_raw, new)  # pyright: ignore[reportArgumentType] (as in put)
        if raw == new:
            return value, raw
        try:
            return self.verify(key, raw), raw
        except JobStateError as exc:
            self._ignored(key, raw, exc)
            return None, raw

    def wait(self, key: Key[T], timeout: timedelta, *, what: str | None = None) -> T:
        """Block until ``key`` holds a verified value; StoreWaitTimeoutError after ``timeout``.
        Blocks in the store, on the calling thread's own connection (``wait_for``)."""
        return self.wait_for(
            lambda store: store.get(key), wake=lambda: [key], timeout=timeout, what=what or self.full(key)
        )

    def wait_for(
        self,
        ready: Callable[[JobStore], T | None],
        *,
        wake: Callable[[], Sequence[Key | str]],
        timeout: timedelta,
        what: str,
        abort: Callable[[], None] | None = None,
        every: timedelta | None = None,
        poll: timedelta = _POLL_MOST,
        quiet: Callable[[], bool] | None = None,
        quiet_every: timedelta | None = None,
    ) -> T:
        """Wait until ``ready(store)`` returns something other than None, and return it.

        ``wake()`` names the keys whose existence announces that ``ready`` may have
        changed (a new generation's ``failover/{g}``, a step's ``commit_reached``
        marker): a hint only, never trusted, since ``ready`` reads the signed values.
        Every store call of the wait goes over the calling thread's own connection
        (``own``), so a wait never holds a connection another thread is using (a
        heartbeat behind a blocking wait was a false death).

        Without ``abort`` and ``every`` the wait blocks in the store until the wake
        keys exist. With ``abort()`` (called between looks; it raises to end the wait)
        or ``every`` (evaluate ``ready`` at least this often: for what no key
        announces) it blocks in slices of at most 50 ms on etcd, and on a TCPStore
        checks the wake keys' existence, pausing up to ``poll`` in between. While the wake keys exist but
        ``ready`` still says no (a key written ahead of its value, or forged), and
        with no wake keys at all, ``ready`` itself is polled, pausing up to ``poll``. StoreWaitTimeoutError
        after ``timeout``; a store error (the store gone) is raised as it is.

        ``quiet()``: True while something other than the store vouches that nothing the
        wake keys announce happened (a fresh liveness answer with an unchanged generation
        number): the wake keys are then not asked, and ``ready`` is evaluated every
        ``quiet_every`` (``every`` if None) only, so a long wait costs the store almost
        nothing."""
        own = self.own()
        deadline = Deadline.after(timeout)
        blocking = abort is None and every is None
        polls = Backoff(first=min(_POLL_FIRST, poll), most=poll)
        woken, evaluated = True, Deadline.now()  # ready() is evaluated first
        while True:
            hushed = quiet is not None and quiet()
            period = quiet_every if hushed and quiet_every is not None else every
            if woken or (period is not None and (evaluated + period).expired):
                value = ready(own)
                if value is not None:
                    return value
                evaluated = Deadline.now()
            if abort is not None:
                abort()
            left = deadline.remaining()
            if left <= timedelta(0):
                raise StoreWaitTimeoutError(f"no {what} within {timeout}")
            if hushed:
                pause(min(poll, left))
                woken = False
                continue
            names = [self.full(k) for k in wake()]
            if blocking and names and not own.raw.check(names):
                woken = own._block(names, left)
                polls.reset()
                continue
            if names and not woken and _quietly_timed(own.raw):
                # The keys were absent at the last look: block on them in the store, a slice at a
                # time (abort() and ready() between slices), not a check every few ms (N trainers
                # each checking 500 times a second while they wait for a commit: 256 of them
                # waiting on etcd put its commit a second behind the last ack).
                due = left if period is None else (evaluated + period).remaining()
                woken = own._block(names, max(_BLOCK_LEAST, min(left, _BLOCK_SLICE, due)))
                polls.reset()
                continue
            polls.sleep(deadline=deadline)
            woken = not names or own.raw.check(names)

    def own(self) -> JobStore:
        """This job store on the calling thread's own connection (``TCPStore.clone``),
        made at its first use in the thread. A store without connections (``HashStore``,
        in-process, whose waits hold no lock) is shared as it is."""
        own = getattr(self._local, "store", None)
        if own is None:
            # (a client that wraps a TCPStore, counting or tracing its requests, says so: clone_per_thread)
            connects = isinstance(self.raw, TCPStore) or getattr(self.raw, "clone_per_thread", False)
            # (torch's stub lacks Store.clone, which the binding has)
            raw = self.raw.clone() if connects else self.raw  # pyright: ignore[reportAttributeAccessIssue]
            own = self._local.store = self if raw is self.raw else self._view(raw)
        return own

    def on(self, raw: Store) -> JobStore:
        """The same job (token, prefix) over another client of its store (a fenced one)."""
        return self._view(raw)

    def _view(self, raw: Store) -> JobStore:
        """The same job (key, prefix, log of ignored values) over another client."""
        view = object.__new__(JobStore)
        view.raw, view.prefix, view._mac_key, view._token = raw, self.prefix, self._mac_key, self._token
        view._logged, view._verified = self._logged, self._verified
        view._local = threading.local()
        view._local.store = view
        return view

    def _block(self, names: list[str], timeout: timedelta) -> bool:
        """Block until every key of ``names`` exists; False when ``timeout`` passed first."""
        try:
            self.raw.wait(names, timeout)
            return True
        except dist.DistStoreError:  # the wait timed out (a lost store is a DistNetworkError)
            return False

    # unsigned counters

    def count(self, name: str, add: int = 0) -> int:
        """Add to a plain counter (``keys.join_seq()`` ...) and return it."""
        return self.raw.add(self.full(name), add)
