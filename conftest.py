import os
import shutil

import pytest
import torch

from replica import envvars

# The tests' jobs run every role on this one machine (network-namespace hosts and simulated
# Ray nodes share it too): a standby in its trainer's failure domain is allowed, as one-machine
# demos allow it. tests/test_domains.py checks the refusal without it.
os.environ[envvars.ALLOW_SHARED_DOMAIN] = "1"


def _smoke_case(item) -> bool:
    """Under ``--benchmark-disable`` (``make test``) a benchmark runs as a smoke test of its
    code, once per case its module names in ``SMOKE_PARAMS`` (parameter -> values kept):
    each other case starts its own peers for seconds and covers the same code."""
    keep = getattr(item.module, "SMOKE_PARAMS", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    return keep is None or all(params[name] in values for name, values in keep.items() if name in params)


def pytest_collection_modifyitems(config, items):
    if config.getoption("benchmark_disable", False):
        dropped = [item for item in items if not _smoke_case(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if _smoke_case(item)]
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_netns = pytest.mark.skip(reason="needs root and `ip netns`")
    has_netns = os.geteuid() == 0 and shutil.which("ip") is not None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "netns" in item.keywords and not has_netns:
            item.add_marker(skip_netns)


# The Ray cluster of the tests and benchmarks that run on Ray (tests/test_ray.py,
# bench/test_failover_ray.py): a fixture of this conftest, which covers tests/ and bench/ alike
# (tests/conftest.py's fixtures are the tests' alone). It imports nothing of tests/support: a
# pytest run from elsewhere loads this file too (the selftest's plugin, tests/test_selftest.py),
# without tests/ on its path.
RAY_WORKERS = 5  # 2 trainer machines, 2 rollout machines (the standbys), 1 spare


@pytest.fixture(scope="module")
def ray_cluster():
    """A head that runs nothing of the job (0 CPUs: the driver's machine) and five 2-CPU
    nodes, labelled with their rack (one each) and zone (one for all); health checks tuned
    so a node killed without notice is declared dead in ~5 s (10 missed checks 500 ms apart;
    with fewer, a raylet starved of CPU on a loaded machine was declared dead). One per module that uses it:
    under pytest-xdist (make test), each worker that runs a test of that module starts one.
    Ray turns a loopback address into the machine's external one (ray.init, and every
    node's get_node_ip_address), which this machine cannot reach: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    keeps every node of this one-machine cluster on loopback (inherited by the nodes and
    the commands the tests start)."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    saved = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process read the variable when it imported ray
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "node_ip_address": "127.0.0.1",
            "_system_config": {
                "health_check_period_ms": 500,
                "health_check_timeout_ms": 500,
                "health_check_failure_threshold": 10,
                "prestart_worker_first_driver": False,
            },
        },
    )
    for index in range(RAY_WORKERS):  # each node its own rack; all in one zone
        c.add_node(num_cpus=2, node_ip_address="127.0.0.1", labels={"rack": f"r{index}", "zone": "z1"})
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()
    ray_constants.ENABLE_RAY_CLUSTER = True
    if saved is None:
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    else:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved
