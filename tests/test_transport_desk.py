"""The desk (``replica.transport.desk``): named blobs between the job's processes over real
TCP sockets, behind the job token's handshake; and the rollouts' token blobs
(``replica.roles.rollout_data``)."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest

from replica.errors import AuthenticationError, PeerDisconnectedError, TransferTimeoutError
from replica.roles.rollout_data import KEPT_REQUESTS, decode_tokens, encode_tokens, kept_blob
from replica.transport.desk import Desk, DeskClient, blob_digest
from replica.transport.handshake import parse_address

TOKEN = b"desk-token"


def test_blobs_go_both_ways_and_a_missing_one_says_so():
    put = []
    with Desk(token=TOKEN, on_put=put.append) as desk, DeskClient(desk.address, token=TOKEN) as client:
        assert desk.address.startswith("127.0.0.1:")  # loopback unless told otherwise
        desk.put("result/1/0", b"abc")
        assert client.get("result/1/0") == b"abc"
        assert client.get("result/1/1") is None
        big = os.urandom(48 << 20)  # a step's completions are tens of MB
        client.put("prompts/2", big)
        assert put == ["prompts/2"] and desk.get("prompts/2") == big
        assert blob_digest(client.get("prompts/2")) == blob_digest(big)
        client.put("empty", b"")
        assert client.get("empty") == b""
        assert desk.drop(lambda name: name.startswith("prompts/")) == 2 and desk.names() == ["prompts/2"]


def test_a_peer_without_the_token_gets_nothing():
    with Desk(token=TOKEN) as desk:
        desk.put("result/1/0", b"secret completions")
        with pytest.raises(AuthenticationError):
            DeskClient(desk.address, token=b"another job").get("result/1/0")
        raw = socket.create_connection(parse_address(desk.address))
        raw.sendall(b"\x01\x00\x00GET result/1/0")  # no handshake: refused, the blob never sent
        raw.shutdown(socket.SHUT_WR)
        raw.settimeout(10)
        data = b""
        try:
            while chunk := raw.recv(1 << 16):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        raw.close()
        assert b"secret" not in data
        with DeskClient(desk.address, token=TOKEN) as client:  # the desk still serves the job
            assert client.get("result/1/0") == b"secret completions"


def test_a_gone_desk_and_a_silent_one_fail_within_the_deadline():
    desk = Desk(token=TOKEN)
    client = DeskClient(desk.address, token=TOKEN, timeout=timedelta(seconds=2))
    assert client.get("x") is None
    desk.close()
    with pytest.raises(PeerDisconnectedError):
        client.get("x")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts in the kernel, never answers: a frozen engine
    host, port = silent.getsockname()
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError):
        DeskClient(f"{host}:{port}", token=TOKEN, timeout=timedelta(seconds=1)).get("x")
    assert time.monotonic() - start < 5 * 1 + 5
    silent.close()


def test_clients_in_threads_and_bad_names():
    with Desk(token=TOKEN) as desk:
        errors = []

        def work(i: int) -> None:
            try:
                with DeskClient(desk.address, token=TOKEN) as client:
                    for j in range(20):
                        client.put(f"b/{i}/{j}", bytes([i]) * (j + 1))
                        assert client.get(f"b/{i}/{j}") == bytes([i]) * (j + 1)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and len(desk.names()) == 160
        with pytest.raises(ValueError, match="name"):
            desk.put("", b"x")
        with DeskClient(desk.address, token=TOKEN) as client, pytest.raises(ValueError, match="name"):
            client.get("n" * 2000)
    with pytest.raises(ValueError, match="token"):
        Desk(token=b"")


def test_token_blobs_round_trip_and_refuse_what_is_not_one():
    seqs = [[1, 2, 3], [], [2**31 - 1, 0, 7], [5] * 1000]
    assert decode_tokens(encode_tokens(seqs)) == seqs
    assert decode_tokens(encode_tokens([])) == []
    blob = encode_tokens(seqs)
    for bad in (b"", blob[:-1], blob + b"\0\0\0\0", b"\xff\xff\xff\xff"):
        with pytest.raises(ValueError):
            decode_tokens(bad)
    with pytest.raises(ValueError, match="int32"):
        encode_tokens([[2**31]])
    assert kept_blob("result/20/1", 20) and kept_blob(f"prompts/{21 - KEPT_REQUESTS}", 20)
    assert not kept_blob(f"prompts/{20 - KEPT_REQUESTS}", 20) and not kept_blob("odd", 20)


def test_a_refused_request_names_why():
    with Desk(token=TOKEN) as desk, DeskClient(desk.address, token=TOKEN) as client:
        client.get("warm")  # connected, handshake done
        client._sock.sendall(b"\x09\x01\x00" + b"\0" * 8 + b"x")  # an op no desk knows
        status = client._sock.recv(1)
        assert status == b"\x02"  # REFUSED
