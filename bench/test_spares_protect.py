"""Kill -> the rank protected again (issue 56): a spare standby (``--spares 1``) against a new
standby process (``--train-while-replacing``: the same no-pause, a process started for the rank).
The demo job; trainer 1 killed in the backward of step 3; trainer 0 stalls 8 s in steps 6 and 7
so that the new standby has room to come before the job ends. The figure: seconds from the kill
to the coordinator marking rank 1 protected again (its new standby holds the newest commit: the
state's transfer is in both). Medians of ROUNDS, the two in turn. ``make bench`` only
(tests/test_spares.py covers the path). Writes bench/results/spares.{json,md}."""

from __future__ import annotations

import statistics

import pytest

from bench_results import machine, write_results
from test_launch import launch

ROUNDS = 3
INJECT = "kill:trainer:1@3:backward,stall:trainer:0@6:8,stall:trainer:0@7:8"
SYSTEMS = {"spare": ("--spares", "1"), "new process": ("--train-while-replacing",)}


def _protected_after_s(report: dict) -> float:
    killed = next(f["fired_at"] for f in report["faults"] if f["fault"].startswith("kill:trainer:1@3"))
    (span,) = [s for s in report["unprotected_spans"] if s["rank"] == 1]
    assert span["until_at"] is not None, report["unprotected_spans"]
    return span["until_at"] - killed


def test_kill_to_protected_again(benchmark, tmp_path):
    if benchmark.disabled:
        pytest.skip("runs under `make bench` only (tests/test_spares.py covers the path)")
    runs: dict[str, list[float]] = {name: [] for name in SYSTEMS}

    def one_round() -> None:
        for name, options in SYSTEMS.items():
            folder = tmp_path / f"{name.replace(' ', '-')}{len(runs[name])}"
            folder.mkdir()
            code, report, output = launch(folder, *options, "--inject", INJECT)
            assert code == 0, output[-4000:]
            runs[name].append(_protected_after_s(report))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    lines = [f"### Kill -> rank protected again, demo job (medians of {ROUNDS} runs each, in turn)\n",
             "| new standby | seconds | runs |", "|---|---|---|"]
    lines += [f"| {name} | {medians[name]:.2f} | {', '.join(f'{v:.2f}' for v in runs[name])} |" for name in SYSTEMS]
    lines.append(f"\nspare / new process: {medians['spare'] / medians['new process']:.2f}")
    print("\n".join(lines))
    write_results("spares", {"runs": runs, "medians_s": medians, "inject": INJECT, "machine": machine()}, lines)
