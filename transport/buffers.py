"""The buffers a backend sends from and receives into: on the host (shared, pinned, or
plain) or on a device."""

from __future__ import annotations

import logging

import torch

from replica.transport import memfd

__all__ = ["transfer_buffer"]

logger = logging.getLogger(__name__)


def transfer_buffer(
    nbytes: int, *, device: torch.device | str = "cpu", pin_memory: bool = False, shared: bool = False
) -> torch.Tensor:
    """A zeroed uint8 buffer of ``nbytes`` on ``device`` that a backend sends from or
    receives into. On the host: in shared memory when ``shared`` asks (the shm backend
    offers its buckets where they lie, and a peer on a GPU copies into it directly),
    pinned too when ``pin_memory`` asks and CUDA is present (copies to and from a GPU
    then run asynchronously on the copy engines); else pinned, else plain. A CUDA
    buffer is complete on return (its zeros are not left queued on a stream that a
    transfer into it would not wait for)."""
    device = torch.device(device)
    pin = device.type == "cpu" and pin_memory and torch.cuda.is_available()
    if device.type == "cpu" and shared:
        try:
            return memfd.shared_empty(nbytes, pinned=pin)
        except OSError as exc:  # no memfd here (out of descriptors, a seccomp filter): still a buffer
            logger.warning(
                "cannot allocate %d bytes of shared memory (%s): a plain buffer instead (the shm "
                "backend copies its buckets into shared memory, or its peers fall back)",
                nbytes,
                exc,
            )
        except RuntimeError as exc:  # CUDA would not page-lock it: pinned and private is faster to a GPU
            logger.warning(
                "cannot pin %d bytes of shared memory (%s): a pinned private buffer instead (the shm "
                "backend copies its buckets through a staging region)",
                nbytes,
                exc,
            )
    if pin:
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if buffer.is_cuda:  # its zeros were queued on this thread's stream, just now
        torch.cuda.current_stream(device).synchronize()
    return buffer
