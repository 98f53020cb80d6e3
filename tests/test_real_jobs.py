"""A training script written the way people write them (examples/train_hf.py: a Hugging
Face Qwen2 under FSDP2 with mixed precision, activation checkpointing, attention dropout,
gradient accumulation, clipping, a warm-up schedule and a real data loader) survives the
loss of a trainer bit for bit: with torchdata's ``StatefulDataLoader`` and with a plain
``DataLoader`` whose two workers mask samples at random. A random draw planted outside the
mirrored state is caught by the divergence guard (the fault fired, the divergence is in
the report, ``--strict`` ends the job), and no bit-identical run makes the guard speak.

`make test` kills in one phase per loader; `make test-slow` runs the whole matrix."""

from __future__ import annotations

from pathlib import Path

import pytest

from replica.roles.report import compare_reports
from support.launch import ROOT, launch

HF = ROOT / "examples" / "train_hf.py"
STEPS = 8

pytest.importorskip("transformers", reason="examples/train_hf.py builds a Hugging Face model")
LOADERS = {"stateful": ("--loader", "stateful"), "plain-workers": ("--loader", "plain", "--workers", "2")}


def run(
    tmp_path: Path, loader: str, *options: str, name: str = "run", script_args: tuple[str, ...] = ()
) -> tuple[int, dict, str]:
    if loader == "stateful":
        pytest.importorskip("torchdata", reason="the StatefulDataLoader is torchdata's (replica[data])")
    return launch(tmp_path, *options, name=name, script=HF, steps=STEPS, script_args=LOADERS[loader] + script_args)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The failure-free run of each loader (made once, when a test asks for it)."""
    made = {}

    def reference(loader: str) -> dict:
        if loader not in made:
            code, report, output = run(tmp_path_factory.mktemp(f"hf-{loader}"), loader, name="reference")
            assert code == 0, output[-4000:]
            assert report["last_commit"] == STEPS and report["failovers"] == [] and report["divergences"] == []
            made[loader] = report
        return made[loader]

    return reference


def assert_bit_identical(reference: dict, code: int, report: dict, output: str, kills: int = 1) -> None:
    assert code == 0, output[-4000:]
    assert all(f["fired_at"] is not None for f in report["faults"]), report["faults"]  # every fault fired
    assert len(report["failovers"]) == kills
    assert report["divergences"] == [], report["divergences"]  # the guard stays silent
    assert compare_reports(reference, report) == []
    assert report["last_commit"] == STEPS


@pytest.mark.parametrize("loader,phase", [("stateful", "optimizer"), ("plain-workers", "backward")])
def test_a_real_job_killed_once_is_bit_identical(tmp_path, references, loader, phase):
    assert_bit_identical(references(loader), *run(tmp_path, loader, "--inject", f"kill:trainer:1@5:{phase}"))


@pytest.mark.slow
@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("phase", ["forward", "backward", "reduce-scatter", "optimizer", "commit", "mirror"])
def test_a_real_job_killed_in_every_phase_is_bit_identical(tmp_path, references, loader, phase):
    assert_bit_identical(references(loader), *run(tmp_path, loader, "--inject", f"kill:trainer:1@4:{phase}"))


@pytest.mark.slow
@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_real_job_killed_twice_in_a_row_is_bit_identical(tmp_path, references, loader):
    """Trainer 1 dies at step 3, then trainer 0 (a survivor of the first failover) at step 6."""
    assert_bit_identical(
        references(loader),
        *run(tmp_path, loader, "--inject", "kill:trainer:1@3:backward,kill:trainer:0@6:optimizer"),
        kills=2,
    )


@pytest.fixture(scope="module")
def compiled_references(tmp_path_factory, references):
    """The failure-free run of each ``--compile`` mode (made once, when a test asks for it)."""
    made = {}

    def reference(mode: str) -> dict:
        if mode not in made:
            code, report, output = run(
                tmp_path_factory.mktemp(f"hf-compile-{mode}"),
                "stateful",
                name="reference",
                script_args=("--compile", mode),
            )
            assert code == 0, output[-4000:]
            assert compare_reports(references("stateful"), report) != [], (
                "the compiled run equals the eager one: did torch.compile take effect?"
            )
            made[mode] = report
        return made[mode]

    return reference


COMPILED_IN_FAILOVER = "first step compiled"  # the promoted standby's line when it compiles in its failover


@pytest.mark.slow
@pytest.mark.parametrize("mode,phase", [("layers", "optimizer"), ("model", "backward")])
def test_a_compiled_real_job_killed_once_is_bit_identical(tmp_path, compiled_references, mode, phase):
    """``torch.compile`` per decoder layer (before sharding) or of the whole sharded model (an
    ``OptimizedModule``, its names prefixed). The standby compiled in its warm-up
    (``job.warm_up``), so its first step after the promotion compiles nothing, and the redo
    equals the compiled failure-free run bit for bit."""
    code, report, output = run(
        tmp_path, "stateful", "--inject", f"kill:trainer:1@5:{phase}", script_args=("--compile", mode)
    )
    assert_bit_identical(compiled_references(mode), code, report, output)
    assert COMPILED_IN_FAILOVER not in output, "the warm-up did not cover the promoted standby's first step"


@pytest.mark.slow
def test_a_standby_without_a_warm_up_says_it_compiled_in_the_failover(tmp_path, compiled_references):
    code, report, output = run(
        tmp_path,
        "stateful",
        "--inject",
        "kill:trainer:1@5:backward",
        script_args=("--compile", "model", "--no-warm-up"),
    )
    assert_bit_identical(compiled_references("model"), code, report, output)
    assert COMPILED_IN_FAILOVER in output and "job.warm_up(step)" in output, output[-4000:]


def test_a_random_draw_outside_the_mirrored_state_is_caught(tmp_path):
    """--unmirrored-noise draws from a generator the loop keeps outside ``extra``: after the
    failover, the survivor's redo of the step in flight differs from its first attempt. The
    guard says so (its loss and its state), the report records it, --strict ends the job."""
    code, report, output = launch(
        tmp_path,
        "--strict",
        "--inject",
        "kill:trainer:1@5:optimizer",
        script=HF,
        steps=STEPS,
        script_args=("--loader", "plain", "--unmirrored-noise"),
    )
    assert report["faults"][0]["fired_at"] is not None, "the kill did not fire"
    assert code != 0, "--strict let a diverged job finish with exit code 0"
    found = {(d["rank"], d["step"], d["measure"]) for d in report["divergences"]}
    assert (0, 5, "loss") in found, report["divergences"]
    assert all(d["comparable"] for d in report["divergences"])
    assert "DIVERGED" in output and "Likely causes" in output
    assert "DIVERGED" in (report["failure"] or "")


@pytest.mark.parametrize(
    "inject,steps", [("kill:trainer:0@8:backward,kill:trainer:1@10:backward", 12), ("kill:trainer:1@5:forward", STEPS)]
)
def test_a_loop_with_its_own_iterator_is_caught_when_killed_before_its_loss(tmp_path, inject, steps):
    """The loop iterates its DataLoader itself (--own-iterator), dropout on, and is killed in
    the forward or the backward: the step it died in logged no loss and packed no state, so
    only its inputs tell. The survivor's redo takes the next batches of its own iterator, not
    the ones its first attempt took: the guard reports the inputs' divergence (measure
    "input"), where it used to stay silent while the losses left the failure-free run."""
    code, report, output = launch(
        tmp_path, "--inject", inject, script=HF, steps=steps, script_args=("--loader", "plain", "--own-iterator")
    )
    assert code == 0, output[-4000:]
    assert all(f["fired_at"] is not None for f in report["faults"]), report["faults"]
    inputs = [d for d in report["divergences"] if d["measure"] == "input"]
    killed = int(inject.split("@")[1].split(":")[0])
    # The redo starts after the last global commit: the step killed in, or the one before it
    # when that one's commit had not completed yet (a loaded machine). Its inputs tell first.
    redone = min(f["commit"] for f in report["failovers"]) + 1
    assert redone in (killed - 1, killed), report["failovers"]
    assert inputs and min(d["step"] for d in inputs) == redone, (report["divergences"], report["failovers"])
    assert all(d["comparable"] and "its input tensors" in d["where"] for d in inputs), inputs
    assert "DIVERGED after the failover: its input tensors of forward 0" in output, output[-4000:]
