"""StateLayout: deterministic enumeration, alignment, fingerprints, clear mismatches;
on plain modules and on real FSDP2 shards in two gloo processes."""

import pytest
import torch

from replica import ops
from replica.errors import LayoutMismatchError
from replica.state.layout import StateLayout, global_offsets, state_tensors
from support.children import spawn
from support.ports import free_port

KiB = 1 << 10


def trained(hidden=16, dtype=torch.float32, steps=1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4))
    model[2].to(dtype)
    model.register_buffer("counter", torch.zeros(3, dtype=torch.int64))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(4, 8)
        model[2](model[1](model[0](x)).to(dtype)).float().sum().backward()
        opt.step()
    return model, opt


def layout_of(model, opt, **kw):
    kw = {"world_size": 1, "rank": 0, "extras_capacity": 4 * KiB, "bucket_bytes": 1 * KiB} | kw
    return StateLayout.build(list(state_tensors(model, opt)), **kw)


def test_enumerates_params_persistent_buffers_and_optimizer_state():
    model, opt = trained()
    names = [name for name, _ in state_tensors(model, opt)]
    assert names[:6] == [
        "model.0.weight",
        "model.0.bias",
        "model.1.weight",
        "model.1.bias",
        "model.2.weight",
        "model.2.bias",
    ]
    # Named as torch.distributed.checkpoint names {"model": ..., "optim": ...} state dicts.
    assert "model.counter" in names and "model.scratch" not in names
    assert names[-3:] == ["optim.state.2.bias.exp_avg", "optim.state.2.bias.exp_avg_sq", "optim.state.2.bias.step"]
    assert all(e.global_offset == () for e in layout_of(model, opt).entries)  # whole tensors: no shard offsets


def test_offsets_are_aligned_disjoint_and_packable():
    model, opt = trained(dtype=torch.bfloat16)
    tensors = [t for _, t in state_tensors(model, opt)]
    layout = layout_of(model, opt)
    ends = [e.offset + e.nbytes for e in layout.entries]
    assert all(e.offset % ops.ALIGNMENT == 0 for e in layout.entries)
    assert all(end <= nxt.offset for end, nxt in zip(ends, layout.entries[1:], strict=False))
    assert layout.extras_offset >= ends[-1] and layout.total_bytes >= layout.extras_offset + 4 * KiB
    buckets = layout.buckets()
    assert buckets[0][0] == 0 and buckets[-1][1] == layout.total_bytes
    assert all(a[1] == b[0] for a, b in zip(buckets, buckets[1:], strict=False))
    buf = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    ops.pack(tensors, buf, layout.offsets)
    back = [torch.empty_like(t) for t in tensors]
    ops.unpack(buf, back, layout.offsets)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back, strict=False))


def test_fingerprint_is_deterministic_and_json_round_trips():
    a = layout_of(*trained())
    b = layout_of(*trained(steps=3))  # other values, same structure
    assert a.fingerprint == b.fingerprint
    a.check_matches(b)
    assert StateLayout.from_json(a.to_json()) == a
    tampered = a.to_json().replace('"model.0.bias"', '"model.0.bias2"')
    with pytest.raises(LayoutMismatchError, match="fingerprint"):
        StateLayout.from_json(tampered)


@pytest.mark.parametrize(
    "other,message",
    [
        (dict(hidden=32), "state tensor 0 differs in shape: model.0.weight"),
        (dict(dtype=torch.bfloat16), "state tensor 4 differs in dtype: model.2.weight float32 here"),
    ],
)
def test_mismatch_names_the_first_difference(other, message):
    with pytest.raises(LayoutMismatchError, match=message):
        layout_of(*trained()).check_matches(layout_of(*trained(**other)))


def test_mismatch_in_world_size_and_missing_state():
    model, opt = trained()
    with pytest.raises(LayoutMismatchError, match="world_size differs: 1 here, 2 in the mirror"):
        layout_of(model, opt).check_matches(layout_of(model, opt, world_size=2))
    fresh_model, fresh_opt = trained(steps=0)  # optimizer state not created yet
    with pytest.raises(LayoutMismatchError, match="first unmatched: optim.state.0.weight.exp_avg"):
        layout_of(fresh_model, fresh_opt).check_matches(layout_of(model, opt))


def test_bad_arguments():
    model, opt = trained()
    with pytest.raises(ValueError, match="bucket_bytes"):
        layout_of(model, opt, bucket_bytes=100)
    with pytest.raises(ValueError, match="named"):
        StateLayout.build(
            [("a", torch.zeros(1)), ("a", torch.zeros(1))], world_size=1, rank=0, extras_capacity=0, bucket_bytes=64
        )


# --- FSDP2, two real processes ---


def _fsdp_rank(pipe, rank: int, port: int, hidden: int) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        tensors = list(state_tensors(model, opt))
        assert all(type(t) is torch.Tensor for _, t in tensors), "DTensors must be taken to_local()"
        layout = StateLayout.build(
            tensors,
            world_size=2,
            rank=rank,
            extras_capacity=KiB,
            bucket_bytes=KiB,
            global_offsets=global_offsets(model, opt),
        )
        pipe.send(layout.to_json())
    finally:
        dist.destroy_process_group()


def _fsdp_layouts(hidden: int) -> list[StateLayout]:
    port = free_port()
    with spawn(_fsdp_rank, 0, port, hidden, name="rank0") as r0, spawn(_fsdp_rank, 1, port, hidden, name="rank1") as r1:
        return [StateLayout.from_json(r0.recv(120)), StateLayout.from_json(r1.recv(120))]


def test_fsdp2_shards():
    rank0, rank1 = _fsdp_layouts(hidden=16)
    assert [e.name for e in rank0.entries] == [e.name for e in rank1.entries]
    assert rank0.entries[0].shape == (8, 8)  # half of the 16 x 8 weight on each rank
    # where each shard lies in the whole tensor (through to_json/from_json), optimizer state too
    assert (rank0.entries[0].global_offset, rank1.entries[0].global_offset) == ((0, 0), (8, 0))
    moments = [
        (a.global_offset, b.global_offset)
        for a, b in zip(rank0.entries, rank1.entries, strict=False)
        if a.name == "optim.state.0.weight.exp_avg"
    ]
    assert moments == [((0, 0), (8, 0))]
    steps = [e for e in rank1.entries if e.name.endswith(".step")]
    assert steps and all(e.global_offset == () for e in steps)  # plain tensors, whole on every rank
    assert rank0.fingerprint != rank1.fingerprint  # the rank is part of the fingerprint
    with pytest.raises(LayoutMismatchError, match="rank differs: 0 here, 1 in the mirror"):
        rank0.check_matches(rank1)
    other0, _ = _fsdp_layouts(hidden=32)
    with pytest.raises(LayoutMismatchError, match=r"state tensor 0 differs in shape: model.0.weight \(8, 8\) here"):
        rank0.check_matches(other0)
