"""The transport contract against the NIXL backend (NIXL's UCX plugin, host memory: no
GPU here), its registrations, its errors, and a transfer between two network-namespace
hosts. Skipped where NIXL is not installed (`make test` installs it: replica[nixl])."""

from __future__ import annotations

import functools
from datetime import timedelta

import pytest
import torch

from replica.errors import TransportError
from replica.session import backends
from replica.transport.base import PIECE_BYTES
from replica.transport.nixl_agent import nixl_installed
from support.children import spawn
from support.host_job import python_on, reap
from support.nixl import make_nixl
from support.transport_contract import (
    CHECKS,
    MiB,
    T,
    check_missing_token_refused,
    check_round_trip_sizes,
    connected,
    empty,
    messages_of_a_bucket,
    pair,
    pattern,
    peer_main,
    run_transport_contract,
)

pytestmark = pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install 'replica[nixl]')")


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_contract_nixl(check):
    run_transport_contract(make_nixl, check)


@pytest.mark.slow  # `make test-slow`: 512 MiB goes in check_peer_killed_mid_transfer already
def test_round_trip_512_mib():
    run_transport_contract(make_nixl, functools.partial(check_round_trip_sizes, sizes=(512 * MiB,)))


def test_a_large_bucket_goes_in_pieces_and_small_ones_whole():
    assert messages_of_a_bucket(make_nixl, 2 * PIECE_BYTES + 4099) == [PIECE_BYTES, PIECE_BYTES, 4099]


def test_a_storage_is_registered_once_for_every_bucket_in_it():
    """Buckets sent from slices of one buffer into slices of another: each side registers
    its storage once, whatever the number of buckets; the bytes arrive exact."""
    with make_nixl(b"job-token") as server, make_nixl(b"job-token") as client:
        conn, other = pair(server, client)
        before = client.agent.registrations
        source, target = pattern(32 * MiB, 4), empty(32 * MiB, "cpu", fill=0)
        for _ in range(3):
            receives = [other.irecv(target[i * 4 * MiB : (i + 1) * 4 * MiB], tag=7) for i in range(8)]
            for i in range(8):
                conn.send(source[i * 4 * MiB : (i + 1) * 4 * MiB], tag=7, timeout=T, bucket=i)
            assert [r.wait(T).bucket for r in receives] == list(range(8))
        assert torch.equal(source, target)
        # One process, one agent: both storages, once each.
        assert client.agent.registrations - before == 2, client.agent.registrations - before
        # Dropped by their owner, they are deregistered (at the agent's next look): the memory goes back.
        bases = {source.untyped_storage().data_ptr(), target.untyped_storage().data_ptr()}
        assert {r.base for r in client.agent._regions.values()} >= bases
        del source, target, receives  # the transfers hold their buffers too
        client.agent.release_idle()
        assert not bases & {r.base for r in client.agent._regions.values()}, "a dropped storage stayed registered"


def _receive_into_fresh_buffers(pipe, nbytes: int, count: int) -> None:
    """Connect to the address sent; receive ``count`` buckets, each into a buffer of its own
    that is dropped before the next; send back where each lay and what it held."""
    with make_nixl(b"job-token") as transport:
        conn = transport.connect(pipe.recv()[0], T)
        where, held = [], []
        for _ in range(count):
            buf = torch.empty(nbytes, dtype=torch.uint8)
            where.append(buf.data_ptr())
            conn.recv(buf, tag=5, timeout=T)
            held.append((int(buf.min()), int(buf.max())))
            del buf
        pipe.send((where, held, transport.agent.registered))
        pipe.recv()  # the sender has what it needs: the connection may go


def test_a_new_buffer_where_a_deregistered_one_lay_receives_exact():
    """A receiver that drops each buffer after use: its registration goes (the memory goes
    back), and the allocator hands the same address to a later buffer, registered anew with
    fresh metadata. The sender's NIXL still holds the old metadata for that range (it has no
    call to forget one registration of a peer); every write lands exact all the same, and the
    receiver holds at most two registrations."""
    nbytes, count = 4 * MiB, 12
    with make_nixl(b"job-token") as transport, spawn(_receive_into_fresh_buffers, nbytes, count) as peer:
        peer.send(transport.listen())
        conn = transport.accept(T)
        for i in range(count):
            conn.send(torch.full((nbytes,), i, dtype=torch.uint8), tag=5, timeout=T)
        where, held, registered = peer.recv()
        peer.send("done")
    assert held == [(i, i) for i in range(count)]
    assert len(set(where)) < count, "no address came back: the case was not made"
    assert registered <= 2, registered


def test_a_send_larger_than_its_receive_is_refused_by_the_receiver():
    with make_nixl(b"job-token") as server, make_nixl(b"job-token") as client:
        conn, other = pair(server, client)
        receive = other.irecv(empty(MiB, "cpu", fill=0), tag=3)
        conn.send(pattern(2 * MiB, 1), tag=3, timeout=T)
        with pytest.raises(TransportError, match="bytes into a"):
            receive.wait(T)


def test_small_messages_need_no_posted_receive():
    """Messages under INLINE_BYTES go at once, like UCX's eager sends: both sides may send
    before either posts its receive."""
    from replica.transport.nixl import INLINE_BYTES

    with make_nixl(b"job-token") as server, make_nixl(b"job-token") as client:
        conn, other = pair(server, client)
        small = pattern(INLINE_BYTES - 8, 2)
        conn.send(small, tag=9, timeout=timedelta(seconds=5))
        other.send(small, tag=9, timeout=timedelta(seconds=5))
        for side in (conn, other):
            back = empty(small.numel(), "cpu", fill=0)
            side.recv(back, tag=9, timeout=T)
            assert torch.equal(back, small)


def test_a_plugin_nixl_does_not_have_is_refused_naming_what_it_has():
    with pytest.raises(TransportError, match="NIXL has no backend 'NOSUCH'.*UCX"):
        make_nixl(b"job-token", plugin="NOSUCH")
    with pytest.raises(ValueError, match="capitals"):
        make_nixl(b"job-token", plugin="ucx")
    with pytest.raises(ValueError, match="pairs of str"):
        make_nixl(b"job-token", plugin_params=(("num_workers", 1),))


def test_the_environment_names_the_plugin_and_a_bad_one_stops_the_launch():
    assert backends.nixl_options({"REPLICA_NIXL_BACKEND": "LIBFABRIC", "REPLICA_NIXL_PARAMS": "a=1, b=x"}) == {
        "plugin": "LIBFABRIC",
        "plugin_params": (("a", "1"), ("b", "x")),
    }
    with pytest.raises(ValueError, match="name=value"):
        backends.nixl_options({"REPLICA_NIXL_PARAMS": "junk"})

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REPLICA_NIXL_BACKEND", "NOSUCH")
        with pytest.raises(TransportError, match="NOSUCH"):
            backends.check_backends(("nixl", "gloo"))
    backends.check_backends(("nixl",))  # the default plugin is there


def test_nixl_named_but_not_installed_is_one_clear_error(monkeypatch):
    # NIXL is installed here, so its absence is simulated where the backend looks for it.
    real = backends.importlib.util.find_spec
    monkeypatch.setattr(
        backends.importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a)
    )
    with pytest.raises(
        TransportError,
        match=r"'nixl' is not available: nixl is not installed \(pip install "
        r"'replica\[nixl\]'\)",
    ):
        backends.check_backends(("nixl",))


def test_nixl_is_chosen_by_default_only_where_ucx_is_missing(monkeypatch):
    from replica.config import Config
    from replica.transport import Locality, MemoryKind

    config = Config(token=b"t")
    assert backends.choose_backend(config, MemoryKind.CUDA, Locality.REMOTE) == "ucx"
    real = backends.importlib.util.find_spec
    monkeypatch.setattr(
        backends.importlib.util, "find_spec", lambda name, *a: None if name == "ucxx" else real(name, *a)
    )
    assert backends.choose_backend(config, MemoryKind.CUDA, Locality.REMOTE) == "nixl"


def test_a_killed_peer_frees_nothing_it_did_not_own():
    """After a peer dies mid-transfer the survivor's agent forgets it, and a fresh peer
    gets a working connection from the same agent (no new agent, no restart)."""
    with make_nixl(b"job-token") as transport, spawn(peer_main, make_nixl, b"job-token") as peer:
        agent = transport.agent
        conn = connected(transport, peer)
        assert conn._peer_agent in agent._remotes
        peer.kill()
        from support.children import wait_for

        wait_for(
            lambda: not conn.alive and conn._peer_agent not in agent._remotes, "the dead peer forgotten", timeout_s=10
        )
        with spawn(peer_main, make_nixl, b"job-token") as fresh:
            fresh_conn = connected(transport, fresh)
            assert transport.agent is agent
            fresh.send("echo", [MiB], 40)
            back = empty(MiB, "cpu")
            receive = fresh_conn.irecv(back, tag=41)
            fresh_conn.send(pattern(MiB, 2), tag=40, timeout=T)
            receive.wait(T)
            assert torch.equal(back, pattern(MiB, 2)) and fresh.recv() == ("ok",)


