import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch

# Seconds each test file took (setup, call and teardown of its tests, summed), from a recent
# run (`make durations`). Files run longest first, each file's tests together and in their
# order: with workers, the last tests to start are short ones, and no worker waits for
# another's long test at the end (a 79 s test started last held the run that long).
DURATIONS = Path(__file__).parent / "tests" / "durations.json"


def pytest_addoption(parser):
    parser.addoption("--record-durations", default=None, metavar="PATH",
                     help="write how long each test file took to PATH (JSON), for the run order")


def _longest_files_first(items) -> None:
    try:
        took = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    # a file not timed yet goes first: it may be long
    order = sorted(files, key=lambda name: -took.get(name, float("inf")))
    items[:] = [item for name in order for item in files[name]]


class _Durations:
    def __init__(self, path: str):
        self.path = Path(path)
        self.took: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.took[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self):
        self.path.write_text(json.dumps({name: round(s, 1) for name, s in sorted(self.took.items())}, indent=0) + "\n")


def pytest_configure(config):
    path = config.getoption("--record-durations")
    if path and not hasattr(config, "workerinput"):  # the controller sees every worker's reports
        config.pluginmanager.register(_Durations(path), "replica-durations")


def _smoke_case(item) -> bool:
    """Under ``--benchmark-disable`` (``make test``) a benchmark runs as a smoke test of its
    code, once per case its module names in ``SMOKE_PARAMS`` (parameter -> values kept):
    each other case starts its own peers for seconds and covers the same code."""
    keep = getattr(item.module, "SMOKE_PARAMS", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    return keep is None or all(params[name] in values for name, values in keep.items() if name in params)


def pytest_collection_modifyitems(config, items):
    _longest_files_first(items)
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
