"""``RNGState``: the torch, CUDA, numpy and Python random generators as one
``Stateful`` object, so they are mirrored with the rest of a rank's state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RNGState"]


class RNGState:
    """Pass as an ``extra`` to mirror and restore every global RNG of the process."""

    def state_dict(self) -> dict[str, Any]:
        state = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(tuple(state["numpy"]))
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])
