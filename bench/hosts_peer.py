"""One end of a one-way transfer between two test-cluster hosts, for
bench/test_resync_hosts.py. Commands on stdin, one per line; answers on stdout.

    hosts_peer.py PATH recv HOST      -> "address A"; then "size N", "rounds K" (receive K buffers,
                                         acknowledging each with 8 bytes), "exit"
    hosts_peer.py PATH send ADDRESS   -> "size N", "round" (send one buffer, wait for its ack:
                                         answers "done"), "exit"

PATH: ucx (replica's UCX transport, digests off), ucx_verified (digests on), nixl and
nixl_verified (replica's NIXL transport), tcp (a plain socket: the link's limit), gloo
(torch.distributed send/recv)."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch

T = timedelta(seconds=120)
TOKEN = b"bench-hosts-token"
ACK = 8


def say(*words) -> None:
    print(*words, flush=True)


class Tcp:
    def __init__(self, role: str, where: str):
        if role == "recv":
            server = socket.socket()
            server.bind((where, 0))
            server.listen(1)
            say("address", f"{where}:{server.getsockname()[1]}")
            self.sock, _ = server.accept()
            server.close()
        else:
            host, port = where.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, buf: torch.Tensor, digest: int | None) -> None:
        self.sock.sendall(memoryview(buf.numpy()))

    def recv(self, buf: torch.Tensor) -> None:
        view, got = memoryview(buf.numpy()), 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("peer closed")
            got += n

    def close(self) -> None:
        self.sock.close()


class Ucx:
    """replica's UCX transport, or (``nixl``) its NIXL transport: the same calls."""

    def __init__(self, role: str, where: str, verify: bool, nixl: bool = False):
        if nixl:
            from replica.transport.nixl import NixlConfig as UcxConfig
            from replica.transport.nixl import NixlTransport as UcxTransport
        else:
            from replica.transport.ucx import UcxConfig, UcxTransport

        if role == "recv":
            self.transport = UcxTransport(UcxConfig(token=TOKEN, host=where, verify=verify))
            say("address", self.transport.listen())
            self.conn = self.transport.accept(T)
        else:
            self.transport = UcxTransport(UcxConfig(token=TOKEN, verify=verify))
            self.conn = self.transport.connect(where, T)

    def send(self, buf: torch.Tensor, digest: int | None) -> None:
        self.conn.send(buf, tag=1, timeout=T, digest=digest)

    def recv(self, buf: torch.Tensor) -> None:
        self.conn.recv(buf, tag=1, timeout=T)

    def close(self) -> None:
        self.transport.close()


class Gloo:
    def __init__(self, role: str, where: str):
        import torch.distributed as dist

        self.dist = dist
        if role == "recv":
            probe = socket.socket()
            probe.bind((where, 0))
            port = probe.getsockname()[1]
            probe.close()
            say("address", f"{where}:{port}")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{where if role == 'send' else f'{where}:{port}'}",
            rank=0 if role == "recv" else 1,
            world_size=2,
            timeout=T,
        )
        self.peer = 1 if role == "recv" else 0

    def send(self, buf: torch.Tensor, digest: int | None) -> None:
        self.dist.send(buf, dst=self.peer)

    def recv(self, buf: torch.Tensor) -> None:
        self.dist.recv(buf, src=self.peer)

    def close(self) -> None:
        self.dist.destroy_process_group()


def main() -> None:
    path, role, where = sys.argv[1:4]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    link = {
        "tcp": lambda: Tcp(role, where),
        "ucx": lambda: Ucx(role, where, False),
        "ucx_verified": lambda: Ucx(role, where, True),
        "gloo": lambda: Gloo(role, where),
        "nixl": lambda: Ucx(role, where, False, nixl=True),
        "nixl_verified": lambda: Ucx(role, where, True, nixl=True),
    }[path]()
    say("connected")
    ack = torch.zeros(ACK, dtype=torch.uint8)
    buf, digest = torch.empty(0, dtype=torch.uint8), None
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "size":
            buf = torch.randint(0, 256, (int(cmd[1]),), dtype=torch.uint8)
            if path.endswith("_verified"):
                from replica.transport.base import bucket_digest

                digest = bucket_digest(buf)  # taken when packing, as the mirror does
            say("ok")
        elif cmd[0] == "round":
            link.send(buf, digest)
            link.recv(ack)
            say("done")
        elif cmd[0] == "rounds":
            for _ in range(int(cmd[1])):
                link.recv(buf)
                link.send(ack, None)
            say("ok")
        else:
            break
    link.close()


if __name__ == "__main__":
    main()
