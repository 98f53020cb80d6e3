"""One side of a UCX (or, with a fourth argument ``nixl``, NIXL) transfer between
test-cluster hosts (tests/test_hosts.py, tests/test_transport_nixl.py).

    ucx_peer.py listen HOST NBYTES   -> prints "address A", receives NBYTES, prints "received SUM"
    ucx_peer.py send ADDRESS NBYTES  -> sends NBYTES of 7s, prints "sent"
    ucx_peer.py listen HOST 0        -> prints "address A", accepts one peer and keeps it
    ucx_peer.py hold ADDRESS 0       -> connects, prints "connected", and "lost" once the
                                        connection is found dead (nothing is sent on it)
The token comes from REPLICA_TOKEN."""

import os
import sys
import time
from datetime import timedelta

import torch

from replica import envvars
from replica.errors import PeerDisconnectedError

T = timedelta(seconds=60)


def _backend(name: str):
    if name == "nixl":
        from replica.transport.nixl import NixlConfig, NixlTransport

        return NixlConfig, NixlTransport
    from replica.transport.ucx import UcxConfig, UcxTransport

    return UcxConfig, UcxTransport


def main() -> None:
    mode, where, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    UcxConfig, UcxTransport = _backend(sys.argv[4] if len(sys.argv) > 4 else "ucx")
    token = os.environ[envvars.TOKEN].encode()
    if mode == "hold":
        with UcxTransport(UcxConfig(token=token)) as transport:
            conn = transport.connect(where, T)
            print("connected", flush=True)
            while conn.alive:
                time.sleep(0.02)
            print("lost", flush=True)
    elif mode == "listen":
        with UcxTransport(UcxConfig(token=token, host=where)) as transport:
            print("address", transport.listen(), flush=True)
            conn = transport.accept(T)
            if nbytes == 0:
                time.sleep(3600)
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            conn.recv(buf, tag=1, timeout=T)
            print("received", int(buf.sum()), flush=True)
            # Whoever leaves first closes the connection, which fails what the other has not
            # received yet: the sender's ack is posted before its data, and this side stays
            # until the sender says it has the ack (or has left, which it does only after).
            bye = conn.irecv(torch.empty(1, dtype=torch.uint8), tag=3)
            conn.send(torch.ones(1, dtype=torch.uint8), tag=2, timeout=T)
            try:
                bye.wait(T)
            except PeerDisconnectedError as exc:
                if not exc.graceful:
                    raise
    else:
        with UcxTransport(UcxConfig(token=token)) as transport:
            conn = transport.connect(where, T)
            ack = conn.irecv(torch.empty(1, dtype=torch.uint8), tag=2)
            conn.send(torch.full((nbytes,), 7, dtype=torch.uint8), tag=1, timeout=T)
            ack.wait(T)
            conn.send(torch.ones(1, dtype=torch.uint8), tag=3, timeout=T)
            print("sent", flush=True)


if __name__ == "__main__":
    main()
