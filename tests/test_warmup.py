"""A standby's warm-up (``replica.mirror.warmup``): a step run ahead of time on a process group
that is not connected yet. Its collectives complete without communicating, ``torch.compile``
compiles in it (and not again for the same step), and it leaves nothing behind: gradients
dropped, every global RNG as before, the parameters untouched. An optimizer step, a batch
from a mirrored loader and connecting the group are refused inside it. The real job (a
compiled Hugging Face model whose promoted standby does not compile in its failover) is in
tests/test_real_jobs.py."""

from __future__ import annotations

import random

import pytest
import torch

from replica.errors import ReplicaError
from support.children import spawn


class Block(torch.nn.Module):
    """A user's module (dynamo traces the forward of a class outside torch.nn)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.dropout(torch.nn.functional.gelu(self.inner(x)), 0.5))


def _standby(pipe) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    import replica
    from replica.mirror.warmup import warm_up
    from replica.state.data import Batches

    # A standby's group: rank 1 of 2, no generation connected (it builds its model before joining).
    group = replica.init_resilient_process_group(store=dist.HashStore(), rank=1, world_size=2, generation=None)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), torch.nn.Linear(4, 4))
    model[0].compile(backend="eager")  # dynamo's graphs without code generation; before sharding
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = Batches(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2), name="train")
    before = [p.to_local().clone() for p in model.parameters()]
    sample = torch.randn(4, 8)

    def step() -> None:
        model(sample).sum().backward()

    def run(fn) -> object:
        return warm_up(fn, model=model, optimizer=optimizer, extra={"train": loader}, group=group)

    torch.manual_seed(1)
    random.seed(1)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(1)
    random.seed(1)
    first = run(step)
    out = {
        "rng_kept": torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1],
        "grads_dropped": all(p.grad is None for p in model.parameters()),
        "params_kept": all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before, strict=False)),
        "errored": group.errored,
        "first_graphs": first.graphs,
        "again_graphs": run(step).graphs,  # the same step: dynamo's graph is reused
    }
    refusals = {
        "optimizer": lambda: (step(), optimizer.step()),
        "loader": lambda: next(loader),
        "connect": lambda: group.configure(0),
    }
    for name, fn in refusals.items():
        try:
            run(fn)
            out[name] = None
        except ReplicaError as exc:
            out[name] = str(exc)
    out["loader_after"] = next(loader)[0].tolist()  # the loader works again, from its start
    out["grads_after_refusal"] = all(p.grad is None for p in model.parameters())
    pipe.send(out)


def test_a_warm_up_compiles_and_leaves_nothing_behind():
    with spawn(_standby, name="standby") as child:
        out = child.recv(180)
    assert out["rng_kept"], "the warm-up moved a global RNG"
    assert out["grads_dropped"] and out["grads_after_refusal"], "the warm-up left gradients behind"
    assert out["params_kept"], "the warm-up changed the parameters"
    assert out["errored"] is None, "a rehearsal's collectives must not fail the group"
    assert out["first_graphs"] >= 1, "torch.compile compiled nothing in the warm-up"
    assert out["again_graphs"] == 0, "the same step compiled again"
    assert "optimizer.step()" in out["optimizer"]
    assert "mirrored loader" in out["loader"] and "sample batch" in out["loader"]
    assert "during a rehearsal" in out["connect"]
    assert out["loader_after"] == [0.0, 1.0]


def test_a_rehearsal_is_refused_on_a_connected_group():
    from support.resilient import allreduce, make_group

    group = make_group()
    with group.rehearsal():
        assert allreduce(group, 5.0).item() == 5.0  # completed at once, untouched, nothing recorded
        with pytest.raises(ReplicaError, match="already running"), group.rehearsal():
            pass
    assert group.errored is None
    group.configure(0)
    with pytest.raises(ReplicaError, match="not connected yet"), group.rehearsal():
        pass
    group.shutdown()
