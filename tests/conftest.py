"""Fixtures shared by test modules."""

import pytest

from test_launch import STEPS, launch


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The report of examples/train_fsdp.py run by `replica launch` without faults: every
    faulty run of that job must match its losses bit for bit. Made once per session."""
    code, report, output = launch(tmp_path_factory.mktemp("reference"), name="reference")
    assert code == 0, output[-4000:]
    assert report["failovers"] == [] and report["last_commit"] == STEPS
    return report
