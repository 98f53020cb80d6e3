"""Fixtures shared by test modules."""

import json
import os
import subprocess
import sys

import pytest
from filelock import FileLock

from support import etcd as testetcd
from support.etcd import EtcdCluster
from support.launch import RL, RL_STEPS, ROOT, STEPS, launch


@pytest.fixture
def server():
    """A TCPStore server on a free loopback port (the job store's kind on one machine)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _once_per_run(tmp_path_factory, name: str, make) -> dict:
    """``make(folder)``'s JSON-able result, made once per test run: under pytest-xdist the
    first worker to ask makes it while the others wait on a file lock, then read it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent  # the same folder for every worker of the run
    with FileLock(str(shared / f"{name}.lock")):
        made = shared / f"{name}.json"
        if not made.exists():
            made.write_text(json.dumps(make(shared / name)))
        return json.loads(made.read_text())


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The report of examples/train_fsdp.py run by `replica launch` without faults: every
    faulty run of that job must match its losses bit for bit. Made once per run."""

    def make(folder):
        folder.mkdir(exist_ok=True)
        code, report, output = launch(folder, name="reference")
        assert code == 0, output[-4000:]
        assert report["failovers"] == [] and report["last_commit"] == STEPS
        return report

    return _once_per_run(tmp_path_factory, "reference", make)


@pytest.fixture(scope="session")
def rl_reference(tmp_path_factory):
    """The RL loop (examples/rl_loop.py) without faults, for the runs with faults to match
    (losses and rewards). Which engines serve which shards, and how many there are, does not
    change a single completion: it runs on one engine and no standbys (cheaper)."""

    def make(folder):
        folder.mkdir(exist_ok=True)
        code, report, output = launch(
            folder, "--rollouts", "1", "--standbys", "0", "--steps", str(RL_STEPS), name="reference", script=RL
        )
        assert code == 0, output[-4000:]
        assert report["last_commit"] == RL_STEPS and report["failovers"] == []
        assert all(m.get("reward") for m in report["metrics_hex"]["0"])  # every step scored its rollouts
        return report

    return _once_per_run(tmp_path_factory, "rl-reference", make)


@pytest.fixture(scope="session")
def fresh_seed1(tmp_path_factory):
    """What a fresh vLLM engine started from the seed-1 weights (``support.vllm_engine.make_model``)
    generates: its greedy tokens and first-token log-probabilities for the test prompts
    (tests/jobs/fresh_engine.py, in a process of its own). Every sync to those weights must
    equal it. Made once per run (an engine's start is 16 s of CPU)."""

    def make(folder):
        from support.vllm_engine import make_model

        make_model(folder / "seed1", 1)
        done = subprocess.run(
            [
                sys.executable,
                str(ROOT / "tests" / "jobs" / "fresh_engine.py"),
                str(folder / "seed1"),
                str(folder / "fresh.json"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((folder / "fresh.json").read_text())

    return _once_per_run(tmp_path_factory, "fresh-seed1", make)


# Under pytest-xdist the controller runs one etcd cluster for every worker (a 3-member cluster per
# worker idled at 9 etcd processes for the whole run); each worker takes a namespace of its own.
_SHARED_ETCD = "TESTS_SHARED_ETCD"


def pytest_configure(config):
    if (
        getattr(config.option, "numprocesses", None)
        and not hasattr(config, "workerinput")
        and testetcd.available()
        and _SHARED_ETCD not in os.environ
    ):
        config._shared_etcd = EtcdCluster(addresses=["127.0.0.1"] * 3).__enter__()
        os.environ[_SHARED_ETCD] = config._shared_etcd.describe()  # the workers start after this


def pytest_unconfigure(config):
    cluster = getattr(config, "_shared_etcd", None)
    if cluster is not None:
        os.environ.pop(_SHARED_ETCD, None)
        cluster.close()


@pytest.fixture(scope="session")
def etcd(worker_id):
    """A real 3-member etcd cluster on loopback, authentication on, shared by the session
    (each test takes a namespace of its own where it needs an empty store), and by every
    xdist worker (each in a namespace of its own). Never stop its members: ``etcd_own``."""
    if not testetcd.available():
        pytest.skip("etcd is not installed (make test installs etcd-server)")
    if _SHARED_ETCD in os.environ:
        yield EtcdCluster.attach(os.environ[_SHARED_ETCD], namespace=f"replica-job/{worker_id}/")
        return
    with EtcdCluster(addresses=["127.0.0.1"] * 3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def etcd_own():
    """A 3-member cluster of the module's own, for the tests that stop and restart members."""
    if not testetcd.available():
        pytest.skip("etcd is not installed (make test installs etcd-server)")
    with EtcdCluster(addresses=["127.0.0.1"] * 3) as cluster:
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
