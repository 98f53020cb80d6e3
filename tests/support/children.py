"""Helpers for multi-process tests: children forked from a server that imported torch
once (the state of a fresh interpreter, without its 1.5-2 s of imports each) that forward
their tracebacks, can be killed or frozen, and are always cleaned up."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import threading
import traceback
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Callable, Iterator
from typing import Any

import torch

from replica.processes import SERVER, Inherited
from replica.timing import Deadline

__all__ = ["BusyCores", "Child", "ChildFailed", "CountingStore", "RawUcx", "TornDown", "busy_cores", "cpu_seconds",
           "cpu_since", "descendants", "free_port", "process_state", "receive_bucketed", "role_of", "send_bucketed",
           "spawn", "wait_for"]


class TornDown:
    """A test resource built on ``__enter__`` (``_build``) and always torn down
    (``close``), also when building it failed half-way."""

    def _build(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

# Children come from the fork server of `replica.processes` (torch imported once there): the
# environment, working directory and import path of the moment are handed to each.


class ChildFailed(RuntimeError):
    """A child process raised (its traceback is the message) or died."""


def _child_main(conn, context: Inherited, target, args) -> None:
    try:
        context.enter()
        target(conn, *args)
    except BaseException:  # forward everything, including KeyboardInterrupt/SystemExit
        with contextlib.suppress(Exception):
            conn.send(("__error__", traceback.format_exc()))
        raise


class Child:
    """A child process running ``target(pipe, *args)``; talk to it with send/recv."""

    def __init__(self, target: Callable[..., Any], *args: Any, name: str = "child"):
        self._conn, child_conn = SERVER.Pipe()
        self.process = SERVER.Process(target=_child_main, args=(child_conn, Inherited.here(), target, args), name=name,
                                    daemon=True)
        self.process.start()
        child_conn.close()
        self.name = name

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, *message: Any) -> None:
        self._conn.send(message)

    def recv(self, timeout: float = 60.0) -> Any:
        """The child's next message; raises ChildFailed on its error, death, or silence."""
        if not self._conn.poll(timeout):
            alive = self.process.is_alive()
            raise ChildFailed(f"{self.name} sent nothing for {timeout} s (alive={alive}, exit={self.process.exitcode})")
        try:
            message = self._conn.recv()
        except EOFError as exc:
            self.process.join(5)
            raise ChildFailed(f"{self.name} died (exit code {self.process.exitcode})") from exc
        if isinstance(message, tuple) and message and message[0] == "__error__":
            raise ChildFailed(f"{self.name} raised:\n{message[1]}")
        return message

    def request(self, *message: Any, timeout: float = 60.0) -> Any:
        self.send(*message)
        return self.recv(timeout)

    def kill(self) -> None:
        """SIGKILL, as a crashed machine would; returns once the process is gone."""
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def close(self, timeout: float = 10.0) -> None:
        """Close the pipe (a child waiting on it sees EOF and exits), then make sure it is gone."""
        self._conn.close()
        if self.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)


# The raw-transport baseline of the benchmarks: one buffer as buckets, all in flight at once,
# then an 8-byte acknowledgement. What a bucket stream would move with nothing of its own.
_BUCKET_TAG, _ACK_TAG = 16, 2


def _bucket_views(buf, bucket_bytes: int) -> list:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return [buf[lo:lo + bucket_bytes] for lo in range(0, buf.numel(), bucket_bytes)]


def send_bucketed(conn, buf, bucket_bytes: int, *, ack, timeout) -> None:
    """Send ``buf`` (a flat uint8 tensor) over the transport connection ``conn`` as
    buckets of ``bucket_bytes``, every one in flight at once, and wait for the
    receiver's acknowledgement into ``ack`` (8 bytes); the peer runs ``receive_bucketed``."""
    got = conn.irecv(ack, tag=_ACK_TAG)
    sends = [conn.isend(view, tag=_BUCKET_TAG + i) for i, view in enumerate(_bucket_views(buf, bucket_bytes))]
    for send in sends:
        send.wait(timeout)
    got.wait(timeout)


