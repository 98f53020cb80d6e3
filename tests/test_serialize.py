"""The pickle-free state encoding and RNGState."""

import math
import random

import numpy as np
import pytest
import torch

from replica.state import serialize
from replica.state.rng import RNGState


def test_round_trip_is_exact():
    state = {
        "lr": 0.1 + 0.2,
        "specials": [math.inf, -math.inf, -0.0, 5e-324],
        "big": 2**200 + 1,
        "neg": -(2**70),
        "flags": (True, False, None),
        "name": "warmup — cosine",
        "blob": b"\x00\xff",
        1: "int key",
        "tensors": [
            torch.arange(6).to(dt).reshape(2, 3) for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool)
        ],
        "array": np.arange(5, dtype=np.uint32),
        "scalar": np.float64(1.5),
        "empty": torch.empty(0, 3),
    }
    back = serialize.decode(serialize.encode(state))
    assert back["lr"] == state["lr"] and math.copysign(1, back["specials"][2]) == -1
    assert back["specials"][:2] == state["specials"][:2] and back["specials"][3] == 5e-324
    assert back["big"] == state["big"] and back["neg"] == state["neg"]
    assert back["flags"] == (True, False, None) and isinstance(back["flags"], tuple)
    assert back["name"] == state["name"] and back["blob"] == state["blob"] and back[1] == "int key"
    for a, b in zip(state["tensors"], back["tensors"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert back["array"].dtype == np.uint32 and np.array_equal(back["array"], state["array"])
    assert back["scalar"] == 1.5 and back["empty"].shape == (0, 3)
    nan = serialize.decode(serialize.encode(float("nan")))
    assert math.isnan(nan)


def test_runs_of_32_bit_words_travel_as_one_array_and_come_back_exactly():
    state = random.getstate()  # (3, 625 ints, None)
    data = serialize.encode(state)
    assert len(data) < 4 * 625 + 64  # 4 bytes a word, not an encoded int each
    assert serialize.decode(data) == state and type(serialize.decode(data)[1]) is tuple
    for value in (
        [7] * 20,
        list(range((1 << 32) - 20, 1 << 32)),
        [True] * 20,
        [1 << 32] * 20,
        [-1] * 20,
        [1.0] * 20,
        [0] * 15,
        [1, True] * 10,
        (5,) * 16,
    ):
        back = serialize.decode(serialize.encode(value))
        assert back == value and type(back) is type(value)
        assert [type(x) for x in back] == [type(x) for x in value]  # a bool stays a bool
    with pytest.raises(ValueError, match="truncated"):
        serialize.decode(serialize.encode([1] * 20)[:-1])


def test_refuses_arbitrary_objects_with_their_path():
    with pytest.raises(TypeError, match=r"state\['sched'\]\[1\]: cannot encode object"):
        serialize.encode({"sched": [1, object()]})
    with pytest.raises(TypeError, match="numpy array of Python objects"):
        serialize.encode(np.array([object()]))


def test_rejects_garbage():
    with pytest.raises(ValueError):
        serialize.decode(b"Z")
    with pytest.raises(ValueError, match="trailing"):
        serialize.decode(serialize.encode(1) + b"N")


def test_lr_scheduler_state_round_trips():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=100)
    for _ in range(7):
        opt.step()
        sched.step()
    state = serialize.decode(serialize.encode(sched.state_dict()))
    fresh = torch.optim.lr_scheduler.OneCycleLR(
        torch.optim.AdamW(model.parameters(), lr=1e-3), max_lr=0.01, total_steps=100
    )
    fresh.load_state_dict(state)
    assert fresh.state_dict() == sched.state_dict()


def test_rng_state_restores_every_generator():
    rng = RNGState()
    saved = serialize.decode(serialize.encode(rng.state_dict()))
    first = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    rng.load_state_dict(saved)
    again = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(first[0], again[0])
    assert np.array_equal(first[1], again[1]) and first[2] == again[2]
