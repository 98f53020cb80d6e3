"""``EtcdStore``: the job store on an etcd cluster, for jobs on many hosts.

A ``torch.distributed.Store`` (used as the embedded ``TCPStore`` is) that speaks etcd's v3
HTTP/JSON gateway with the standard library (``etcd3`` fails to import with protobuf 7),
one keep-alive HTTP connection per thread and member.

What it adds over ``TCPStore``: the state survives the loss of any one host (a
3-member cluster keeps a quorum), etcd's users and roles authenticate every call
(TLS where certificates are given), compare-and-set is a transaction, and a
store can be fenced: its writes apply only while a key holds a given value (the
coordinator's claim, ``replica.roles.election``).

Every call has a deadline (``EtcdConfig.request_timeout``) and moves on to the next member
when one does not answer in time (a write to a lost leader hangs ~7 s otherwise). Retries are safe:
puts are idempotent, counters and
compare-and-set are transactions that compare revisions or values, and a retried
compare-and-set that already applied reads back its own value, which callers
take for success (``TCPStore.compare_set`` semantics). A cluster that answers on
no member for ``EtcdConfig.unreachable_after`` raises ``DistNetworkError``, as a
lost ``TCPStore`` does; waits that run out raise ``DistStoreError``.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import logging
import os
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from replica import envvars
from replica.errors import EtcdError, FencedError
from replica.jobstore.bounded import BoundedMap
from replica.jobstore.etcdwatch import WatchBroken, WatchStream
from replica.timing import Backoff, Deadline

__all__ = ["EtcdConfig", "EtcdStore", "parse_endpoints"]

logger = logging.getLogger(__name__)

# etcd's default --max-txn-ops: a transaction of more operations is refused ("too many
# operations in txn request"), so reads and writes of many keys go in chunks of it (a job
# of 256 ranks read 256 registrations in one).
_MAX_TXN_OPS = 128
_SCAN_FROM = 16  # a read of this many keys or more ranges over the prefix they share (``_scan``)
_SCAN_SLACK = 4  # while that prefix holds at most this many times as many keys
_COUNTERS_KEPT = 4096  # counters whose last value ``add`` remembers (and prefixes whose size ``_scan`` does)
_WATCH_TRUST = timedelta(seconds=1)  # a wait on a watch reads its keys at least this often anyway
_POLL_FIRST = timedelta(milliseconds=2)
_POLL_MOST = timedelta(milliseconds=20)
# A client's pauses between two rounds of its members while none answers.
_UNREACHABLE_FIRST = timedelta(milliseconds=50)
_UNREACHABLE_MOST = timedelta(milliseconds=500)


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """``h1:2379,h2:2379`` -> ((h1, 2379), (h2, 2379)); the port defaults to 2379."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "2379"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad etcd endpoint {item!r}: expected HOST[:PORT]")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoint given")
    return tuple(out)


