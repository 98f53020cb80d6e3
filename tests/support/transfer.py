"""Transfers between two processes for the transport benchmarks: the raw baseline (one
buffer as buckets, all in flight at once, then an acknowledgement: ``send_bucketed``,
``receive_bucketed``, ``RawUcx``) and a peer process at the other end of a transport
(``transport_path``)."""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import torch

from support.children import spawn

__all__ = [
    "RawUcx",
    "T",
    "TOKEN",
    "UCX_PATHS",
    "make_ucx",
    "receive_bucketed",
    "send_bucketed",
    "transport_path",
    "transport_peer",
]

# The raw-transport baseline of the benchmarks: one buffer as buckets, all in flight at once,
# then an 8-byte acknowledgement. What a bucket stream would move with nothing of its own.
_BUCKET_TAG, _ACK_TAG = 16, 2


def _bucket_views(buf, bucket_bytes: int) -> list:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return [buf[lo : lo + bucket_bytes] for lo in range(0, buf.numel(), bucket_bytes)]


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
        send_bucketed(self._conn, buf, bucket_bytes, ack=self._ack, timeout=self._timeout)
        return time.perf_counter() - start

    def receive(self, buf, bucket_bytes: int) -> None:
        """One round into ``buf``, from the end that connected to ``listen``'s address."""
        if self._conn is None:
            self._conn = self._transport.accept(self._timeout)
        receive_bucketed(self._conn, buf, bucket_bytes, ack=self._ack, timeout=self._timeout)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> RawUcx:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The transport benchmarks' paths (bench/test_resync.py, bench/test_nixl.py,
# bench/weight_sync_run.py): a transport to a peer process on this machine.
T = timedelta(seconds=120)
TOKEN = b"bench-token"

UCX_PATHS = {
    # name: (UCX_TLS, verify digests[, polling progress])
    # The progress thread spinning instead of sleeping in epoll (UcxConfig.polling_progress).
    # First: pytest keeps the last parameter's pair of processes until the module ends, and
    # two spinning threads would take both cores from every benchmark after them (the shm
    # backend's 512 MiB took 40 ms beside them instead of 20).
    "ucx_default_polling": ("^cma,knem,xpmem", False, True),
    "ucx_default_polling_verified": ("^cma,knem,xpmem", True, True),
    "ucx_shm": ("posix,sysv,self", False),
    "ucx_cma": ("sm,self", False),  # sm includes cma, which takes the large transfers
    "ucx_tcp": ("tcp", False),
    "ucx_default": ("^cma,knem,xpmem", False),
    "ucx_default_verified": ("^cma,knem,xpmem", True),
}


def transport_peer(pipe, make, device: str) -> None:
    """The far end of ``transport_path``, in a child: connects with ``make()``'s transport to
    the address it is sent, then receives the rounds it is told to (``size``, ``rounds``,
    ``bucketed_rounds``), acknowledging each, until ``exit`` or its pipe closes."""
    transport = make()
    conn = transport.connect(pipe.recv()[0], T)
    ack = torch.zeros(8, dtype=torch.uint8)
    while True:
        try:
            cmd = pipe.recv()
        except EOFError:  # the benchmark process is gone
            break
        if cmd[0] == "size":
            buf = torch.empty(cmd[1], dtype=torch.uint8, device=device)
            pipe.send(("ok",))
        elif cmd[0] == "rounds":
            for _ in range(cmd[1]):
                conn.recv(buf, tag=1, timeout=T)
                conn.send(ack, tag=2, timeout=T)
            pipe.send(("ok",))
        elif cmd[0] == "bucketed_rounds":  # the buffer as buckets of cmd[2] bytes, all posted at once
            rounds, bucket = cmd[1], cmd[2]
            for _ in range(rounds):
                receive_bucketed(conn, buf, bucket, ack=ack, timeout=T)
            pipe.send(("ok",))
        else:
            break
    transport.close()
    with contextlib.suppress(OSError):
        pipe.send(("closed",))


def make_ucx(tls: str, verify: bool, polling: bool = False):
    """A UCX transport limited to ``tls`` (UCX_TLS), its digests checked or not."""
    from replica.transport.ucx import UcxConfig, UcxTransport

    return UcxTransport(UcxConfig(token=TOKEN, ucx_transports=tls, verify=verify, polling_progress=polling))


@contextlib.contextmanager
def transport_path(name: str, make, device: str):
    """``(name, peer, one_round)``: a transport made by ``make`` here and a ``transport_peer``
    child connected to it; ``one_round(buf, digest)`` sends ``buf`` and waits for the peer's
    acknowledgement (``one_round.bucketed(buf, bucket_bytes)``: the raw bucketed baseline)."""
    with make() as transport, spawn(transport_peer, make, device, name=f"{name}-peer") as peer:
        peer.send(transport.listen())
        conn = transport.accept(T)
        ack = torch.zeros(8, dtype=torch.uint8)

        def one_round(buf, digest):
            got = conn.irecv(ack, tag=2)
            conn.send(buf, tag=1, timeout=T, digest=digest)
            got.wait(T)

        one_round.bucketed = lambda buf, bucket: send_bucketed(conn, buf, bucket, ack=ack, timeout=T)
        try:
            yield name, peer, one_round
        finally:  # the peer closes its side first (one stuck after a failure is killed by spawn)
            with contextlib.suppress(Exception):
                peer.send("exit")
                peer.recv(timeout=10)
