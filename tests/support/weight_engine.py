"""Stands in for an inference engine in the weight-sync tests: a ``WeightReceiver`` whose
versions are loaded into a dict of tensors."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import replica
from replica.weights import WeightReceiver

__all__ = ["EngineStandIn"]


class EngineStandIn:
    def __init__(self, index: int, store: dist.Store, *, config: replica.Config, wait: timedelta, **kw):
        self.weights: dict[str, torch.Tensor] = {}
        self.wait = wait
        self.receiver = WeightReceiver(index=index, store=store, config=config, **kw)

    def load(self, views) -> None:
        for name, t in views:
            self.weights[name] = t.clone()

    def sync(self, step: int) -> int | None:
        assert self.receiver.wait_ready(step, self.wait), f"step {step} never arrived"
        return self.receiver.apply(self.load)
