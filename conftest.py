import json
import os
import shutil
from pathlib import Path

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


# The longest tests first: under xdist a test of a minute that starts last is the run's tail.
# Seconds per test id, from a run of `make durations` (tests under DURATIONS_FLOOR_S left out;
# an unlisted test counts as quick and keeps its place).
DURATIONS = Path(__file__).parent / "tests" / "durations.json"
DURATIONS_FLOOR_S = 5.0


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write the seconds each test took (those over %.0f s) to PATH as JSON; "
                          "`make durations` refreshes tests/durations.json with it" % DURATIONS_FLOOR_S)


def _known_durations() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return {}


def _longest_first(items, known: dict[str, float]) -> None:
    """Modules by their longest test, longest first, each kept whole (a module fixture, a Ray
    cluster, is built once per worker, not once per test moved), its tests longest first;
    modules and tests with no duration known keep their order."""
    def module(item) -> str:
        return item.nodeid.split("::", 1)[0]

    longest: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        m = module(item)
        longest[m] = max(longest.get(m, 0.0), known.get(item.nodeid, 0.0))
        first.setdefault(m, i)
    items.sort(key=lambda item: (-longest[module(item)], first[module(item)], -known.get(item.nodeid, 0.0)))


def pytest_collection_modifyitems(config, items):
    _longest_first(items, _known_durations())
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


_took: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration  # setup, call and teardown


def pytest_sessionfinish(session):
    path = session.config.getoption("record_durations", None)
    if path and not hasattr(session.config, "workerinput"):  # the controller alone writes it
        kept = {k: round(v, 1) for k, v in sorted(_took.items(), key=lambda kv: -kv[1]) if v >= DURATIONS_FLOOR_S}
        Path(path).write_text(json.dumps(kept, indent=1) + "\n")