def receive_bucketed(conn, buf, bucket_bytes: int, *, ack, timeout) -> None:
    """The other end of ``send_bucketed``: every bucket's receive posted at once, then the ack."""
    receives = [conn.irecv(view, tag=_BUCKET_TAG + i) for i, view in enumerate(_bucket_views(buf, bucket_bytes))]
    for receive in receives:
        receive.wait(timeout)
    conn.send(ack, tag=_ACK_TAG, timeout=timeout)


class RawUcx:
    """One end of the benchmarks' raw UCX baseline between two processes (no digests,
    ``send_bucketed``/``receive_bucketed``): the receiving end ``listen``s and the
    sending end ``send``s to its address; each end's connection is made on its first
    round and kept, as a stream's is. Close it (or use it as a context manager)."""

    def __init__(self, *, token: bytes, timeout: timedelta):
        from replica.transport.ucx import UcxConfig, UcxTransport  # UCX only where a benchmark wants it

        self._transport = UcxTransport(UcxConfig(token=token, verify=False))
        self._timeout = timeout
        self._conn = None
        self._ack = torch.zeros(8, dtype=torch.uint8)

    def listen(self) -> str:
        """The address the sending end connects to."""
        return self._transport.listen()

    def send(self, address: str, buf, bucket_bytes: int) -> float:
        """One round of ``buf`` (a flat uint8 tensor) to the end listening at ``address``;
        its seconds, from the first send to the receiver's acknowledgement."""
        if self._conn is None:
            self._conn = self._transport.connect(address, self._timeout)
        start = time.perf_counter()
        send_bucketed(self._conn, buf, bucket_bytes, ack=self._ack,
                      timeout=self._timeout)
        return time.perf_counter() - start

    def receive(self, buf, bucket_bytes: int) -> None:
        """One round into ``buf``, from the end that connected to ``listen``'s address."""
        if self._conn is None:
            self._conn = self._transport.accept(self._timeout)
        receive_bucketed(self._conn, buf, bucket_bytes, ack=self._ack,
                         timeout=self._timeout)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> "RawUcx":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``predicate()`` every 10 ms until it is true; AssertionError naming ``what``
    after ``timeout_s``."""
    deadline = Deadline.after(timedelta(seconds=timeout_s))
    while not predicate():
        assert not deadline.expired, f"timed out waiting for {what}"
        time.sleep(0.01)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for rendezvous of test processes)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago (all held at once while chosen)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time every thread of process ``pid`` (this one when None) used so far, in
    seconds at the kernel's resolution (nanoseconds; /proc's ticks are 10 ms). Through
    the process's CPU clock (Linux: the clock id of ``clock_getcpuclockid``, which Python
    lacks). OSError once the process is gone."""
    if pid is None:
        return time.process_time()
    return time.clock_gettime(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of the whole process


def cpu_since(*pids: int) -> Callable[[], float]:
    """A meter started now: each call returns the CPU seconds this process and ``pids``
    used since (every thread; see ``cpu_seconds``)."""
    def used() -> float:
        return cpu_seconds() + sum(cpu_seconds(pid) for pid in pids)

    start = used()
    return lambda: used() - start


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), as /proc shows them now."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = []
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for thread in threads:  # each thread's own children: a child forked by another thread too
            try:
                with open(f"/proc/{parent}/task/{thread}/children") as f:
                    children += [int(c) for c in f.read().split()]
            except OSError:
                continue
        found += children
        todo += children
    return found


_ROLE_NAME = re.compile(r"(trainer|standby|rollout) (\d+)")


