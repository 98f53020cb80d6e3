"""The control-plane simulator (bench/control_scale.py) runs and its commit is right at
small N: every step's commit equals the step once every simulated rank acknowledged it
(the simulator asserts it), the per-step store requests stay O(N), and the report is
written. The large runs are `make bench-scale`."""

from __future__ import annotations

import json

import control_scale


def test_the_simulator_at_small_n(tmp_path, monkeypatch):
    monkeypatch.setattr(control_scale, "HEARTBEAT_SECONDS", 0.3)
    assert control_scale.main(["--n", "16", "--stores", "tcp", "--steps", "4", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "control_scale.json").read_text())
    runs = {r["n"]: r for r in result["runs"]}
    assert set(runs) == {16}  # (tests/test_commit_scale.py checks the growth with N)
    for n, run in runs.items():
        assert run["requests_per_step"] <= 8 * n, run  # O(N): ~6 a rank (a trainer's 3 reads, a standby's 3)
        assert run["largest_read_keys"] == n  # the one full read of the step
        assert run["heartbeat_writes_per_s"] > 0 and run["scans_per_s"] > 0
    assert (tmp_path / "control_scale.md").read_text().count("| tcp |") == 1
