"""Fixtures shared by test modules."""

import os
import subprocess

import pytest

from replica._testing import etcd as testetcd
from replica._testing.etcd import EtcdCluster
from test_launch import RL, RL_STEPS, STEPS, launch


@pytest.fixture
def server():
    """A TCPStore server on a free loopback port (the job store's kind on one machine)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The report of examples/train_fsdp.py run by `replica launch` without faults: every
    faulty run of that job must match its losses bit for bit. Made once per session."""
    code, report, output = launch(tmp_path_factory.mktemp("reference"), name="reference")
    assert code == 0, output[-4000:]
    assert report["failovers"] == [] and report["last_commit"] == STEPS
    return report


@pytest.fixture(scope="session")
def rl_reference(tmp_path_factory):
    """The RL loop (examples/rl_loop.py) without faults, for the runs with faults to match
    (losses and rewards). Which engines serve which shards, and how many there are, does not
    change a single completion: it runs on one engine and no standbys (cheaper)."""
    code, report, output = launch(tmp_path_factory.mktemp("rl-reference"), "--rollouts", "1", "--standbys", "0",
                                  "--steps", str(RL_STEPS), name="reference", script=RL)
    assert code == 0, output[-4000:]
    assert report["last_commit"] == RL_STEPS and report["failovers"] == []
    assert all(m.get("reward") for m in report["metrics_hex"]["0"])  # every step scored its rollouts
    return report


@pytest.fixture(scope="session")
def etcd():
    """A real 3-member etcd cluster on loopback, authentication on, shared by the session
    (each test takes a namespace of its own where it needs an empty store)."""
    if not testetcd.available():
        pytest.skip("etcd is not installed (make test installs etcd-server)")
    with EtcdCluster(addresses=["127.0.0.1"] * 3, base_port=24200) as cluster:
        yield cluster


@pytest.fixture
def pid_namespace():
    """``pid_namespace(mount_proc)``: the command prefix that runs a program in a PID
    namespace of its own (as in another container); skips the test where this machine
    cannot make one. Without ``mount_proc`` the program still sees this namespace's
    /proc, so it can map this side's shared memory while this side cannot map its own:
    a refusal then shows on one side only."""
    def command(mount_proc: bool) -> list[str]:
        if os.geteuid() != 0:
            pytest.skip("a PID namespace of its own needs root (unshare)")
        prefix = ["unshare", "--pid", "--fork", *(["--mount-proc"] if mount_proc else [])]
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
        if probe.returncode != 0:  # a container without CAP_SYS_ADMIN
            pytest.skip(f"this machine cannot make a PID namespace: {probe.stderr.strip()}")
        return prefix
    return command
