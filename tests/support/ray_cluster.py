"""The Ray cluster fixture (``ray_cluster``) of the tests and benchmarks that run on Ray
(``ray.cluster_utils.Cluster``: a head and simulated nodes, each its own raylet, on this
machine). A pytest plugin (the top-level conftest.py names it): a test asks for
``ray_cluster`` and gets it, started on first use; without ray installed, no test asks."""

from __future__ import annotations

import os

import pytest

__all__ = ["WORKERS", "ray_cluster"]

WORKERS = 5  # 2 trainer machines, 2 rollout machines (the standbys), 1 spare


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
    for index in range(WORKERS):  # each node its own rack; all in one zone
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
