"""Processes forked from a preloaded server: a child that starts in milliseconds, with
torch already imported, instead of a fresh interpreter that imports it again (1.5-2 s of
CPU each, several seconds on a loaded machine).

The server is multiprocessing's fork server: one process per parent, started (exec'd, so
clean: no thread, no communicator, nothing of the parent's) on first use, that imports
``PRELOAD`` once and forks a child per request. A command that runs no thread yet starts it as
a fork of itself instead (``start_server``: ``replica launch`` and ``replica agent`` do), which
imports only what the command has not. A child starts from the server's state, not
its parent's: the environment, working directory and import path the parent chose are
handed to it (``Inherited``), as exec would. Only imports go into the server: nothing that
starts a thread, opens a transport or reads the environment once for good (torch reads its
thread counts and CUDA devices at first use, not at import). The server listens on a Unix
socket in a private (0700) directory; it exits when its parent does.

``start_script`` runs a user script in such a child as ``python SCRIPT ARGS`` would: as
``__main__``, with its directory first on ``sys.path``, its exit status that of the script
(an uncaught exception: 1), non-daemon threads joined and ``atexit`` handlers run before it
exits. The child is SIGKILLed when its parent dies, even by SIGKILL, and is named for what it
is (``ps -o comm``, ``top``). Linux only."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing import process as mp_process
from multiprocessing import reduction
from typing import Protocol, cast

__all__ = ["Inherited", "PRELOAD", "SERVER", "ScriptProcess", "environ_now", "start_script", "start_server"]

# What the roles and users' scripts import: torch._dynamo is imported lazily by FSDP2's first
# fully_shard (a third of a small job's CPU when each child imported it); a module that is not
# installed is skipped (multiprocessing's fork server ignores an ImportError of its preload).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "numpy",
    "ucxx",
    "replica",
]
SERVER = mp.get_context("forkserver")
SERVER.set_forkserver_preload(PRELOAD)

_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1
# The fork server's private state that start_server fills in as ensure_running would (Python 3.10-3.13; 3.14
# authenticates its clients with a key of its own: there, and elsewhere, the server is always exec'd).
_FORKABLE_SERVER = sys.platform.startswith("linux") and sys.version_info < (3, 14)
_NAME_BYTES = 15  # the kernel keeps 15 bytes of a process name (/proc/PID/comm)


# CPython's multiprocessing internals used here, which typeshed leaves out (it declares no private
# names): each is cast to one of these where it is used.
class _ForkServerState(Protocol):
    """``multiprocessing.forkserver._forkserver``'s state, which ``start_server`` fills in."""

    _forkserver_address: str | None
    _forkserver_alive_fd: int | None
    _forkserver_pid: int | None


class _ConnectionModule(Protocol):
    """``multiprocessing.connection``: a fresh address for a listener."""

    def arbitrary_address(self, family: str) -> str: ...


class _ProcessModule(Protocol):
    """``multiprocessing.process``: this process's parent and its children not yet joined."""

    _parent_process: mp_process.BaseProcess | None
    _children: set[mp_process.BaseProcess]


def environ_now() -> dict[str, str]:
    """A copy of ``os.environ``; taken again if another thread changed it meanwhile (an
    in-process vLLM engine sets variables from its threads: the copy raised RuntimeError)."""
    for _ in range(100):
        try:
            return dict(os.environ)
        except RuntimeError:
            continue
    return dict(os.environ)