@dataclass(kw_only=True, frozen=True, slots=True)
class EtcdConfig:
    """How to reach and authenticate to an etcd cluster. ``namespace`` prefixes every
    key (one cluster can hold many jobs). Without ``user`` the cluster must not have
    authentication enabled. ``ca_file`` (and ``cert_file``/``key_file`` for client
    certificates) switch to https."""

    endpoints: tuple[tuple[str, int], ...]
    namespace: str = "replica-job/"
    user: str = ""
    password: str = field(default="", repr=False)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    request_timeout: timedelta = timedelta(seconds=1)
    unreachable_after: timedelta = timedelta(seconds=10)
    timeout: timedelta = timedelta(seconds=60)  # blocking get/wait (torch's store timeout)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("EtcdConfig needs at least one endpoint")
        for name in ("request_timeout", "unreachable_after", "timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ValueError(f"EtcdConfig.{name} must be a positive timedelta, got {value!r}")
        if self.user and not self.password:
            raise ValueError(f"etcd user {self.user!r} needs a password")
        if (self.cert_file or self.key_file) and not self.ca_file:
            raise ValueError("client certificates need ca_file too (https)")

    @classmethod
    def from_environ(cls, endpoints: str, namespace: str = "", **overrides: Any) -> EtcdConfig:
        """Credentials from ``REPLICA_ETCD_USER`` / ``REPLICA_ETCD_PASSWORD`` and TLS files from
        ``REPLICA_ETCD_CA`` / ``REPLICA_ETCD_CERT`` / ``REPLICA_ETCD_KEY``."""
        env = os.environ
        return cls(
            endpoints=parse_endpoints(endpoints),
            namespace=namespace or "replica-job/",
            user=env.get(envvars.ETCD_USER, ""),
            password=env.get(envvars.ETCD_PASSWORD, ""),
            ca_file=env.get(envvars.ETCD_CA, ""),
            cert_file=env.get(envvars.ETCD_CERT, ""),
            key_file=env.get(envvars.ETCD_KEY, ""),
            **overrides,
        )

    @property
    def scheme(self) -> str:
        return "https" if self.ca_file else "http"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _bytes(value: str | bytes | list[int]) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class _Unavailable(Exception):
    """This member did not answer in time (or is down): try the next one."""


class _Client:
    """The gateway's HTTP calls over one thread's connections, member by member,
    each call under a deadline; authenticated per member (etcd's simple tokens are
    valid only on the member that issued them)."""

    def __init__(self, config: EtcdConfig):
        self.config = config
        self._local = threading.local()
        self._ssl: ssl.SSLContext | None = None
        if config.ca_file:
            self._ssl = ssl.create_default_context(cafile=config.ca_file)
            if config.cert_file:
                self._ssl.load_cert_chain(config.cert_file, config.key_file or None)
        self._tokens: dict[tuple[str, int], str] = {}
        self._tokens_lock = threading.Lock()
        self._member = 0  # the member that answered last: tried first

    def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``path`` on the first member that answers; EtcdError when
        etcd refuses it, DistNetworkError when no member answered for ``unreachable_after``."""
        deadline = Deadline.after(self.config.unreachable_after)
        n = len(self.config.endpoints)
        last: Exception | None = None
        backoff = Backoff(first=_UNREACHABLE_FIRST, most=_UNREACHABLE_MOST)
        while True:
            start = self._member
            for i in range(n):
                index = (start + i) % n
                try:
                    out = self._call_member(index, path, body)
                    self._member = index
                    return out
                except _Unavailable as exc:
                    last = exc
            if deadline.expired:
                raise dist.DistNetworkError(
                    f"no etcd member of {self._where()} answered within {self.config.unreachable_after}: {last}"
                )
            backoff.sleep(deadline=deadline)

    def _where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.config.endpoints)

    def _call_member(self, index: int, path: str, body: dict, *, retried: bool = False) -> dict:
        endpoint = self.config.endpoints[index]
        headers = {"Content-Type": "application/json"}
        if self.config.user and path != "/v3/auth/authenticate":
            headers["Authorization"] = self._token(index)
        status, reply = self._post(endpoint, path, json.dumps(body).encode(), headers)
        if status == 200:
            return reply
        error = str(reply.get("error") or reply.get("message") or reply)
        code = reply.get("code")
        if code == 16 and self.config.user and not retried:  # invalid auth token (expired, or another member's)
            with self._tokens_lock:
                self._tokens.pop(endpoint, None)
            return self._call_member(index, path, body, retried=True)
        if code in (14, 4) or status in (502, 503, 504):  # unavailable, deadline exceeded: leaderless, lost quorum
            raise _Unavailable(f"{endpoint[0]}:{endpoint[1]}: {error}")
        raise EtcdError(f"etcd refused {path}: {error}")

    def _token(self, index: int) -> str:
        endpoint = self.config.endpoints[index]
        with self._tokens_lock:
            token = self._tokens.get(endpoint)
        if token is None:
            reply = self._call_member(
                index, "/v3/auth/authenticate", {"name": self.config.user, "password": self.config.password}
            )
            token = str(reply["token"])
            with self._tokens_lock:
                self._tokens[endpoint] = token
        return token

    def tokens(self) -> tuple[int, list[str]]:
        """``EtcdStore.tokens``: the last member's token is made now if there is none."""
        if self.config.user:
            self._token(self._member)
        with self._tokens_lock:
            return self._member, [self._tokens.get(e, "") for e in self.config.endpoints]

    def _post(self, endpoint: tuple[str, int], path: str, body: bytes, headers: dict) -> tuple[int, dict]:
        conns: dict = self._local.__dict__.setdefault("conns", {})
        timeout = self.config.request_timeout.total_seconds()
        for attempt in (0, 1):  # a kept-alive connection the member closed meanwhile: once more on a new one
            conn = conns.get(endpoint)
            fresh = conn is None
            if conn is None:
                if self._ssl is not None:
                    conn = http.client.HTTPSConnection(*endpoint, timeout=timeout, context=self._ssl)
                else:
                    conn = http.client.HTTPConnection(*endpoint, timeout=timeout)
                conns[endpoint] = conn
            try:
                conn.request("POST", path, body, headers)
                response = conn.getresponse()
                data = response.read()
                status = response.status
            except ssl.SSLCertVerificationError as exc:  # not a member that is down: a wrong CA or address
                conn.close()
                conns.pop(endpoint, None)
                raise EtcdError(
                    f"{endpoint[0]}:{endpoint[1]}: its certificate does not verify against "
                    f"{self.config.ca_file}: {exc.verify_message}"
                ) from None
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                conns.pop(endpoint, None)
                if fresh or attempt or isinstance(exc, TimeoutError):
                    raise _Unavailable(f"{endpoint[0]}:{endpoint[1]}: {exc!r}") from None
                continue
            try:
                return status, json.loads(data) if data else {}
            except ValueError:
                raise _Unavailable(f"{endpoint[0]}:{endpoint[1]}: not JSON (HTTP {status})") from None
        raise AssertionError("unreachable")

    def watch(self, body: dict) -> WatchStream:
        """A watch stream (``POST /v3/watch`` with ``body``) on the member that answered
        last, else the next one that accepts it; WatchBroken when none did."""
        n = len(self.config.endpoints)
        last: Exception | None = None
        for i in range(n):
            index = (self._member + i) % n
            try:
                headers = {"Authorization": self._token(index)} if self.config.user else {}
                return WatchStream(
                    self.config.endpoints[index],
                    "/v3/watch",
                    body,
                    headers=headers,
                    ssl_context=self._ssl,
                    timeout=self.config.request_timeout,
                )
            except (WatchBroken, _Unavailable, EtcdError) as exc:
                last = exc
        raise WatchBroken(f"no etcd member of {self._where()} took a watch: {last}")

    def close(self) -> None:
        for conn in self._local.__dict__.get("conns", {}).values():
            conn.close()


@dataclasses.dataclass(kw_only=True, slots=True)
class _HeldWatch:
    """A thread's open watch (``EtcdStore.wait``): of which keys, its stream, and when to
    read the keys again whatever it says (``_WATCH_TRUST``, or at once after an event)."""

    names: tuple[str, ...]
    stream: WatchStream
    read_by: Deadline


class EtcdStore(Store):
    """A ``torch.distributed.Store`` on etcd (see the module's docstring). Thread-safe:
    each thread has connections of its own, so a thread's blocking wait never holds
    another's.

    ``fence=(key, value)`` makes every write of this store apply only while ``key``
    holds ``value`` (a leader's claim), in the same transaction: once another process
    took the claim, writes raise ``FencedError`` and change nothing."""

    timeout: timedelta  # the binding's Store.timeout (set by set_timeout), which torch's stub lacks

    def __init__(self, config: EtcdConfig, *, fence: tuple[str, bytes] | None = None):
        super().__init__()
        self.config = config
        self._client = _Client(config)
        self._watching = threading.local()  # each thread's open watch (``wait``): its keys and stream
        # counter -> (mod revision, value) written last (``add``); how many keys a prefix held at its last scan
        self._counters: BoundedMap[str, tuple[str, int]] = BoundedMap(_COUNTERS_KEPT)
        self._prefix_sizes: BoundedMap[bytes, int] = BoundedMap(_COUNTERS_KEPT)
        self._ns = config.namespace.encode()
        self.set_timeout(config.timeout)
        self.fence = fence

    def __repr__(self) -> str:  # never the password
        return f"EtcdStore({self._client._where()}, namespace={self.config.namespace!r})"

    def tokens(self) -> tuple[int, list[str]]:
        """The member this store talks to and its simple token for each member ('' where none),
        for a native beat to write with, not authenticating (a bcrypt hash on the member: all
        roles' at once, after a coordinator's death, held etcd for seconds); valid while this
        store uses them (etcd renews a token on each use)."""
        return self._client.tokens()

    def fenced(self, key: str, value: bytes) -> EtcdStore:
        """The same store, its writes fenced by ``key`` holding ``value``."""
        return EtcdStore(self.config, fence=(key, value))

    def _key(self, key: str | bytes) -> str:
        return _b64(self._ns + _bytes(key))

    def _txn(self, compare: list[dict], success: list[dict], failure: Sequence[dict] = ()) -> dict:
        """One transaction, under the fence if there is one (FencedError when it no longer holds)."""
        if self.fence is None:
            return self._client.call("/v3/kv/txn", {"compare": compare, "success": success, "failure": list(failure)})
        key, value = self.fence
        guard = self._holds(key, value)
        reply = self._client.call(
            "/v3/kv/txn",
            {
                "compare": [guard, *compare],
                "success": success,
                "failure": [*failure, {"request_range": {"key": self._key(key)}}],
            },
        )
        if not reply.get("succeeded"):
            kvs = reply["responses"][-1]["response_range"].get("kvs") or []
            if not kvs or _unb64(kvs[0].get("value")) != value:
                raise FencedError(f"{key} changed hands: this process no longer leads, and wrote nothing")
        return reply

    def _absent(self, key: str) -> dict:
        """A transaction's comparison: ``key`` does not exist."""
        return {"key": self._key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}

    def _holds(self, key: str, value: bytes) -> dict:
        """A transaction's comparison: ``key`` holds ``value``."""
        return {"key": self._key(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)}

    def _put(self, key: str, value: bytes) -> dict:
        return {"request_put": {"key": self._key(key), "value": _b64(value)}}

    # --- torch.distributed.Store ---

    def set(self, key: str, value: str | bytes) -> None:
        if self.fence is None:
            self._client.call("/v3/kv/put", {"key": self._key(key), "value": _b64(_bytes(value))})
        else:
            self._txn([], [self._put(key, _bytes(value))])

    def get(self, key: str) -> bytes:
        """Blocks until ``key`` exists (the store's timeout), as ``TCPStore.get`` does."""
        value = self._range(key)
        if value is None:
            self.wait([key], self.timeout)
            value = self._range(key)
            if value is None:
                raise dist.DistStoreError(f"{key} vanished while it was read")
        return value

    def add(self, key: str, amount: int) -> int:
        """One transaction on a guess of the counter's value (absent for a counter this
        store has not seen: the commit's counters are new each step), which reads it back
        when the guess was wrong; the next try goes on what it read. A read, then a
        transaction, was two requests for every add, and a commit's chain has two adds."""
        seen = self._counters.get(key)
        while True:
            if seen is None:
                compare, now = self._absent(key), amount
            else:
                compare = {"key": self._key(key), "target": "MOD", "result": "EQUAL", "mod_revision": seen[0]}
                now = seen[1] + amount
            reply = self._txn(
                [compare], [self._put(key, str(now).encode())], [{"request_range": {"key": self._key(key)}}]
            )
            if reply.get("succeeded"):
                self._remember(key, (str(_revision(reply)), now))
                return now
            kvs = reply["responses"][0]["response_range"].get("kvs") or []
            seen = (kvs[0]["mod_revision"], int(_unb64(kvs[0].get("value")) or b"0")) if kvs else None

    def _remember(self, key: str, counter: tuple[str, int]) -> None:
        """What this store last wrote to counter ``key`` (its mod revision and value)."""
        self._counters.put(key, counter)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """``TCPStore.compare_set``: write ``desired`` if ``key`` holds ``expected`` (empty:
        is absent); returns what it holds after (``expected`` when absent and expected was not)."""
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        compare = self._holds(key, expected_b) if expected_b else self._absent(key)
        reply = self._txn([compare], [self._put(key, desired_b)], [{"request_range": {"key": self._key(key)}}])
        if reply.get("succeeded"):
            return desired_b
        kvs = reply["responses"][0]["response_range"].get("kvs") or []
        return _unb64(kvs[0].get("value")) if kvs else expected_b

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self._range_many(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key of ``keys`` exists. On an etcd watch of them (the range from
        the least to the greatest), woken by their writes, not a poll: a commit's waiters
        polled every 20 ms, 800 reads a second from 16 of them, and a wake came 10 ms late
        on average. The watch outlives a wait that timed out: a caller that waits in slices
        (``JobStore.wait_for``) asks nothing of etcd between writes. The keys are read
        again at least every ``_WATCH_TRUST`` (a member cut off from its leader sends no
        events), and a wait falls back to polling while no watch can be opened."""
        timeout = self.timeout if timeout is None else timeout
        deadline = Deadline.after(timeout)
        names = tuple(keys)
        held = getattr(self._watching, "held", None)
        if held is not None and held.names != names:
            self._unwatch()
            held = None
        while True:
            if held is None or held.read_by.expired:
                values, revision = self._read(list(names))
                if all(v is not None for v in values):
                    self._unwatch()
                    return
                held = self._watch(names, revision + 1, held)
            if held is None:
                self._poll(names, deadline, timeout)
                return
            try:
                message = held.stream.next(min(deadline, held.read_by))
            except WatchBroken as exc:
                logger.debug("the watch of %s broke: %s", names, exc)
                self._unwatch()
                held = None
                continue
            if message is None:
                if deadline.expired:
                    raise dist.DistStoreError(f"wait for {keys} timed out after {timeout}")
                continue  # time to read the keys again
            result = message.get("result") or {}
            if message.get("error") or result.get("canceled"):  # refused, or compacted past its revision
                logger.debug("the watch of %s ended: %s", names, message)
                self._unwatch()
                held = None
            elif result.get("events"):
                if len(names) == 1 and any(e.get("type", "PUT") == "PUT" for e in result["events"]):
                    self._unwatch()  # the one key was written: no read to learn it exists
                    return
                held.read_by = Deadline.now()  # a key of the range changed: read them now

    def _watch(self, names: tuple[str, ...], revision: int, held: _HeldWatch | None) -> _HeldWatch | None:
        """The thread's watch of ``names`` (opened from ``revision``, or the one it has),
        with when to read the keys again; None when no member took a watch."""
        trust = Deadline.after(_WATCH_TRUST)
        if held is not None:
            held.read_by = trust
            self._watching.held = held
            return held
        first, last = self._ns + _bytes(min(names)), self._ns + _bytes(max(names))
        request = {"key": _b64(first), "start_revision": str(revision)}
        if last != first:
            request["range_end"] = _b64(last + b"\0")
        try:
            stream = self._client.watch({"create_request": request})
        except WatchBroken as exc:
            logger.debug("no watch of %s: %s", names, exc)
            return None
        self._watching.held = held = _HeldWatch(names=names, stream=stream, read_by=trust)
        return held

    def _unwatch(self) -> None:
        held = getattr(self._watching, "held", None)
        if held is not None:
            held.stream.close()
            self._watching.held = None

    def _poll(self, names: tuple[str, ...], deadline: Deadline, timeout: timedelta) -> None:
        backoff = Backoff(first=_POLL_FIRST, most=_POLL_MOST)
        while not self.check(list(names)):
            if deadline.expired:
                raise dist.DistStoreError(f"wait for {list(names)} timed out after {timeout}")
            backoff.sleep(deadline=deadline)

    def delete_key(self, key: str) -> bool:
        reply = self._txn([], [{"request_delete_range": {"key": self._key(key)}}])
        return int(reply["responses"][0]["response_delete_range"].get("deleted", 0)) > 0

    def num_keys(self) -> int:
        reply = self._client.call(
            "/v3/kv/range", {"key": _b64(self._ns), "range_end": _b64(_prefix_end(self._ns)), "count_only": True}
        )
        return int(reply.get("count", 0))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._range_many(keys)
        if any(v is None for v in values):
            self.wait(keys, self.timeout)
            values = self._range_many(keys)
        return [v if v is not None else b"" for v in values]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """One transaction per ``_MAX_TXN_OPS`` keys (atomic within each, not across)."""
        puts = [self._put(k, _bytes(v)) for k, v in zip(keys, values, strict=True)]
        for at in range(0, len(puts), _MAX_TXN_OPS):
            self._txn([], puts[at : at + _MAX_TXN_OPS])

    # --- etcd's own ---

    def read(self, keys: list[str]) -> list[bytes | None]:
        """The values of ``keys`` (None: absent), in one linearizable read, without waiting."""
        return self._range_many(keys)

    def remove(self, key: str, expected: bytes) -> bool:
        """Delete ``key`` if it holds ``expected``; True when deleted."""
        compare = self._holds(key, expected)
        return bool(self._txn([compare], [{"request_delete_range": {"key": self._key(key)}}]).get("succeeded"))

    def close(self) -> None:
        """Close the calling thread's connections and its watch."""
        self._unwatch()
        self._client.close()

    def _kv(self, key: str) -> dict | None:
        kvs = self._client.call("/v3/kv/range", {"key": self._key(key)}).get("kvs") or []
        return kvs[0] if kvs else None

    def _range(self, key: str) -> bytes | None:
        kv = self._kv(key)
        return None if kv is None else _unb64(kv.get("value"))

    def get_present(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value, None where it does not exist, in one transaction per
        ``_MAX_TXN_OPS`` keys (``multi_get`` waits for absent keys, as a TCPStore's does)."""
        return self._range_many(keys)

    def _range_many(self, keys: list[str]) -> list[bytes | None]:
        return self._read(keys)[0]

    def _read(self, keys: list[str]) -> tuple[list[bytes | None], int]:
        """``keys``' values (None: absent) and a revision they were all read at or after."""
        if len(keys) == 1:
            reply = self._client.call("/v3/kv/range", {"key": self._key(keys[0])})
            kvs = reply.get("kvs") or []
            return [_unb64(kvs[0].get("value")) if kvs else None], _revision(reply)
        if len(keys) >= _SCAN_FROM:
            scanned = self._scan(keys)
            if scanned is not None:
                return scanned
        out: list[bytes | None] = []
        revision = None
        for at in range(0, len(keys), _MAX_TXN_OPS):  # etcd refuses a transaction of more operations
            reply = self._client.call(
                "/v3/kv/txn",
                {"success": [{"request_range": {"key": self._key(k)}} for k in keys[at : at + _MAX_TXN_OPS]]},
            )
            revision = _revision(reply) if revision is None else min(revision, _revision(reply))
            for response in reply.get("responses", []):
                kvs = response["response_range"].get("kvs") or []
                out.append(_unb64(kvs[0].get("value")) if kvs else None)
        return out, revision or 0

    def _scan(self, keys: list[str]) -> tuple[list[bytes | None], int] | None:
        """``keys``' values from one range over the prefix they share (one request where
        the transactions of point reads take one per ``_MAX_TXN_OPS`` keys: 1,024 ranks'
        acks were 8 requests in a row, 48 ms where the range takes 14), or None when they
        share no prefix beyond the namespace or the prefix holds many more keys
        (``_SCAN_SLACK``): read them key by key."""
        names = [self._ns + _bytes(k) for k in keys]
        prefix = os.path.commonprefix(names) or b""  # ('' when there are no keys)
        if len(prefix) <= len(self._ns) or self._prefix_sizes.get(prefix, 0) > _SCAN_SLACK * len(keys):
            return None  # (a prefix known to hold many more: a commit's group of 32 ranks among 1,024)
        reply = self._client.call(
            "/v3/kv/range",
            {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)), "limit": str(_SCAN_SLACK * len(keys))},
        )
        self._prefix_sizes.put(prefix, int(reply.get("count") or 0))  # every key in the range, beyond the limit too
        if reply.get("more"):
            return None
        held = {_unb64(kv["key"]): _unb64(kv.get("value")) for kv in reply.get("kvs") or []}
        return [held.get(name) for name in names], _revision(reply)


def _revision(reply: dict) -> int:
    """The store's revision a reply was read at."""
    return int((reply.get("header") or {}).get("revision") or 0)


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    head = bytearray(prefix)
    while head and head[-1] == 0xFF:
        head.pop()
    if not head:
        return b"\0"
    head[-1] += 1
    return bytes(head)
