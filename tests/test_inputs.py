"""The divergence guard's record of each forward's inputs (replica.state.inputs), on a real module."""

from __future__ import annotations

import torch

from replica.state.inputs import InputDigests


def _model_and_guard() -> tuple[torch.nn.Module, InputDigests]:
    model, guard = torch.nn.Linear(4, 2), InputDigests()
    guard.attach(model)
    return model, guard


def test_a_redo_fed_the_same_inputs_agrees_and_one_fed_others_is_found():
    model, guard = _model_and_guard()
    batch = torch.arange(8.0).reshape(2, 4)
    guard.begin(1)
    model(batch)
    model(batch + 1)
    guard.begin(1)  # the redo
    model(batch)
    model(batch + 1)
    assert guard.settle(1) is None
    guard.begin(2)
    model(batch)
    model(batch)
    guard.begin(2)
    model(batch)
    model(batch + 2)  # its second forward takes another micro-batch
    found = guard.settle(2)
    assert found is not None and (found.step, found.forward, found.what) == (2, 1, "its input tensors")
    assert found.before != found.after


def test_forwards_after_an_attempt_failed_are_not_taken_for_its_inputs():
    """A survivor's first attempt whose rollout request was aborted (a trainer died) runs its
    forward on placeholder completions: ``void`` drops them, the forwards before stay checked."""
    model, guard = _model_and_guard()
    real, placeholder = torch.ones(2, 4), torch.zeros(2, 4)
    guard.begin(4)
    model(real)
    guard.void()  # the step failed here
    model(placeholder)
    guard.begin(4)  # the redo, with the real rollouts
    model(real)
    model(real)
    assert guard.settle(4) is None
    guard.begin(5)
    model(real)
    guard.void()
    model(placeholder)
    guard.begin(5)
    model(placeholder)  # the first forward, recorded before the failure, still counts
    assert guard.settle(5) is not None


def test_the_rng_state_at_a_forwards_start_counts():
    model, guard = _model_and_guard()
    batch = torch.ones(1, 4)
    torch.manual_seed(0)
    guard.begin(1)
    model(batch)
    torch.manual_seed(1)
    guard.begin(1)
    model(batch)
    found = guard.settle(1)
    assert found is not None and found.what == "the RNG state at its start"
