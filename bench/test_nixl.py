"""The NIXL backend beside replica's UCX backend on this machine, in one run:

* one-way resync between two processes, 512 MiB (1 MiB in `make test`'s smoke run),
  digests off and on, NIXL and UCX pairs alive together and timed in alternate rounds
  over sessions of fresh pairs (on two cores a pair keeps its pace for its life:
  test_resync.py), each round a buffer and its 8-byte acknowledgement; both ends of
  every pair in processes of their own, this one only says when (a process that holds
  ucxx's UCX slows NIXL's: replica.transport.nixl_agent);
* what NIXL costs a failover: a fresh process's agent start (its UCX plugin's context
  and worker: made when the transport is, at the role's start) and a connection to a
  listening peer (the handshake with the agents' metadata), beside UCX's.

`make bench` writes bench/results/nixl.json and nixl.md. Between hosts: test_resync_hosts.py
(its nixl paths); the weight push: test_weight_push.py (weight_push_nixl)."""

from __future__ import annotations

import contextlib
import functools
import statistics
import time

import pytest
import torch
from bench_results import machine, write_results

from replica.transport.base import PIECE_BYTES, bucket_digest
from replica.transport.nixl_agent import nixl_installed
from support.children import spawn
from support.transfer import TOKEN, UCX_PATHS, RawUcx, T, make_ucx, transport_peer

pytestmark = pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install 'replica[nixl]')")

MiB = 1 << 20
BYTES, SESSIONS, ROUNDS = 512 * MiB, 3, 6
TARGET = 0.9  # NIXL against replica's UCX backend, same transfer, same node
PATHS = ("raw_ucx", "ucx_default", "ucx_default_verified", "nixl", "nixl_verified")
SMOKE_PATHS = ("ucx_default", "nixl_verified")  # `make test`: the code, both backends, digests once
SMOKE_PARAMS = {"name": {"nixl"}}  # test_startup_and_connection: NIXL's (UCX's is timed in `make bench`)

_seconds: dict[str, list[float]] = {}
_startup: dict[str, dict[str, float]] = {}


def _make_nixl(verify: bool):
    from replica.transport.nixl import NixlConfig, NixlTransport

    return NixlTransport(NixlConfig(token=TOKEN, verify=verify))


def _maker(name: str):
    if name.startswith("nixl"):
        return functools.partial(_make_nixl, name.endswith("verified"))
    return functools.partial(make_ucx, *UCX_PATHS[name])


def _sender(pipe, name: str) -> None:
    """A path's sending end, in a process of its own: NIXL's UCX and ucxx's must not share
    one (see replica.transport.nixl_agent). Listens, accepts the receiving end, then sends
    one buffer per "round" and waits for its acknowledgement."""
    with _maker(name)() as transport:
        pipe.send(("address", transport.listen()))
        conn = transport.accept(T)
        ack = torch.zeros(8, dtype=torch.uint8)
        buf, digest = None, None
        while True:
            cmd = pipe.recv()
            if cmd[0] == "size":
                buf = torch.randint(0, 256, (cmd[1],), dtype=torch.uint8)
                digest = bucket_digest(buf)  # the pack's, before the transfer (as in the mirror)
                pipe.send(("ok",))
            elif cmd[0] == "round":
                got = conn.irecv(ack, tag=2)
                conn.send(buf, tag=1, timeout=T, digest=digest)
                got.wait(T)
                pipe.send(("done",))
            else:
                break
        conn.close()


def _raw_receiver(pipe) -> None:
    """Raw UCX's receiving end (``support.transfer.RawUcx``: ucxx tag messages of PIECE_BYTES,
    no protocol, no digests), speaking ``transport_peer``'s commands."""
    with RawUcx(token=TOKEN, timeout=T) as raw:
        pipe.send(("address", raw.listen()))
        buf = None
        while (cmd := pipe.recv())[0] != "exit":
            if cmd[0] == "size":
                buf = torch.empty(cmd[1], dtype=torch.uint8)
                pipe.send(("ok",))
            elif cmd[0] == "rounds":
                for _ in range(cmd[1]):
                    raw.receive(buf, PIECE_BYTES)
                pipe.send(("ok",))


def _raw_sender(pipe) -> None:
    with RawUcx(token=TOKEN, timeout=T) as raw:
        address, buf = pipe.recv()[0], None
        while (cmd := pipe.recv())[0] != "exit":
            if cmd[0] == "size":
                buf = torch.randint(0, 256, (cmd[1],), dtype=torch.uint8)
                pipe.send(("ok",))
            elif cmd[0] == "round":
                raw.send(address, buf, PIECE_BYTES)
                pipe.send(("done",))


@contextlib.contextmanager
def _ends(name: str):
    """(sender, receiver) of ``name``, connected."""
    if name == "raw_ucx":
        with spawn(_raw_receiver, name="raw-recv") as receiver, spawn(_raw_sender, name="raw-send") as sender:
            reply = receiver.recv(timeout=120)
            assert reply[0] == "address", reply
            sender.send(reply[1])
            yield sender, receiver
        return
    with (
        spawn(_sender, name, name=f"{name}-send") as sender,
        spawn(transport_peer, _maker(name), "cpu", name=f"{name}-recv") as receiver,
    ):
        reply = sender.recv(timeout=120)
        assert reply[0] == "address", reply
        receiver.send(reply[1])
        yield sender, receiver


@contextlib.contextmanager
def _path(name: str):
    """Both ends of ``name`` in processes of their own; yields them and a function that
    runs one round (a buffer one way, its acknowledgement back)."""
    with _ends(name) as (sender, receiver):

        def one_round() -> None:
            assert sender.request("round") == ("done",)

        try:
            yield sender, receiver, one_round
        finally:
            with contextlib.suppress(Exception):
                receiver.send("exit")
                sender.send("exit")