@dataclass(kw_only=True, frozen=True, slots=True)
class Inherited:
    """What an exec'd child would inherit from its parent at its start."""

    environ: dict[str, str]
    cwd: str
    path: list[str]

    @staticmethod
    def here(environ: dict[str, str] | None = None) -> Inherited:
        """This process's working directory and import path, and ``environ`` (default: its own)."""
        return Inherited(
            environ=environ_now() if environ is None else dict(environ), cwd=os.getcwd(), path=list(sys.path)
        )

    def enter(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def start_server() -> bool:
    """Start the fork server now, rather than at the first ``start_script``. Where this process
    runs no other thread (a command at its start, before its store or agent runs any) the server
    is a fork of it: it starts from the modules this process imported already (torch, replica:
    1.5 s of CPU an exec'd server imports again) and imports the rest of ``PRELOAD``. Elsewhere
    (a thread running, a server running already, another platform or Python) multiprocessing's
    own, exec'd on first use. True when the server is this process's fork.

    A fork taken here is as clean as the exec'd server: no thread, no open store or transport,
    no logging set up yet (the caller has done nothing but import and read its arguments); the
    children get their environment, directory and import path from their starter (``Inherited``)
    as they do from the exec'd one."""
    from multiprocessing import connection, forkserver, resource_tracker, util

    server = cast(_ForkServerState, forkserver._forkserver)
    if not _FORKABLE_SERVER or threading.active_count() > 1 or server._forkserver_pid is not None:
        return False
    resource_tracker.ensure_running()
    sys.stdout.flush()
    sys.stderr.flush()
    with socket.socket(socket.AF_UNIX) as listener:
        address = cast(_ConnectionModule, connection).arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # every client holds the write end: the server ends when all closed it
        pid = os.fork()
        if pid == 0:  # the server
            status = 0
            try:
                os.close(alive_w)
                _set_name("replica-forks")
                forkserver.main(listener.fileno(), alive_r, PRELOAD)
            except SystemExit:  # its clients are gone
                pass
            except BaseException:  # noqa: BLE001 - said, and the server ends; its clients' starts fail
                import traceback

                traceback.print_exc()
                status = 1
            finally:
                os._exit(status)  # not this command's atexit handlers, nor its exit path
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def _die_with_parent() -> None:
    """SIGKILL this child when the server dies; the server exits when the parent that started it
    does. A parent already gone before the signal was set sends nothing: then the pipe it sent
    this child's start through reads EOF, and the child kills itself."""
    # The server exits once no client holds its liveness pipe; multiprocessing hands each child
    # a copy (for children of its own), which would keep the server up after the parent died.
    from multiprocessing import forkserver

    server = cast(_ForkServerState, forkserver._forkserver)
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None  # a child of this child starts a server of its own
    if not sys.platform.startswith("linux"):
        return
    if (
        _libc().prctl(
            ctypes.c_int(_PR_SET_PDEATHSIG),
            ctypes.c_ulong(signal.SIGKILL),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        )
        != 0
    ):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        os.kill(os.getpid(), signal.SIGKILL)


def _as_a_fresh_interpreter() -> None:
    """multiprocessing as ``python SCRIPT`` has it: the platform's start method (a fork server's
    child has the fork server's forced on it: a DataLoader's workers would come from a server
    of this child's, as children of that server, not of the role), no parent, a key of its own."""
    mp.set_start_method(None, force=True)
    cast(_ProcessModule, mp_process)._parent_process = None
    mp.current_process().authkey = os.urandom(32)


def _set_name(name: str) -> None:
    if sys.platform.startswith("linux"):
        _libc().prctl(
            ctypes.c_int(_PR_SET_NAME),
            ctypes.c_char_p(name.encode()[:_NAME_BYTES]),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        )


def _exit_status(exc: SystemExit) -> int:
    """``sys.exit(code)`` as the interpreter turns it into a status."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _finish(status: int) -> None:
    """End as the interpreter would: wait for non-daemon threads, run ``atexit``, flush, exit
    (without the fork server's own exit path, which skips ``atexit``)."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def _run_script(inherited: Inherited, argv: list[str], name: str, stdout, stderr) -> None:
    _die_with_parent()
    _as_a_fresh_interpreter()
    _set_name(name)
    for fd, stream in ((stdout, sys.stdout), (stderr, sys.stderr)):
        stream.flush()
        os.dup2(fd, stream.fileno())  # the starter's at the start, as exec'd children have them
        os.close(fd)
    inherited.enter()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` puts it first
    try:
        runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc)
    except BaseException as exc:  # noqa: BLE001 - the script's own failure, said as the interpreter says it
        sys.excepthook(type(exc), exc, _from_script(exc.__traceback__, argv[0]))
        status = 1
    _finish(status)


class _SentFd:
    """A file descriptor of this process that arrives in the child as one of its own (an int):
    sent with the child's start, over the fork server's socket."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received, (reduction.DupFd(self.fd),)  # pickled by Process.start: sent with it


def _received(fd) -> int:
    return fd.detach()


def _from_script(tb, script: str):
    """The traceback from the script's own frame on (as the interpreter prints it: no runpy, no
    ``_run_script``); all of it when no frame is the script's."""
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename != script:
        first = first.tb_next
    return first or tb


class ScriptProcess:
    """A script started by ``start_script``, with the part of ``subprocess.Popen`` the
    launcher uses: ``pid``, ``poll``, ``returncode`` (negative: the signal that ended it),
    ``wait`` (``subprocess.TimeoutExpired`` past its timeout), ``kill``.

    The script is the fork server's child, not this process's: the server reaps it, and its
    pid may be gone (or another process's) before its exit reaches this side. So it is
    signalled through a pidfd taken at its start, never by pid."""

    def __init__(self, process: mp_process.BaseProcess, argv: list[str]):
        assert process.pid is not None  # started (start_script): it has a pid
        self._process = process
        self._pid = process.pid
        self.args = argv
        try:
            self._pidfd: int | None = os.pidfd_open(self._pid)
        except ProcessLookupError:  # gone already (reaped by the server): nothing to signal
            self._pidfd = None

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            assert timeout is not None  # a join without one returns once the script ended
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def kill(self) -> None:
        """SIGKILL, unless it has exited (then nothing, as ``Popen.kill``)."""
        if self._process.exitcode is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):  # exited: its exit is on its way
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def __del__(self) -> None:
        pidfd = getattr(self, "_pidfd", None)  # (none when __init__ did not get that far)
        if pidfd is not None:
            os.close(pidfd)
            self._pidfd = None


def start_script(argv: list[str], *, env: dict[str, str], name: str) -> ScriptProcess:
    """Run ``python *argv`` (``argv[0]`` a script path) in a child of the fork server, with
    environment ``env`` and this process's working directory, named ``name`` (15 bytes shown).
    ValueError for an empty ``argv``; FileNotFoundError for a script that is not there."""
    if not argv:
        raise ValueError("start_script needs a script path")
    if not os.path.isfile(argv[0]):
        raise FileNotFoundError(f"no script at {argv[0]!r}")
    # not daemonic: a daemonic process may not start processes (a DataLoader's workers)
    std = (_SentFd(sys.stdout.fileno()), _SentFd(sys.stderr.fileno()))
    process = SERVER.Process(
        target=_run_script, args=(Inherited.here(env), list(argv), name, *std), name=name, daemon=False
    )
    process.start()
    # Not joined by multiprocessing at this process's exit, as a daemonic one would not be: a
    # parent that ends without stopping it ends it (the server goes, and the signal comes).
    cast(_ProcessModule, mp_process)._children.discard(process)
    return ScriptProcess(process, list(argv))
