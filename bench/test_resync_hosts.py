"""One-way resync bandwidth between two hosts of a network-namespace test cluster
(tests/support/cluster.py): replica's UCX transport (tcp over the veth link: the hosts
are told apart by address), with digests off and on, beside gloo send/recv and a
plain TCP socket (the link's limit) on the same link, in one run. Each round
sends one buffer and waits for an 8-byte acknowledgement. `make bench` writes
bench/results/resync_hosts.json and resync_hosts.md; skipped without root and `ip netns`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_results import machine, write_results

from replica.transport.nixl_agent import nixl_installed
from support import cluster as testcluster
from support.cluster import ClusterConfig, NetnsCluster

pytestmark = [pytest.mark.netns, pytest.mark.skipif(not testcluster.available(), reason="needs root and `ip netns`")]

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "bench" / "hosts_peer.py"
MiB = 1 << 20
SIZES = [1 * MiB, 64 * MiB]
ROUNDS = {1 * MiB: 50, 64 * MiB: 10}
NIXL_PATHS = ["nixl", "nixl_verified"] if nixl_installed() else []
PATHS = ["tcp", "ucx", "ucx_verified", "gloo", *NIXL_PATHS]
NIXL_TARGET = 0.8  # NIXL against replica's UCX backend at 64 MiB between hosts
SMOKE_PARAMS = {
    "pair": {"ucx_verified", *NIXL_PATHS[1:]}
}  # `make test`: one path across the link (the others: `make bench`)

_medians: dict[str, dict[int, float]] = {}


class _Peer:
    """hosts_peer.py on a host, driven line by line."""

    def __init__(self, host, *args: str):
        env = dict(os.environ, UCX_LOG_LEVEL="fatal", PYTHONPATH=str(ROOT))
        if args[0].startswith("nixl"):
            # NIXL's UCX reads UCX_TLS from the environment: these hosts share one machine,
            # where it would write through the kernel (cma) and leave the link alone.
            env["UCX_TLS"] = "tcp,self"
        self.proc = host.popen(
            [sys.executable, str(PEER), *args],
            env=env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def ask(self, line: str | None = None) -> list[str]:
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        while answer := self.proc.stdout.readline():
            words = answer.split()
            if words[:1] in (["address"], ["connected"], ["ok"], ["done"]):
                return words
        raise RuntimeError(f"the peer ended (exit code {self.proc.wait()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def cluster():
    with NetnsCluster(ClusterConfig(hosts=2, prefix=f"rpb{os.getpid() % 100000}")) as c:
        yield c


@pytest.fixture(scope="module", params=PATHS)
def pair(request, cluster):
    sender_host, receiver_host = cluster.hosts
    receiver = _Peer(receiver_host, request.param, "recv", receiver_host.address)
    sender = None
    try:
        address = receiver.ask()
        assert address[0] == "address", address
        sender = _Peer(sender_host, request.param, "send", address[1])
        assert sender.ask() == ["connected"] and receiver.ask() == ["connected"]
        yield request.param, sender, receiver, sender_host
    finally:
        for peer in (sender, receiver):
            if peer is not None:
                peer.close()


@pytest.mark.parametrize("nbytes", SIZES, ids=lambda n: f"{n // MiB}MiB")
def test_between_hosts(benchmark, pair, nbytes):
    name, sender, receiver, sender_host = pair
    rounds = 1 if benchmark.disabled else ROUNDS[nbytes]
    warmup = 0 if benchmark.disabled else 2
    assert sender.ask(f"size {nbytes}") == ["ok"] and receiver.ask(f"size {nbytes}") == ["ok"]
    receiver.proc.stdin.write(f"rounds {rounds + warmup}\n")
    receiver.proc.stdin.flush()
    sent_before = sender_host.link_bytes()[1]
    benchmark.extra_info.update(path=name, bytes=nbytes)
    benchmark.pedantic(lambda: sender.ask("round"), rounds=rounds, warmup_rounds=warmup, iterations=1)
    assert receiver.ask() == ["ok"]
    crossed = sender_host.link_bytes()[1] - sent_before
    assert crossed >= (rounds + warmup) * nbytes, f"{name}: {crossed} bytes crossed the link"
    if not benchmark.disabled:
        _medians.setdefault(name, {})[nbytes] = benchmark.stats.stats.median


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if any(set(_medians.get(p, {})) != set(SIZES) for p in PATHS):
        return  # benchmarks disabled (CI smoke run) or some were deselected
    gbps = {p: {n: n / _medians[p][n] / 1e9 for n in SIZES} for p in PATHS}
    big = SIZES[-1]
    result = {
        "ucx_vs_tcp_limit": gbps["ucx"][big] / gbps["tcp"][big],
        "ucx_vs_gloo": gbps["ucx"][big] / gbps["gloo"][big],
        "ucx_digests_vs_plain": gbps["ucx_verified"][big] / gbps["ucx"][big],
        **(
            {
                "nixl_vs_ucx": gbps["nixl"][big] / gbps["ucx"][big],
                "nixl_verified_vs_ucx_verified": gbps["nixl_verified"][big] / gbps["ucx_verified"][big],
                "nixl_target": NIXL_TARGET,
            }
            if NIXL_PATHS
            else {}
        ),
        "at_bytes": big,
        "gbps": {p: {f"{n // MiB}MiB": v for n, v in by.items()} for p, by in gbps.items()},
        "machine": machine(),
        "link": "veth pair through a Linux bridge, network namespaces on one machine",
    }
    labels = {
        "tcp": "plain TCP socket (the link's limit)",
        "ucx": "replica/UCX (tcp between hosts)",
        "ucx_verified": "replica/UCX, digests on",
        "gloo": "gloo send/recv",
        "nixl": "replica/NIXL (UCX plugin, tcp)",
        "nixl_verified": "replica/NIXL, digests on",
    }
    labels = {p: label for p, label in labels.items() if p in PATHS}
    lines = [
        "### resync between two hosts (network namespaces, veth + bridge), one way (GB/s, medians)\n",
        "| path | 1 MiB | 64 MiB | vs TCP limit @64 MiB |",
        "|---|---|---|---|",
    ]
    for p, label in labels.items():
        lines.append(
            f"| {label} | "
            + " | ".join(f"{gbps[p][n]:.2f}" for n in SIZES)
            + f" | {gbps[p][big] / gbps['tcp'][big]:.2f}x |"
        )
    if NIXL_PATHS:
        lines.append(
            f"\nNIXL / UCX at 64 MiB: {result['nixl_vs_ucx']:.2f}x digests off, "
            f"{result['nixl_verified_vs_ucx_verified']:.2f}x digests on (target >= {NIXL_TARGET})"
        )
    write_results("resync_hosts", result, lines)