def test_nixl_against_ucx_interleaved(benchmark):
    nbytes = MiB if benchmark.disabled else BYTES
    sessions, rounds, warmup = (1, 1, 0) if benchmark.disabled else (SESSIONS, ROUNDS, 1)
    names = SMOKE_PATHS if benchmark.disabled else PATHS
    seconds: dict[str, list[float]] = {name: [] for name in names}

    def session() -> None:
        with contextlib.ExitStack() as stack:
            paths = {name: stack.enter_context(_path(name)) for name in names}
            for sender, receiver, _ in paths.values():
                assert sender.request("size", nbytes) == ("ok",) and receiver.request("size", nbytes) == ("ok",)
                receiver.send("rounds", rounds + warmup)
            for r in range(rounds + warmup):
                for name in names[:: 1 if r % 2 else -1]:
                    start = time.perf_counter()
                    paths[name][2]()
                    if r >= warmup:
                        seconds[name].append(time.perf_counter() - start)
            for _, receiver, _ in paths.values():
                assert receiver.recv(timeout=300) == ("ok",)

    benchmark.extra_info.update(bytes=nbytes, sessions=sessions, rounds=rounds)
    benchmark.pedantic(session, rounds=sessions, iterations=1)
    assert all(len(s) == sessions * rounds and min(s) > 0 for s in seconds.values())
    if not benchmark.disabled:
        _seconds.update(seconds)


def _time_startup(pipe, name: str) -> None:
    """In a fresh process: the transport's construction (NIXL: the agent's start) and its
    connection to the listener whose address comes over ``pipe``."""
    start = time.perf_counter()
    transport = _maker(name)()
    made = time.perf_counter() - start
    address = pipe.recv()[0]
    start = time.perf_counter()
    conn = transport.connect(address, T)
    connected = time.perf_counter() - start
    pipe.send(("ok", made, connected))
    pipe.recv()
    conn.close()
    transport.close()


@pytest.mark.parametrize("name", ["ucx_default", "nixl"])
def test_startup_and_connection(benchmark, name):
    tries = 1 if benchmark.disabled else 5
    made, connected = [], []

    def one() -> None:
        with _maker(name)() as listener, spawn(_time_startup, name, name=f"{name}-start") as child:
            child.send(listener.listen())
            listener.accept(T)
            reply = child.recv(timeout=120)
            child.send("bye")
        assert reply[0] == "ok" and reply[1] > 0 and reply[2] > 0, reply
        made.append(reply[1])
        connected.append(reply[2])

    benchmark.pedantic(one, rounds=tries, iterations=1)
    if not benchmark.disabled:
        _startup[name] = {
            "make_s": statistics.median(made),
            "connect_s": statistics.median(connected),
            "make_max_s": max(made),
            "connect_max_s": max(connected),
        }


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if set(_seconds) != set(PATHS) or set(_startup) != {"ucx_default", "nixl"}:
        return  # benchmarks disabled (CI smoke run) or some were deselected
    med = {name: statistics.median(v) for name, v in _seconds.items()}
    gbps = {name: BYTES / s / 1e9 for name, s in med.items()}
    result = {
        "bytes": BYTES,
        "gbps": gbps,
        "ms": {name: [s * 1e3 for s in v] for name, v in _seconds.items()},
        "nixl_vs_ucx": med["ucx_default"] / med["nixl"],
        "nixl_verified_vs_ucx_verified": med["ucx_default_verified"] / med["nixl_verified"],
        "nixl_vs_raw_ucx": med["raw_ucx"] / med["nixl"],
        "target": TARGET,
        "startup": _startup,
        "machine": machine(),
    }
    labels = {
        "raw_ucx": "raw UCX (ucxx tag messages of 16 MiB, no protocol, no digests)",
        "ucx_default": "replica/UCX, default (shared-memory FIFOs)",
        "ucx_default_verified": "replica/UCX, default, digests on",
        "nixl": "replica/NIXL, UCX plugin, defaults (cma within a node)",
        "nixl_verified": "replica/NIXL, digests on",
    }
    lines = [
        f"### NIXL beside UCX, {BYTES // MiB} MiB one way between two processes, alternate rounds "
        f"({SESSIONS} sessions x {ROUNDS} rounds; GB/s, medians)\n",
        "| path | GB/s | rounds (ms) |",
        "|---|---|---|",
    ]
    for name, label in labels.items():
        v = _seconds[name]
        lines.append(f"| {label} | {gbps[name]:.2f} | {min(v) * 1e3:.0f}-{max(v) * 1e3:.0f} |")
    ok = lambda r: "yes" if r >= TARGET else "**no**"  # noqa: E731
    lines.append(
        f"\nNIXL / UCX: {result['nixl_vs_ucx']:.2f}x digests off ({ok(result['nixl_vs_ucx'])}), "
        f"{result['nixl_verified_vs_ucx_verified']:.2f}x digests on "
        f"({ok(result['nixl_verified_vs_ucx_verified'])}); target >= {TARGET}. NIXL / raw UCX: "
        f"{result['nixl_vs_raw_ucx']:.2f}x."
    )
    lines.append("\n| start-up, fresh process (medians of 5; max) | transport made | connected |")
    lines.append("|---|---|---|")
    for name in ("ucx_default", "nixl"):
        s = _startup[name]
        lines.append(
            f"| {name} | {s['make_s'] * 1e3:.0f} ms ({s['make_max_s'] * 1e3:.0f}) | "
            f"{s['connect_s'] * 1e3:.0f} ms ({s['connect_max_s'] * 1e3:.0f}) |"
        )
    write_results("nixl", result, lines)
