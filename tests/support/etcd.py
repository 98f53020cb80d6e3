"""A real etcd cluster for tests and demos: N ``etcd`` members (the Debian
``etcd-server`` binary), data on tmpfs, authentication on (a root user and a job
user whose role may read and write only the job's namespace), torn down always.

Members run where ``spawn`` puts them: plain processes on loopback by default,
or inside a ``NetnsCluster`` host (``spawn=host.popen``, ``address=host.address``)
so that killing the host kills its member.
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from replica import envvars
from replica.jobstore.etcd import EtcdConfig
from replica.timing import Deadline
from support.ports import free_ports
from support.resource import TornDown

__all__ = ["EtcdCluster", "EtcdMember", "available"]

_ROOT = "root"
_USER = "replica"


def available() -> bool:
    return shutil.which("etcd") is not None


def _post(url: str, body: dict, ca_file: str = "") -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    with urllib.request.urlopen(request, timeout=5, context=context) as response:
        return json.loads(response.read() or b"{}")


_POST_FROM_THERE = """
import json, sys, urllib.request
request = urllib.request.Request(sys.argv[1], data=sys.stdin.read().encode(),
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=5) as response:
    sys.stdout.write((response.read() or b"{}").decode())
"""


def _not_ours(*args, **kwargs) -> subprocess.Popen:
    raise RuntimeError("this etcd member belongs to another process's cluster (EtcdCluster.attach)")


@dataclass(kw_only=True, slots=True)
class EtcdMember:
    name: str
    address: str
    client_port: int
    peer_port: int
    spawn: Callable[..., subprocess.Popen]
    #: Wraps a command to run where the member can be reached (a NetnsCluster host's
    #: ``command``); None: this process reaches it directly.
    via: Callable[[list[str]], list[str]] | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.address, self.client_port

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
            self.process.wait()


class EtcdCluster(TornDown):
    """``with EtcdCluster(addresses=["127.0.0.1"] * 3) as etcd: etcd.config(namespace="job/")``."""

    def __init__(
        self,
        *,
        addresses: Sequence[str],
        base_port: int | None = None,
        spawns: Sequence[Callable[..., subprocess.Popen]] | None = None,
        via: Sequence[Callable[[list[str]], list[str]]] | None = None,
        namespace: str = "replica-job/",
        tls: bool = False,
    ):
        """``tls``: clients speak https to the members, whose certificate a CA made here signed
        (``ca_file``); not with ``via``. ``base_port``: member i listens on ``base_port + 2i``
        (clients) and the port after it (peers); None: on free ports of ``addresses`` (so that
        clusters of tests running side by side never meet)."""
        if len(addresses) < 1:
            raise ValueError("an etcd cluster needs at least one member")
        if tls and via:
            raise ValueError("a TLS test cluster is reached directly (no via)")
        if base_port is None and len(set(addresses)) != 1:
            raise ValueError("members on several addresses need a base_port")
        self.namespace = namespace
        self.tls = tls
        self.password = secrets.token_hex(16)
        self._root_password = secrets.token_hex(16)
        self._dir = Path(
            tempfile.mkdtemp(prefix="replica-etcd-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        )
        spawns = list(spawns) if spawns is not None else [subprocess.Popen] * len(addresses)
        if base_port is None:
            free = free_ports(2 * len(addresses), addresses[0])
            ports = list(zip(free[::2], free[1::2], strict=False))
        else:
            ports = [(base_port + 2 * i, base_port + 2 * i + 1) for i in range(len(addresses))]
        self.members = [
            EtcdMember(
                name=f"m{i}",
                address=a,
                client_port=client,
                peer_port=peer,
                spawn=spawns[i],
                via=via[i] if via else None,
            )
            for i, (a, (client, peer)) in enumerate(zip(addresses, ports, strict=True))
        ]
        self._owner = True  # False: attached to another process's cluster

    def describe(self) -> str:
        """What another process needs to use this cluster (``attach``): its members' addresses and
        ports, the job user's password, where its certificates are. Never logged."""
        return json.dumps(
            {
                "members": [[m.name, m.address, m.client_port, m.peer_port] for m in self.members],
                "password": self.password,
                "tls": self.tls,
                "dir": str(self._dir),
            }
        )

    @classmethod
    def attach(cls, description: str, *, namespace: str) -> EtcdCluster:
        """A cluster another process runs (its ``describe()``), as this one uses it: ``endpoints``,
        ``config()``, ``environ()`` in ``namespace`` (inside the job user's). Its members are not
        this process's: starting, stopping or closing them is the owner's."""
        found = json.loads(description)
        view = cls.__new__(cls)
        view.namespace, view.tls, view.password = namespace, found["tls"], found["password"]
        view._root_password, view._dir, view._owner = "", Path(found["dir"]), False
        view.members = [
            EtcdMember(name=name, address=address, client_port=client, peer_port=peer, spawn=_not_ours)
            for name, address, client, peer in found["members"]
        ]
        return view

    @property
    def ca_file(self) -> str:
        return str(self._dir / "ca.crt") if self.tls else ""

    def _make_certificates(self) -> None:
        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=self._dir, check=True, capture_output=True, timeout=60)

        openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "1",
            "-subj",
            "/CN=replica test CA",
        )
        openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=etcd"
        )
        names = ",".join(sorted({f"IP:{m.address}" for m in self.members}))
        (self._dir / "ext.cnf").write_text(f"subjectAltName={names}\n")
        openssl(
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "1",
            "-extfile",
            "ext.cnf",
        )

    def _build(self) -> None:
        if self.tls:
            self._make_certificates()
        for member in self.members:
            self.start(member)
        self._ready(timedelta(seconds=30))
        self._enable_auth()

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}=http://{m.address}:{m.peer_port}" for m in self.members)

    def start(self, member: EtcdMember) -> None:
        """Start (or restart, on its data) one member."""
        log = open(self._dir / f"{member.name}.log", "ab")  # noqa: SIM115 - the member process holds it
        scheme = "https" if self.tls else "http"
        tls = (
            ["--cert-file", str(self._dir / "server.crt"), "--key-file", str(self._dir / "server.key")]
            if self.tls
            else []
        )
        member.process = member.spawn(
            [
                "etcd",
                *tls,
                "--name",
                member.name,
                "--data-dir",
                str(self._dir / member.name),
                "--listen-client-urls",
                f"{scheme}://{member.address}:{member.client_port}",
                "--advertise-client-urls",
                f"{scheme}://{member.address}:{member.client_port}",
                "--listen-peer-urls",
                f"http://{member.address}:{member.peer_port}",
                "--initial-advertise-peer-urls",
                f"http://{member.address}:{member.peer_port}",
                "--initial-cluster",
                self._initial_cluster(),
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                self._dir.name,
                # etcd's defaults, stated: the takeover times measured here depend on them.
                "--heartbeat-interval",
                "100",
                "--election-timeout",
                "1000",
                "--logger",
                "zap",
                "--log-level",
                "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def log(self, member: EtcdMember) -> str:
        return (self._dir / f"{member.name}.log").read_text(errors="replace")

    def _post(self, member: EtcdMember, path: str, body: dict) -> dict:
        url = f"{'https' if self.tls else 'http'}://{member.address}:{member.client_port}{path}"
        if member.via is None:
            return _post(url, body, self.ca_file)
        # The member is in another network namespace: make the call from there.
        done = subprocess.run(
            member.via([sys.executable, "-c", _POST_FROM_THERE, url]),
            input=json.dumps(body),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise OSError(f"{url}: {done.stderr.strip()[-300:]}")
        return json.loads(done.stdout)

    def _ready(self, within: timedelta) -> None:
        deadline = Deadline.after(within)
        while True:
            try:
                self._post(self.members[0], "/v3/kv/range", {"key": base64.b64encode(b"ready").decode()})
                return
            except OSError as exc:
                if deadline.expired:
                    dead = [m.name for m in self.members if not m.alive()]
                    raise RuntimeError(
                        f"etcd cluster not ready within {within} ({exc}; exited: {dead}); "
                        f"log: {self.log(self.members[0])[-2000:]}"
                    ) from exc
                time.sleep(0.1)

    def _enable_auth(self) -> None:
        m = self.members[0]
        b64 = lambda s: base64.b64encode(s).decode()  # noqa: E731
        ns = self.namespace.encode()
        end = ns[:-1] + bytes([ns[-1] + 1])
        for path, body in (
            ("/v3/auth/user/add", {"name": _ROOT, "password": self._root_password}),
            ("/v3/auth/user/grant", {"user": _ROOT, "role": "root"}),
            ("/v3/auth/role/add", {"name": "replica-job"}),
            (
                "/v3/auth/role/grant",
                {"name": "replica-job", "perm": {"permType": "READWRITE", "key": b64(ns), "range_end": b64(end)}},
            ),
            ("/v3/auth/user/add", {"name": _USER, "password": self.password}),
            ("/v3/auth/user/grant", {"user": _USER, "role": "replica-job"}),
            ("/v3/auth/enable", {}),
        ):
            self._post(m, path, body)

    @property
    def endpoints(self) -> str:
        return ",".join(f"{m.address}:{m.client_port}" for m in self.members)

    def config(self, **overrides) -> EtcdConfig:
        """A client config of the job user (the only one the tests give out)."""
        return EtcdConfig(
            **{
                "endpoints": tuple(m.endpoint for m in self.members),
                "namespace": self.namespace,
                "user": _USER,
                "password": self.password,
                "ca_file": self.ca_file,
                **overrides,
            }
        )

    def environ(self) -> dict[str, str]:
        """What a role needs in its environment to use this cluster."""
        return {envvars.ETCD_USER: _USER, envvars.ETCD_PASSWORD: self.password, envvars.ETCD_CA: self.ca_file}

    def wait_member(self, member: EtcdMember, within: timedelta) -> None:
        """Until ``member`` (restarted) answers and has caught up with a leader."""
        deadline = Deadline.after(within)
        while True:
            try:
                status = self._post(member, "/v3/maintenance/status", {})
                if status.get("leader"):
                    return
            except OSError:
                pass
            if deadline.expired:
                raise RuntimeError(f"etcd member {member.name} did not come back within {within}")
            time.sleep(0.1)

    def leader(self) -> EtcdMember:
        """The member that leads now."""
        for member in self.members:
            if not member.alive():
                continue
            try:
                status = self._post(member, "/v3/maintenance/status", {})
            except OSError:
                continue
            if status.get("leader") == status.get("header", {}).get("member_id"):
                return member
        raise RuntimeError("no etcd member leads")

    def close(self) -> None:
        if not self._owner:
            return  # another process's cluster
        for member in self.members:
            with contextlib.suppress(OSError):
                member.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
