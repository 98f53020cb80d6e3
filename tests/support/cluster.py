"""A cluster of hosts on one machine, for tests: each host a Linux network
namespace with its own address on a private bridge, so processes on different
hosts talk over a real link (veth) that can be cut or lost whole.

The bridge lives in a namespace of its own: nothing is added to the machine's
own network, and every address is in ``ClusterConfig.subnet`` (10.200.0.0/24
unless told otherwise). Tearing down (always, on leaving the ``with``) kills
every process left in the hosts and deletes the namespaces with their links.

What a namespace does not separate: the file system, ``/dev/shm`` and the boot
id. UCX takes hosts with one boot id for one machine and would move their
bytes through shared memory; replica tells hosts apart by address
(``replica.transport.control.peer_locality``) and keeps UCX off shared memory
between them, which ``Host.link_bytes`` lets a test check.

Needs root and ``ip netns`` (iproute2); ``available()`` says whether both are here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from replica.timing import Deadline
from support.resource import TornDown

__all__ = ["ClusterConfig", "Host", "NetnsCluster", "available", "enter"]

_IP = "ip"
_CLONE_NEWNET = 0x40000000  # <sched.h>; os.setns comes with Python 3.12


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def available() -> bool:
    """Root, and an ``ip`` that can make a network namespace."""
    if os.geteuid() != 0 or shutil.which(_IP) is None:
        return False
    probe = f"rpprobe{os.getpid()}"
    made = subprocess.run([_IP, "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run([_IP, "netns", "del", probe], capture_output=True)
    return made


def enter(netns: str) -> None:
    """Move the calling thread into the network namespace ``netns``; the threads and
    processes it starts after are there too. For a process that must talk over a host's
    link without ``Host.command``'s wrapper (a test's spawned child): sockets made before
    stay where they were, and the file system (``/sys`` included) is still the machine's."""
    with open(f"/var/run/netns/{netns}", "rb") as ns:
        if _libc().setns(ns.fileno(), _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass(kw_only=True, frozen=True, slots=True)
class ClusterConfig:
    hosts: int
    subnet: str = "10.200.0.0/24"  # private; hosts get .2, .3, ...
    # Namespace and link names start with this (at most 8 characters: link names have 15).
    prefix: str = field(default_factory=lambda: f"rp{os.getpid() % 100000}")
    # How long a host's processes get to die when it is killed or torn down.
    kill_timeout: timedelta = timedelta(seconds=10)

    def __post_init__(self) -> None:
        net = ipaddress.ip_network(self.subnet)
        if not net.is_private or net.version != 4:
            raise ValueError(f"subnet must be a private IPv4 network, got {self.subnet}")
        if not 1 <= self.hosts <= net.num_addresses - 3:
            raise ValueError(f"{self.hosts} hosts do not fit in {self.subnet}")
        if not (0 < len(self.prefix) <= 8 and self.prefix.isalnum()):
            raise ValueError(f"prefix must be 1-8 letters or digits, got {self.prefix!r}")


class Host:
    """One namespace: ``address`` on its ``eth0``, its switch port in the bridge's namespace."""

    def __init__(self, cluster: NetnsCluster, index: int, address: str):
        self.index = index
        self.address = address
        self.netns = f"{cluster.config.prefix}h{index}"
        self._port = f"{cluster.config.prefix}p{index}"  # its link's end on the bridge
        self._switch = cluster.switch
        self._kill_timeout = cluster.config.kill_timeout

    def __repr__(self) -> str:
        return f"Host({self.index}, {self.address})"

    @property
    def hostname(self) -> str:
        return self.netns

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside this host: its network namespace, and a UTS namespace
        whose hostname is the host's own (roles and agents name their machine by it)."""
        return [
            _IP,
            "netns",
            "exec",
            self.netns,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hostname,
            *argv,
        ]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start a process on this host (``subprocess.Popen`` keywords)."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def pids(self) -> list[int]:
        out = _run(_IP, "netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self) -> list[int]:
        """SIGKILL to every process on the host, at once; returns their pids. Its kernel
        still answers: peers' connections are reset. ``crash`` loses the machine."""
        killed: list[int] = []
        deadline = Deadline.after(self._kill_timeout)
        while pids := self.pids():  # children forked while the first ones died, too
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                if pid not in killed:
                    killed.append(pid)
            if deadline.expired:
                raise RuntimeError(
                    f"{self}: processes {pids} outlived SIGKILL for {self._kill_timeout.total_seconds()} s"
                )
            time.sleep(0.02)
        return killed

    def crash(self) -> list[int]:
        """The machine is lost: its link goes silent first (peers get no reset, as from a
        machine that lost power), then every process on it is killed. Stays cut off."""
        self.partition()
        return self.kill()

    def partition(self) -> None:
        """Cut the host's link: it stays up, its packets go nowhere, nobody gets an error."""
        _run(_IP, "-n", self._switch, "link", "set", self._port, "down")

    def heal(self) -> None:
        _run(_IP, "-n", self._switch, "link", "set", self._port, "up")

    def link_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes on the host's link so far."""
        out = _run(_IP, "-n", self.netns, "-s", "-j", "link", "show", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]


class NetnsCluster(TornDown):
    """``config.hosts`` hosts on one bridge; ``hosts[i]`` has address ``subnet + 2 + i``."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.switch = f"{config.prefix}sw"
        net = ipaddress.ip_network(config.subnet)
        self._prefixlen = net.prefixlen
        self.hosts = [Host(self, i, str(net.network_address + 2 + i)) for i in range(config.hosts)]
        self._made: list[str] = []

    def _build(self) -> None:
        _run(_IP, "netns", "add", self.switch)
        self._made.append(self.switch)
        _run(_IP, "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run(_IP, "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            _run(_IP, "netns", "add", host.netns)
            self._made.append(host.netns)
            inner = f"{self.config.prefix}e{host.index}"
            # Made in the switch's namespace: the machine's own never holds either end.
            _run(_IP, "-n", self.switch, "link", "add", host._port, "type", "veth", "peer", "name", inner)
            _run(_IP, "-n", self.switch, "link", "set", inner, "netns", host.netns)
            _run(_IP, "-n", host.netns, "link", "set", inner, "name", "eth0")
            _run(_IP, "-n", host.netns, "addr", "add", f"{host.address}/{self._prefixlen}", "dev", "eth0")
            _run(_IP, "-n", host.netns, "link", "set", "eth0", "up")
            _run(_IP, "-n", host.netns, "link", "set", "lo", "up")
            _run(_IP, "-n", self.switch, "link", "set", host._port, "master", "br0")
            _run(_IP, "-n", self.switch, "link", "set", host._port, "up")

    def close(self) -> None:
        """Kill what runs on the hosts and delete every namespace this cluster made."""
        for host in self.hosts:
            if host.netns in self._made:
                with contextlib.suppress(RuntimeError):  # deleted below all the same; its processes lose their network
                    host.kill()
        for name in reversed(self._made):
            _run(_IP, "netns", "del", name, check=False)
        self._made.clear()