def role_of(pid: int) -> tuple[str, int] | None:
    """The role and rank of a launched job's process: its name (a role forked from the fork
    server is named so), else its environment (a role started with ``--exec-roles``); None
    for another process, or one gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            named = _ROLE_NAME.fullmatch(f.read().strip())
        if named:
            return named[1], int(named[2])
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    if b"REPLICA_ROLE" not in env or b"REPLICA_RANK" not in env:
        return None
    return env[b"REPLICA_ROLE"].decode(), int(env[b"REPLICA_RANK"])


def process_state(pid: int) -> str:
    """The one-letter state of a process from /proc (R, S, T for stopped, Z, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@contextlib.contextmanager
def spawn(target: Callable[..., Any], *args: Any, name: str = "child") -> Iterator[Child]:
    """A Child that is always terminated when the block ends, whatever happened."""
    child = Child(target, *args, name=name)
    try:
        yield child
    finally:
        child.close()


@dataclass(kw_only=True, frozen=True, slots=True)
class BusyCores:
    """Processes spinning at normal priority, as a user's loaded machine would have."""

    procs: tuple[subprocess.Popen, ...]
    started: float

    def all_alive(self) -> bool:
        """True while every one still runs (the load lasted, for a test to assert)."""
        return all(p.poll() is None for p in self.procs)

    def cpu_seconds(self) -> float:
        """CPU time they used so far: proof that they competed for the cores."""
        total = 0.0
        for p in self.procs:
            with contextlib.suppress(OSError):  # one already gone
                total += cpu_seconds(p.pid)
        return total


@contextlib.contextmanager
def busy_cores(per_core: int = 2) -> Iterator[BusyCores]:
    """``per_core`` busy-looping processes per core for the whole block, always killed after."""
    n = per_core * (os.cpu_count() or 1)
    procs = tuple(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n))
    try:
        yield BusyCores(procs=procs, started=time.monotonic())
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


class CountingStore:
    """A ``torch.distributed`` store client (``inner``) that counts what it asks of the
    store: requests by method (``requests``), keys named (``keys``) and bytes sent and
    received (``bytes``), for measuring the control plane's cost. ``JobStore`` takes it
    where it takes a store (it only calls these methods); its ``clone()`` (a thread's own
    connection, ``JobStore.own``) counts into the same totals."""

    def __init__(self, inner, *, _shared: CountingStore | None = None):
        self.inner = inner
        self.clone_per_thread = isinstance(inner, torch.distributed.TCPStore)
        self._tally = self if _shared is None else _shared._tally
        if _shared is None:
            self.requests: Counter[str] = Counter()
            self.keys = 0
            self.bytes = 0
            self.calls: list[tuple[str, int]] = []  # (method, keys named), in order
            self._lock = threading.Lock()

    def clone(self) -> CountingStore:
        return CountingStore(self.inner.clone(), _shared=self)

    def reset(self) -> None:
        tally = self._tally
        with tally._lock:
            tally.requests.clear()
            tally.keys = tally.bytes = 0
            tally.calls.clear()

    @property
    def total(self) -> int:
        return sum(self._tally.requests.values())

    def _count(self, method: str, keys: list[str], nbytes: int) -> None:
        tally = self._tally
        with tally._lock:
            tally.requests[method] += 1
            tally.keys += len(keys)
            tally.bytes += nbytes + sum(len(k) for k in keys)
            tally.calls.append((method, len(keys)))
    def set(self, key: str, value) -> None:
        self._count("set", [key], len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._count("get", [key], len(value))
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.inner.multi_get(keys)
        self._count("multi_get", keys, sum(len(v) for v in values))
        return values

    def multi_set(self, keys: list[str], values) -> None:
        self._count("multi_set", keys, sum(len(v) for v in values))
        self.inner.multi_set(keys, values)

    def add(self, key: str, amount: int) -> int:
        self._count("add", [key], 8)
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        value = self.inner.compare_set(key, expected, desired)
        self._count("compare_set", [key], len(expected) + len(desired) + len(value))
        return value

    def check(self, keys: list[str]) -> bool:
        self._count("check", keys, 0)
        return self.inner.check(keys)

    def wait(self, keys: list[str], *args) -> None:
        self._count("wait", keys, 0)
        self.inner.wait(keys, *args)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key", [key], 0)
        return self.inner.delete_key(key)
