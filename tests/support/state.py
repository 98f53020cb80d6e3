"""The mirror's state in the tests: the demo job's model (examples/fsdp_job.py) at world
size 1, trained, mirrored by a Replicator and Mirror in this process, its tensors taken
and compared bit for bit; and an export read back by ``safetensors.safe_open``."""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta
from pathlib import Path

import torch
from fsdp_job import JobShape, build_job, train_step
from safetensors import safe_open

import replica
from replica.state.export import EXTRAS_KEY
from replica.state.layout import StateLayout, dtype_of, state_tensors
from replica.state.snapshot import Snapshot

__all__ = [
    "SHAPE",
    "T",
    "TOKEN",
    "assert_safe_open_reads",
    "assert_state_equal",
    "bits",
    "config",
    "job",
    "mirrored",
    "state_of",
    "trained",
]

TOKEN = b"mirror-unit-token"
SHAPE = JobShape(layers=2)
T = timedelta(seconds=30)


def config(**kw) -> replica.Config:
    """The tests' Config: TOKEN, T for every wait, 16 KiB buckets unless told (many of them)."""
    kw.setdefault("bucket_bytes", 16 << 10)
    return replica.Config(token=TOKEN, timeout=T, commit_timeout=T, **kw)


def job(shape=SHAPE, seed=0):
    """The demo job's objects at world size 1, without FSDP; ``seed``: other initial weights."""
    return build_job(shape, rank=0, world_size=1, fsdp=False, seed=seed)


@contextlib.contextmanager
def mirrored(store, j, cfg: replica.Config | None = None):
    """A Mirror and a Replicator of job ``j`` in this process (world size 1)."""
    cfg = cfg or config()
    with (
        replica.Mirror(rank=0, world_size=1, store=store, config=cfg) as mirror,
        replica.Replicator(j.model, j.optimizer, j.extra, store=store, config=cfg, rank=0, world_size=1) as rep,
    ):
        yield mirror, rep


def state_of(j) -> list[torch.Tensor]:
    """A copy of job ``j``'s mirrored tensors (model and optimizer), in layout order."""
    return [t.clone() for _, t in state_tensors(j.model, j.optimizer)]


def assert_state_equal(a, b):
    """Two ``state_of`` results are equal bit for bit, dtypes included."""
    assert len(a) == len(b)
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=False))


def trained(j, steps: int, rep: replica.Replicator | None = None, first: int = 1):
    """``steps`` train steps of job ``j``, numbered from ``first``; each committed by ``rep`` if given."""
    for s in range(first, first + steps):
        train_step(j)
        if rep is not None:
            rep.commit(s)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaN payloads and -0.0 included), for bit-exact comparisons."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_safe_open_reads(path: str | Path, snapshot: Snapshot) -> None:
    """``safetensors.safe_open`` reads the export at ``path``: every tensor of
    ``snapshot`` (what ``load_export(path)`` returned) bit for bit, its extras, and
    the metadata (layout, step, and the digests when they are offset-keyed)."""
    layout = snapshot.layout
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert StateLayout.from_json(meta["replica.state.layout"]) == layout
        assert int(meta["replica.step"]) == snapshot.step
        if meta.get("replica.digests_keyed") == "offset":
            assert [int(d) for d in json.loads(meta["replica.digests"])] == snapshot.digests
        assert sorted(f.keys()) == sorted([*(e.name for e in layout.entries), EXTRAS_KEY])
        for e in layout.entries:
            t = f.get_tensor(e.name)
            assert t.dtype == dtype_of(e.dtype) and tuple(t.shape) == tuple(e.shape), e.name
            assert torch.equal(bits(t), snapshot.buffer[e.offset : e.offset + e.nbytes].cpu()), e.name
        assert f.get_tensor(EXTRAS_KEY).numpy().tobytes() == snapshot.extras()
