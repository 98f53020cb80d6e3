import os
import shutil

import pytest
import torch


def _smoke_case(item) -> bool:
    """Under ``--benchmark-disable`` (``make test``) a benchmark runs as a smoke test of its
    code, once per case its module names in ``SMOKE_PARAMS`` (parameter -> values kept):
    each other case starts its own peers for seconds and covers the same code."""
    keep = getattr(item.module, "SMOKE_PARAMS", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    return keep is None or all(params[name] in values for name, values in keep.items() if name in params)


def _module_group(item) -> str | None:
    """Under pytest-xdist (``make test WORKERS=N``, ``--dist loadgroup``) a module's tests that
    share a module-scoped fixture (a netns cluster, a vLLM engine, reference runs) go to one
    worker, so the fixture is built once, not once per worker: the module's ``xdist_group``."""
    if item.get_closest_marker("xdist_group") is not None:
        return None
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        if any(d.scope == "module" for d in defs):
            return item.module.__name__
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
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
        if (group := _module_group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "netns" in item.keywords and not has_netns:
            item.add_marker(skip_netns)
