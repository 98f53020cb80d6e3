import os
import shutil

import pytest
import torch

from replica import envvars

# Fixtures shared by tests/ and bench/ (tests/conftest.py's are the tests' alone): the Ray cluster.
# tests/ is on the path already (pyproject.toml's pythonpath).
pytest_plugins = ["support.ray_cluster"]

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
