"""Kill -> the rank protected again (issue 56): a spare standby (``--spares 1``) against a new
standby process (``--train-while-replacing``: the same no-pause, a process started for the rank).
The demo job; trainer 1 killed in the backward of step 3; from step 4 on, trainer 0 takes
PACE_S more a step (so that the job is still running when the new standby comes: it starts
receiving at the first commit after it is up; one long stall measured the stall, 8.5 s for both).
The figure: seconds from the kill to the coordinator marking rank 1 protected again (its new
standby holds the newest commit: the state's transfer is in both), within a step's pace. Medians
of ROUNDS, the two in turn. ``make bench`` only
(tests/test_spares.py covers the path). Writes bench/results/spares.{json,md}."""

from __future__ import annotations

import statistics

import pytest
from bench_results import machine, write_results

from support.launch import launch

ROUNDS = 3
STEPS = 60
PACE_S = 0.25
INJECT = ",".join(["kill:trainer:1@3:backward", *(f"stall:trainer:0@{s}:{PACE_S}" for s in range(4, STEPS))])
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
            code, report, output = launch(folder, *options, "--inject", INJECT, steps=STEPS)
            assert code == 0, output[-4000:]
            runs[name].append(_protected_after_s(report))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    lines = [
        f"### Kill -> rank protected again, demo job, steps paced at +{PACE_S:g} s (medians of {ROUNDS} runs "
        "each, in turn)\n",
        "| new standby | seconds | runs |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {medians[name]:.2f} | {', '.join(f'{v:.2f}' for v in runs[name])} |" for name in SYSTEMS]
    lines.append(f"\nspare / new process: {medians['spare'] / medians['new process']:.2f}")
    print("\n".join(lines))
    write_results("spares", {"runs": runs, "medians_s": medians, "inject": INJECT, "machine": machine()}, lines)
