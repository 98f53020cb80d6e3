"""The etcd watch stream's own HTTP reading (``replica.jobstore.etcdwatch``), against a server
socket that sends what etcd's gateway sends, cut at every awkward place: messages
split across chunks and chunks split across reads, with pauses longer than a read's
deadline between them. (Against real etcd: tests/test_etcd.py.)"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta

import pytest

from replica.jobstore.etcdwatch import WatchBroken, WatchStream
from replica.timing import Deadline

MESSAGES = [
    {"result": {"created": True}},
    {"result": {"events": [{"kv": {"key": "aw==", "value": "dg=="}}]}},
    {"result": {"events": [{"type": "DELETE", "kv": {"key": "aw=="}}]}},
]


def _serve(pieces: list[bytes | float], *, head: bytes = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"):
    """A server socket that answers one request with ``head`` and then ``pieces`` (bytes
    sent as they are, floats: a pause), then closes; returns (endpoint, the request got)."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            length = int(data.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            while len(data.split(b"\r\n\r\n", 1)[1]) < length:
                data += conn.recv(4096)
            got.append(data)
            conn.sendall(head)
            for piece in pieces:
                if isinstance(piece, float):
                    time.sleep(piece)
                else:
                    conn.sendall(piece)
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[:2], got


def _chunked(payload: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes:
        out += f"{size:x}\r\n".encode() + payload[at : at + size] + b"\r\n"
        at += size
    assert at == len(payload)
    return out


def test_messages_come_whole_however_the_bytes_are_cut():
    payload = b"".join(json.dumps(m).encode() + b"\n" for m in MESSAGES)
    wire = _chunked(payload, [5, 40, 1, len(payload) - 46])
    pieces: list[bytes | float] = [wire[:3], 0.3, wire[3:50], wire[50:51], 0.3, wire[51:]]
    endpoint, got = _serve(pieces)
    stream = WatchStream(
        endpoint,
        "/v3/watch",
        {"create_request": {"key": "aw=="}},
        headers={"Authorization": "tok"},
        ssl_context=None,
        timeout=timedelta(seconds=5),
    )
    try:
        out: list[dict] = []
        timed_out = 0
        deadline = Deadline.after(timedelta(seconds=20))
        while len(out) < len(MESSAGES) and not deadline.expired:
            message = stream.next(
                Deadline.after(timedelta(milliseconds=50))
            )  # shorter than the pauses: reads run out, lose nothing
            if message is None:
                timed_out += 1
            else:
                out.append(message)
        assert out == MESSAGES and timed_out >= 2, (out, timed_out)
        request = got[0]
        assert request.startswith(b"POST /v3/watch HTTP/1.1\r\n") and b"Authorization: tok\r\n" in request
        assert json.loads(request.split(b"\r\n\r\n", 1)[1]) == {"create_request": {"key": "aw=="}}
        with pytest.raises(WatchBroken, match="closed"):
            stream.next(Deadline.after(timedelta(seconds=10)))
    finally:
        stream.close()


def test_a_refused_ended_or_garbled_watch_is_broken():
    endpoint, _ = _serve([], head=b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(WatchBroken, match="refused"):
        WatchStream(endpoint, "/v3/watch", {}, headers={}, ssl_context=None, timeout=timedelta(seconds=5))
    for wire, why in (
        (_chunked(b'{"result": {}}\n', [15]) + b"0\r\n\r\n", "ended"),
        (b"zz\r\nnot hex\r\n", "chunk size"),
        (_chunked(b"not json\n", [9]), "not a watch message"),
    ):
        endpoint, _ = _serve([wire, 5.0])
        stream = WatchStream(endpoint, "/v3/watch", {}, headers={}, ssl_context=None, timeout=timedelta(seconds=5))
        with pytest.raises(WatchBroken, match=why):
            while True:
                stream.next(Deadline.after(timedelta(seconds=10)))
        stream.close()
    with pytest.raises(WatchBroken):  # nobody listens
        probe = socket.create_server(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        WatchStream(("127.0.0.1", port), "/v3/watch", {}, headers={}, ssl_context=None, timeout=timedelta(seconds=2))
