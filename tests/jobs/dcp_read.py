"""Read a durable floor version with torch's own ``torch.distributed.checkpoint.load``, as a
user would: the demo job's model and optimizer (examples/fsdp_job.py) built at world size
WORLD (FSDP2 over gloo when WORLD > 1, plain at 1), their state dicts from
``get_state_dict``, loaded through ``HuggingFaceStorageReader``. Each rank then checks every
tensor it holds against the whole tensors assembled from the version's files by replica's
own reader (``load_export``, digests checked) and writes what it compared as JSON.

usage: dcp_read.py VERSION_FOLDER WORLD RANK INIT_FILE OUT_JSON"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from fsdp_job import JobShape, build_job  # noqa: E402

from replica.state.export import export_path, load_export  # noqa: E402
from replica.state.layout import dtype_of  # noqa: E402


def whole_tensors(folder: Path, world: int) -> dict[str, torch.Tensor]:
    """Every state tensor of the version, its ranks' shards put where their layouts say."""
    parts = [load_export(export_path(folder, r)) for r in range(world)]
    whole: dict[str, torch.Tensor] = {}
    for snapshot in parts:
        buffer = snapshot.buffer.cpu()
        for e in snapshot.layout.entries:
            shard = buffer[e.offset : e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)
            start = e.global_offset or (0,) * len(e.shape)
            end = tuple(o + s for o, s in zip(start, e.shape, strict=False))
            have = whole.get(e.name)
            size = tuple(max(a, b) for a, b in zip(have.shape, end, strict=False)) if have is not None else end
            if have is None or tuple(have.shape) != size:
                grown = torch.zeros(size, dtype=shard.dtype)
                if have is not None:
                    grown[tuple(slice(0, n) for n in have.shape)] = have
                whole[e.name] = have = grown
            have[tuple(slice(o, o + s) for o, s in zip(start, e.shape, strict=False))] = shard
    return whole


def flatten(prefix: str, value, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}.{k}", v, out)


def main() -> None:
    folder, world, rank, init, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    # The source job's world size: its files. The shape's step count only sets the schedule.
    source = len(list(folder.glob("rank*.safetensors")))
    job = build_job(JobShape(total_steps=10), rank=rank, world_size=world, fsdp=world > 1)
    model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    # The optimizer's hyperparameters (param_groups) are the user's own, not part of the floor.
    dcp.load(
        state, storage_reader=HuggingFaceStorageReader(str(folder)), planner=DefaultLoadPlanner(allow_partial_load=True)
    )
    tensors: dict[str, torch.Tensor] = {}
    flatten("model", state["model"], tensors)
    flatten("optim", state["optim"], tensors)
    expected = whole_tensors(folder, source)
    # A tied parameter (the head's weight is the embedding's) is mirrored once, under the first
    # name; the state dict holds it under both: compare it with the tensor it shares storage with.
    first_of = {}
    for name, t in tensors.items():
        first_of.setdefault(local(t).untyped_storage().data_ptr(), name)
    compared, differ, tied = [], [], {}
    for name, t in sorted(tensors.items()):
        if name.startswith("optim.param_groups"):
            continue
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        source_name = name
        if name not in expected:
            source_name = tied[name] = first_of[local(t).untyped_storage().data_ptr()]
        compared.append(name)
        if source_name not in expected or not torch.equal(full.cpu(), expected[source_name]):
            differ.append(name)
    Path(out).write_text(
        json.dumps(
            {"compared": compared, "differ": differ, "expected": sorted(expected), "tied": tied, "source_world": source}
        )
    )
    if world > 1:
        dist.barrier()  # no rank leaves while another still gathers
        dist.destroy_process_group()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


if __name__ == "__main__":
    main()
