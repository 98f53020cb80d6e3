"""examples/train_hf.py on one GPU (`--device cuda`, the deterministic settings): a Hugging
Face Qwen2 under FSDP2 with mixed precision, activation checkpointing and attention dropout
on the CUDA RNG, its trainer killed in the optimizer step, its standby promoted: the losses
equal the failure-free run's bit for bit, with torchdata's StatefulDataLoader and with a
plain DataLoader of two workers, and with each decoder layer compiled (its standby warmed up,
so that its promotion compiles nothing), and the divergence guard stays silent (it compares on a
GPU only under deterministic algorithms, which the script turns on).

The GPU machines have no package registry: carry the wheels of transformers (and what it
needs) and torchdata (docs/operations.md, "On a GPU"); without them this module skips, saying so."""

from __future__ import annotations

import pytest

from replica.roles.report import compare_reports
from support.launch import ROOT, launch

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers", reason="examples/train_hf.py builds a Hugging Face model")

HF = ROOT / "examples" / "train_hf.py"
STEPS = 8
ARGS = ("--trainers", "1", "--heartbeat-deadline", "10")
LOADERS = {
    "stateful": ("--loader", "stateful"),
    "plain-workers": ("--loader", "plain", "--workers", "2"),
    # each decoder layer compiled; the standby compiles in its warm-up, not in the failover
    "stateful-compiled": ("--loader", "stateful", "--compile", "layers"),
}


@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_real_job_on_the_gpu_killed_once_is_bit_identical(tmp_path, loader):
    if loader.startswith("stateful"):
        pytest.importorskip("torchdata", reason="the StatefulDataLoader is torchdata's")
    script_args = ("--device", "cuda", *LOADERS[loader])
    code, reference, output = launch(tmp_path, *ARGS, name="reference", script=HF, steps=STEPS, script_args=script_args)
    assert code == 0, output[-6000:]
    code, report, output = launch(
        tmp_path,
        *ARGS,
        "--inject",
        "kill:trainer:0@5:optimizer",
        name="run",
        script=HF,
        steps=STEPS,
        script_args=script_args,
    )
    assert code == 0, output[-6000:]
    assert report["faults"][0]["fired_at"] is not None and len(report["failovers"]) == 1
    assert report["divergences"] == [], report["divergences"]
    assert compare_reports(reference, report) == []
    assert "first step compiled" not in output, "the promoted standby compiled in the failover"
    print(f"{loader}: resumed {report['failovers'][0]['timeline_ms']['resumed']:.0f} ms after the kill")
