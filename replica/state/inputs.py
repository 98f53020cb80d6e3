"""The divergence guard's look at what goes into a step: a digest of every forward's inputs
(each tensor anywhere in its arguments, bytes exact) and of the global RNG states at its
start, recorded per step on every rank by a forward pre-hook on the root module. A step
redone after a failover must see the same ones, forward by forward, as its first attempt on
this rank did: a loop that takes its batches from an iterator of its own (not the mirrored
loader's), or draws from an RNG outside the mirrored state, feeds the redo something else,
and the guard says so (``Measure.INPUT``) even when the first attempt died before it had a
loss or a packed state to compare (a kill in the forward or the backward).

The digests are taken where the tensors are (a GPU input's on the GPU, no synchronization)
and read back when the step is settled (``settle``: at its ``log``, after its loss was read)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from replica import ops

__all__ = ["InputDigests", "InputMismatch"]

#: Steps whose first attempt's digests a rank keeps, to check their redo against.
_KEPT = 16


@dataclass(kw_only=True, frozen=True, slots=True)
class InputMismatch:
    """The first forward of a redone step whose inputs differ from its first attempt's."""

    step: int
    forward: int  # its index among the step's forwards (micro-batches), from 0
    before: str  # the first attempt's digest of what differs
    after: str  # the redo's
    what: str  # "its input tensors", "the RNG state at its start" or both


class _Forward:
    """One forward's digests: of its input tensors (device tensors until read) and of the RNG states."""

    __slots__ = ("inputs", "rng")

    def __init__(self, inputs: list[torch.Tensor], rng: list[torch.Tensor]):
        self.inputs, self.rng = inputs, rng

    def read(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(int(d.item()) for d in self.inputs), tuple(int(d.item()) for d in self.rng)


def _digest(t: torch.Tensor) -> torch.Tensor:
    """A one-element int64 tensor on ``t``'s device: the digest of its bytes (and its shape and
    dtype, folded in by the caller's order). One thread: inputs are small."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n == 0:
        return torch.zeros(1, dtype=torch.int64, device=t.device)
    return ops.checksum(flat, -(-n // 8) * 8, 0, threads=1)


def _tensors(value: object, out: list[torch.Tensor]) -> None:
    """Every strided tensor in ``value`` (arguments, keyword arguments, nested sequences and mappings)."""
    if isinstance(value, torch.Tensor):
        if value.layout == torch.strided:
            out.append(value)
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            _tensors(value[key], out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, out)


class InputDigests:
    """Per step, the digests of each forward of ``attach``'s module: the first attempt's are
    kept; a redo's (``begin`` of a step seen before) are compared with them at ``settle``, over
    the forwards both recorded (``void`` ends an attempt's record early). ``skip()`` true: the
    forward is not one of the job's (a standby's warm-up)."""

    def __init__(self, *, skip: Callable[[], bool] = lambda: False):
        self._skip = skip
        self._first: dict[int, list[_Forward]] = {}
        self._redo: dict[int, list[_Forward]] = {}
        self._current: list[_Forward] | None = None
        self._handle = None

    def attach(self, model: torch.nn.Module) -> None:
        if self._handle is not None:
            self._handle.remove()
        import torch._dynamo  # here, not at import: the hook runs eagerly beside a compiled model, never traced

        # (torch._dynamo.disable is unannotated: pyright infers the union of all its returns, where a
        # function passed in comes back wrapped, with its own signature)
        hook = torch._dynamo.disable(self._pre_forward)
        self._handle = model.register_forward_pre_hook(hook, with_kwargs=True)  # pyright: ignore[reportArgumentType]

    def begin(self, step: int) -> None:
        """Step ``step`` starts: its first attempt, or a redo of it (a new one each time)."""
        if step in self._first:
            self._current = self._redo[step] = []
        else:
            self._current = self._first[step] = []
            for old in sorted(self._first)[:-_KEPT]:
                del self._first[old]
                self._redo.pop(old, None)

    def void(self) -> None:
        """The current attempt failed (a trainer died): what its forwards are fed from now on
        may be placeholders (a rollout request answered with none, as the step is redone), not
        the job's inputs, so they are not recorded; the forwards recorded before stay."""
        self._current = None

    def settle(self, step: int) -> InputMismatch | None:
        """The first forward of a redo of ``step`` whose digests differ from the first attempt's
        (compared over the forwards both ran: the first attempt may have died midway); None
        when they agree or ``step`` was not redone. Reads the digests (waits for their kernels)."""
        redo = self._redo.pop(step, None)
        if not redo:
            return None
        for index, (a, b) in enumerate(zip(self._first.get(step, []), redo, strict=False)):
            (inputs_a, rng_a), (inputs_b, rng_b) = a.read(), b.read()
            if (inputs_a, rng_a) == (inputs_b, rng_b):
                continue
            parts = [
                name
                for name, x, y in (
                    ("its input tensors", inputs_a, inputs_b),
                    ("the RNG state at its start", rng_a, rng_b),
                )
                if x != y
            ]
            first_a, first_b = (inputs_a, inputs_b) if inputs_a != inputs_b else (rng_a, rng_b)
            return InputMismatch(
                step=step, forward=index, what=" and ".join(parts), before=_hex(first_a), after=_hex(first_b)
            )
        return None

    def _pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._current is None or self._skip():
            return
        found: list[torch.Tensor] = []
        _tensors((args, kwargs), found)
        # Shapes and dtypes count too: the same bytes in another shape are another input.
        shapes = torch.tensor(
            [d for t in found for d in (*t.shape, len(t.shape), _DTYPE_CODE.get(t.dtype, -1))], dtype=torch.int64
        )
        inputs = [_digest(shapes), *(_digest(t) for t in found)]
        rng = [_digest(torch.get_rng_state())]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng.append(_digest(torch.cuda.get_rng_state()))
        self._current.append(_Forward(inputs, rng))


_DTYPE_CODE = {
    dtype: i
    for i, dtype in enumerate(
        (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
    )
}


def _hex(digests: tuple[int, ...]) -> str:
    combined = 0
    for d in digests:
        combined = (combined * 1000003 ^ (d & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
    return f"{combined:#018x}"
