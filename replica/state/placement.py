"""Pack and unpack a rank's state tensors when they do not all live on the
snapshot buffer's device.

A CUDA model's state is not all on the GPU: non-fused Adam/AdamW keep
``state["step"]`` as a CPU scalar tensor. And a standby may hold its mirror in
(pinned) host memory while the model it restores into lives on the GPU. The
kernels move bytes within one device, so the tensors on the buffer's device go
through one ``ops.pack``/``ops.unpack`` call and the others ("foreign") are
staged:

* host tensors into a CUDA buffer: packed on the host into one pinned staging
  buffer, copied to the device in one transfer, and placed by the same device
  pack call as the rest (the staged bytes are just more sources);
* CUDA tensors into a host buffer: one asynchronous device-to-host copy per
  tensor into the (pinned) buffer, then one wait.

Restores run the same ways backwards. Only CPU <-> one CUDA device is
supported; state spread over several GPUs raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replica import ops
from replica.errors import ReplicaError

__all__ = ["on_device", "pack_state", "state_device", "unpack_state"]


def state_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """Where a snapshot of ``tensors`` is packed: their accelerator if any, else the host."""
    devices = {t.device for t in tensors}
    accelerators = sorted({d for d in devices if d.type != "cpu"}, key=str)
    if len(accelerators) > 1:
        raise ReplicaError(
            f"state tensors live on several accelerators {[str(d) for d in accelerators]}; a snapshot is packed on one"
        )
    return accelerators[0] if accelerators else torch.device("cpu")


def on_device(tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether every one of ``tensors`` lives on ``device`` (then ``pack_state`` and
    ``unpack_state`` need no staging)."""
    return all(t.device == device for t in tensors)


def _bytes_of(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ReplicaError(f"{what} is not contiguous (strides {t.stride()})")
    return t.detach().reshape(-1).view(torch.uint8)


def _split(tensors: Sequence[torch.Tensor], offsets: Sequence[int], device: torch.device):
    local_t, local_o, foreign_t, foreign_o = [], [], [], []
    for t, o in zip(tensors, offsets, strict=True):
        if t.device == device:
            local_t.append(t)
            local_o.append(o)
        elif t.numel():
            if t.device.type != "cpu" and device.type != "cpu":
                raise ReplicaError(
                    f"a state tensor on {t.device} and a snapshot on {device}: "
                    "only host <-> one accelerator is supported"
                )
            foreign_t.append(t)
            foreign_o.append(o)
    return local_t, local_o, foreign_t, foreign_o


def _synchronize(tensors: Sequence[torch.Tensor]) -> None:
    # The calling thread's stream (a commit's or a restore's own thread): the copies just
    # queued here are on it.
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def pack_state(
    tensors: Sequence[torch.Tensor],
    buffer: torch.Tensor,
    offsets: Sequence[int],
    *,
    block_bytes: int | None = None,
    same_device: bool = False,
) -> torch.Tensor | None:
    """``ops.pack(tensors, buffer, offsets)`` for tensors on the buffer's device and the host.

    With ``block_bytes``, returns ``ops.checksum(buffer, block_bytes)`` of the result,
    taken in the same pass as the copy where it can be (``ops.pack_checksum``). A
    CUDA buffer (and its digests) is complete once the current stream reaches this
    point (as with ``ops.pack``); a host buffer is complete on return.
    ``same_device``: the caller knows every tensor is on the buffer's device
    (``on_device``), so they go to the kernel without a look at each; one that is
    not raises RuntimeError before any byte is written.
    """

    def final_pack(srcs: Sequence[torch.Tensor], offs: Sequence[int]) -> torch.Tensor | None:
        if block_bytes is None:
            ops.pack(srcs, buffer, offs)
            return None
        return ops.pack_checksum(srcs, buffer, offs, block_bytes)

    if same_device:
        return final_pack(tensors, offsets)
    local_t, local_o, foreign_t, foreign_o = _split(tensors, offsets, buffer.device)
    if not foreign_t:
        return final_pack(local_t, local_o)
    if buffer.is_cuda:  # host tensors into device memory: one staged upload
        staged_o, total = ops.aligned_offsets(foreign_t)
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        ops.pack(foreign_t, host, staged_o)
        device = host.to(buffer.device, non_blocking=True)
        views = [device[o : o + t.numel() * t.element_size()] for t, o in zip(foreign_t, staged_o, strict=False)]
        return final_pack(local_t + views, local_o + foreign_o)
    # device tensors into host memory: their copies finish after the pack, so the
    # digests come from a pass of their own once they have
    pinned = buffer.is_pinned()
    for t, o in zip(foreign_t, foreign_o, strict=False):
        src = _bytes_of(t, "a state tensor")
        buffer[o : o + src.numel()].copy_(src, non_blocking=pinned)
    ops.pack(local_t, buffer, local_o)
    _synchronize(foreign_t)
    return None if block_bytes is None else ops.checksum(buffer, block_bytes)


def unpack_state(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """``ops.unpack(buffer, tensors, offsets)`` for tensors on the buffer's device and the host.

    Host tensors are complete on return; CUDA tensors once their current stream
    reaches this point.
    """
    local_t, local_o, foreign_t, foreign_o = _split(tensors, offsets, buffer.device)
    if not foreign_t:
        ops.unpack(buffer, local_t, local_o)
    elif buffer.is_cuda:  # device snapshot, host tensors: one staged download
        staged_o, total = ops.aligned_offsets(foreign_t)
        device = torch.empty(total, dtype=torch.uint8, device=buffer.device)
        views = [device[o : o + t.numel() * t.element_size()] for t, o in zip(foreign_t, staged_o, strict=False)]
        ops.unpack(buffer, local_t + views, local_o + foreign_o)
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        host.copy_(device, non_blocking=True)
        torch.cuda.current_stream(buffer.device).synchronize()  # this thread's copy above (a restore's thread)
        ops.unpack(host, foreign_t, staged_o)
    else:  # host snapshot, device tensors (a standby holding its mirror in host memory)
        pinned = buffer.is_pinned()
        for t, o in zip(foreign_t, foreign_o, strict=False):
            dst = _bytes_of(t, "a restore target")
            dst.copy_(buffer[o : o + dst.numel()], non_blocking=pinned)
        ops.unpack(buffer, local_t, local_o)
        # The host buffer may be overwritten by the next received version: wait for the copies.
        _synchronize(foreign_t)
