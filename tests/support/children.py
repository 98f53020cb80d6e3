"""Children for multi-process tests: forked from a server that imported torch once (the
state of a fresh interpreter, without its 1.5-2 s of imports each), they forward their
tracebacks, can be killed or frozen, and are always cleaned up; and what a test asks of
processes (``process_state``, ``descendants``, ``role_of``, ``wait_for``)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from replica.processes import SERVER, Inherited
from replica.timing import Deadline

__all__ = ["Child", "ChildFailed", "descendants", "process_state", "role_of", "spawn", "wait_for"]

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
        self.process = SERVER.Process(
            target=_child_main, args=(child_conn, Inherited.here(), target, args), name=name, daemon=True
        )
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


@contextlib.contextmanager
def spawn(target: Callable[..., Any], *args: Any, name: str = "child") -> Iterator[Child]:
    """A Child that is always terminated when the block ends, whatever happened."""
    child = Child(target, *args, name=name)
    try:
        yield child
    finally:
        child.close()


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``predicate()`` every 10 ms until it is true; AssertionError naming ``what``
    after ``timeout_s``."""
    deadline = Deadline.after(timedelta(seconds=timeout_s))
    while not predicate():
        assert not deadline.expired, f"timed out waiting for {what}"
        time.sleep(0.01)


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