# --- the failover demo over NIXL, and a bad plugin refused by `replica launch` ---


def test_a_trainer_killed_with_its_mirror_on_nixl(tmp_path, reference):
    """``--backends nixl,gloo``: every mirror goes over NIXL; trainer 1 dies in its backward,
    its standby takes over, and the losses equal the failure-free run's bit for bit."""
    from replica.roles.report import compare_reports
    from support.launch import STEPS, launch

    code, report, output = launch(
        tmp_path, "--backends", "nixl,gloo", "--inject", "kill:trainer:1@3:backward", env={"REPLICA_LOG": "INFO"}
    )
    assert code == 0, output[-4000:]
    assert all(f["fired_at"] is not None for f in report["faults"]), report["faults"]
    assert [f["rank"] for f in report["failovers"]] == [1], report["failovers"]
    assert "over nixl" in output and "over shm" not in output and "over gloo" not in output, output[-4000:]
    assert compare_reports(reference, report) == []
    assert report["last_commit"] == STEPS


def test_a_nixl_plugin_that_is_not_there_stops_the_launch_before_anything_starts():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replica.roles.cli",
            "launch",
            "--backends",
            "nixl",
            str(root / "examples" / "train_fsdp.py"),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, REPLICA_NIXL_BACKEND="NOSUCH"),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "NIXL has no backend 'NOSUCH'; this installation has" in proc.stdout, proc.stdout + proc.stderr
    assert "job store at" not in proc.stdout  # nothing started: the coordinator prints that first


def test_weights_pushed_over_nixl_arrive_exact_and_a_corrupted_bucket_is_resent():
    """The weight push on ``backends=("nixl",)``: buckets of 256 KiB (NIXL writes, registered
    once: the leader's packed version and the engine's receive buffer), a bad link caught
    by the digests and the bucket resent, every version exact."""
    import torch.distributed as dist

    import replica
    from replica.weights import WeightSync
    from support.weight_engine import EngineStandIn

    store = dist.HashStore()
    config = replica.Config(
        token=b"weights-token", bucket_bytes=256 << 10, timeout=timedelta(seconds=20), backends=("nixl",)
    )
    model = torch.nn.Sequential(torch.nn.Linear(256, 600), torch.nn.ReLU(), torch.nn.Linear(600, 256))
    engine = EngineStandIn(0, store, config=config, wait=timedelta(seconds=30))
    sync = WeightSync(model, store=store, num_engines=1, config=config)
    try:
        for step in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            sync.faults.corrupt_buckets = int(step == 2)
            stats = sync.push(step)
            assert stats.engines_synced == [0]
            assert engine.receiver.apply(engine.load) == step
            assert all(torch.equal(engine.weights[n], p.detach()) for n, p in model.named_parameters())
        assert sync.faults.corrupted == 1 and engine.receiver.stats.corrupted_buckets == 1  # the fault fired
        conn = sync._links[0].conn
        assert engine.receiver.backend == "nixl" and type(conn).__name__ == "NixlConnection"
    finally:
        sync.close()
        engine.receiver.close()


# --- between two network-namespace hosts ---


def _first_word(proc, word: str) -> list[str]:
    """The first line of ``proc``'s output that starts with ``word`` (NIXL logs lines of its own first)."""
    while line := proc.stdout.readline():
        if line.split()[:1] == [word]:
            return line.split()
    raise AssertionError(f"no {word!r} line; exit code {proc.wait()}")


@pytest.mark.netns
def test_a_peer_killed_on_another_host_is_found_at_once():
    """A NIXL connection between two network-namespace hosts: the listening process killed
    (SIGKILL), the other finds its connection dead through the control socket within
    moments, as over UCX (tests/test_hosts.py)."""
    import time
    from pathlib import Path

    from support import cluster as testcluster

    if not testcluster.available():
        pytest.skip("needs root and `ip netns`")
    peer = str(Path(__file__).resolve().parent / "jobs" / "ucx_peer.py")
    env = {"UCX_TLS": "tcp,self", "UCX_LOG_LEVEL": "fatal"}
    with testcluster.NetnsCluster(testcluster.ClusterConfig(hosts=2)) as cluster:
        a, b = cluster.hosts
        listener = python_on(b, peer, "listen", b.address, "0", "nixl", env=env)
        holder = None
        try:
            address = _first_word(listener, "address")[1]
            holder = python_on(a, peer, "hold", address, "0", "nixl", env=env)
            _first_word(holder, "connected")
            time.sleep(0.5)  # the listener's side is up too
            listener.kill()  # SIGKILL: ip netns exec, unshare and sh each exec the next
            killed = time.monotonic()
            _first_word(holder, "lost")
            found = time.monotonic() - killed
            assert found < 5 * 1.0, f"a killed peer on another host was found after {found:.2f} s"
            print(f"a killed NIXL peer on another host was found after {found * 1e3:.0f} ms")
        finally:
            reap(listener, holder)


# Run on host a (by Host.command): one contract check, its peers on host b.
_CHECK_ON_HOST = """
import os, sys
from support.nixl import OnTwoHosts
from support.transport_contract import CHECKS
name, here, there = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
check = {c.__name__: c for c in CHECKS}[name]
check(OnTwoHosts(os.getpid(), tuple(here), tuple(there)), device="cpu")
print("passed", flush=True)
"""


@pytest.fixture(scope="module")
def two_hosts():
    from support import cluster as testcluster

    if not testcluster.available():
        pytest.skip("needs root and `ip netns`")
    with testcluster.NetnsCluster(testcluster.ClusterConfig(hosts=2)) as cluster:
        yield cluster.hosts


@pytest.mark.netns
@pytest.mark.parametrize(
    "check",
    [  # `make test` runs the round trip; `make test-slow` every check
        pytest.param(
            c, id=c.__name__.removeprefix("check_"), marks=() if c is check_round_trip_sizes else pytest.mark.slow
        )
        for c in CHECKS
    ],
)
def test_contract_nixl_between_two_hosts(check, two_hosts):
    """The whole contract with its two ends on two network-namespace hosts, NIXL's UCX
    plugin on tcp (these hosts share one machine, where UCX would otherwise move bytes
    through the kernel or shared memory): each check passes, its bytes over the link."""
    a, b = two_hosts
    before = sum(a.link_bytes())
    proc = python_on(
        a,
        "-c",
        _CHECK_ON_HOST,
        check.__name__,
        f"{a.netns},{a.address}",
        f"{b.netns},{b.address}",
        env={"UCX_TLS": "tcp,self"},
    )
    try:
        out = proc.communicate(timeout=600)[0]
    finally:
        reap(proc)
    assert proc.returncode == 0 and "passed" in out.split(), out[-4000:]
    crossed = sum(a.link_bytes()) - before
    # Every check with a peer connects over the link (the missing token's raw socket is the
    # check's own, on host a); the round trip's data crosses it both ways.
    least = {check_round_trip_sizes: 2 * (64 * MiB), check_missing_token_refused: 0}.get(check, 1)
    assert crossed >= least, f"{crossed} bytes crossed host {a}'s link"


def _idle_cpu(pipe) -> None:
    """In a process of its own (nothing else running in it): the share of a core it uses
    over 2 s while holding two connected NIXL transports and doing nothing."""
    import resource
    import time

    def cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    with make_nixl(b"job-token") as server, make_nixl(b"job-token") as client:
        pair(server, client)
        before, start = cpu_s(), time.monotonic()
        time.sleep(2.0)
        pipe.send((cpu_s() - before) / (time.monotonic() - start))


def test_an_idle_agent_sleeps_instead_of_spinning():
    """NIXL's Python API starts its progress thread polling without pause (a core per
    process, 0.99 s of CPU per idle second measured); replica's agent sleeps until work or
    its wake-up: an idle process with connected NIXL transports uses under a tenth of a core."""
    with spawn(_idle_cpu) as child:
        busy = child.recv(timeout=120)
    assert busy < 0.1, f"an idle NIXL agent kept {busy:.0%} of a core busy"


def _agent_beside_ucxx(pipe) -> None:
    import logging

    from replica.transport.ucx import UcxConfig, UcxTransport

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("replica.transport.nixl_agent").addHandler(handler)
    with UcxTransport(UcxConfig(token=b"t")), make_nixl(b"t"):
        pass
    pipe.send([r.getMessage() for r in records])


def test_nixl_beside_ucxx_in_one_process_is_warned_about():
    """ucxx's UCX loaded first takes NIXL's UCX plugin off its shared-memory paths (0.75
    against 4.7 GB/s here): the agent says so, naming the way out."""
    with spawn(_agent_beside_ucxx) as child:
        messages = child.recv(timeout=120)
    assert any("NIXL shares this process with another UCX" in m for m in messages), messages
