"""Staged loading for a running vLLM engine: a received version is loaded and
processed into the engine's kernel format *beside* the serving model, while the
engine keeps generating on the old weights; switching to it between
generations then only copies the processed tensors into the live ones and
rebinds kernel handles.

Why: vLLM's in-place ``reload_weights`` takes the live layers apart (back to
their checkpoint shapes), loads, and runs each layer's
``process_weights_after_loading`` again; on the CPU backend that repacks every
linear weight for oneDNN, so the engine stalls for as long as a reload from
disk takes. Here the same vLLM code runs, in a background thread, on a
*shadow* of the module tree: every module is cloned shallowly (same class,
same configuration, same ``quant_method``), its parameters are fresh tensors in
checkpoint shapes (from the metadata vLLM records for reloading), the model's
own ``load_weights`` routes the checkpoint names into them, and each loaded
module is processed. ``PreparedWeights.swap()`` copies the shadow's tensors
into the live ones (empty for repacked linear weights) and moves over the
attributes processing set (``cpu_linear``, the kernel's handle). The numbers
equal vLLM's own reload: the same loaders and the same processing, on the
same values. The cost is one more copy of the weights while a version is
prepared.

What it does not cover (``StagingUnsupported``, and the caller falls back to
``reload_weights``): a version that loads a module only in part, and modules
vLLM processes only after all others (attention with KV-cache scales).

This module is the only one of replica that reaches into vLLM's reload
internals (``LAYERWISE_INFO``, ``materialize_meta_tensor``,
``layer_ref_sentinel``, ``is_deferred_attention_layer``). ``check_vllm`` says
whether the running vLLM is a release it was tested with and has them; on any
other, staging is refused (``StagingUnsupported``) and versions are applied in
place through vLLM's public ``reload_weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import MethodType
from typing import Any, Protocol, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replica.errors import ReplicaError

__all__ = ["TESTED_VLLM", "PreparedWeights", "StagingUnsupported", "check_vllm", "prepare"]

logger = logging.getLogger(__name__)

_TREE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


class StagingUnsupported(ReplicaError):
    """This model or version cannot be prepared beside the live one; load it in place instead."""


#: The vLLM releases (major.minor) whose reload internals this module was written against and
#: tested with: tests/test_vllm.py runs staging on each.
TESTED_VLLM = ("0.32",)

#: The internals used here, as (module, name): all must exist.
_INTERNALS = (
    ("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO"),
    ("vllm.model_executor.model_loader.reload.meta", "materialize_meta_tensor"),
    ("vllm.model_executor.model_loader.reload.sanitize", "layer_ref_sentinel"),
    ("vllm.model_executor.layers.attention", "is_deferred_attention_layer"),
    ("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase"),
)


def check_vllm(version: str | None = None) -> None:
    """Raise StagingUnsupported, saying why, unless vLLM ``version`` (default: the one
    installed) is a release in ``TESTED_VLLM`` and has every internal staging uses."""
    import importlib

    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    if not any(version == v or version.startswith(v + ".") for v in TESTED_VLLM):
        raise StagingUnsupported(f"vLLM {version} is not a release staging was tested with ({', '.join(TESTED_VLLM)})")
    for module, name in _INTERNALS:
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise StagingUnsupported(f"vLLM {version} has no {module}.{name}") from exc


@dataclass(kw_only=True, slots=True)
class _Pair:
    live: torch.nn.Module
    shadow: torch.nn.Module
    attrs: dict[str, object]  # set by processing, to move onto the live module
    removed: tuple[str, ...]  # attributes processing deleted


class _LoadsWeights(Protocol):
    """A vLLM model: every model class loads checkpoint tensors with ``load_weights``."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


class PreparedWeights:
    """A version loaded and processed beside the live model; ``swap()`` makes the engine serve it."""

    def __init__(self, step: int, pairs: list[_Pair]):
        self.step = step
        self._pairs = pairs
        self.retired: list[object] = []

    def swap(self) -> None:
        """Between generations: copy the processed tensors into the live ones and rebind kernel handles.
        Everything that could fail was checked when the version was prepared. What was replaced
        (old kernel handles) is kept in ``retired`` so that it can be freed off the engine's thread."""
        with torch.no_grad():
            for pair in self._pairs:
                for kind in ("_parameters", "_buffers"):
                    live, shadow = getattr(pair.live, kind), getattr(pair.shadow, kind)
                    for name, tensor in live.items():
                        new = shadow[name]
                        if tensor is not None and new is not tensor:
                            tensor.data.copy_(new)
                for name in (*pair.removed, *pair.attrs):
                    if name in pair.live.__dict__:
                        self.retired.append(pair.live.__dict__.pop(name))
                pair.live.__dict__.update(pair.attrs)
        self._pairs = []  # the shadow's memory goes with it


def prepare(
    model: torch.nn.Module, weights, step: int, *, processed: Callable[[int], None] | None = None
) -> PreparedWeights:
    """Load ``weights`` (an iterator of ``(checkpoint name, tensor)``) into a
    shadow of ``model`` and process it; the live model is only read. Like vLLM's
    own reload, a module is processed as soon as all of it is loaded, so its
    checkpoint-shaped tensors are freed (and their memory reused) before the next.
    ``processed(nbytes)`` hears of each module processed, with the bytes it loaded."""
    shadows: list[tuple[torch.nn.Module, torch.nn.Module]] = []
    root = _shadow(model, shadows)
    counter = _CopyCounter()
    pending = [
        (live, shadow, fresh)
        for live, shadow in shadows
        if (fresh := [t for t in shadow._parameters.values() if t is not None and getattr(t, "_replica_fresh", False)])
    ]
    if not pending:  # found before anything is read: a consuming caller keeps its version
        raise StagingUnsupported("vLLM recorded no reload metadata for any module of this model")
    pairs: list[_Pair] = []

    def process_loaded() -> None:
        for item in [item for item in pending if all(counter.numel(t) >= _load_numel(t) for t in item[2])]:
            pending.remove(item)
            pairs.append(_process(*item[:2]))
            if processed is not None:
                processed(sum(t.numel() * t.element_size() for t in item[2]))

    def feed():
        for named in weights:
            yield named
            process_loaded()  # the loader has copied the previous tensor by the time it asks for the next

    with torch.no_grad(), counter:
        cast(_LoadsWeights, root).load_weights(feed())  # (a clone of a vLLM model: its class's load_weights)
    process_loaded()
    for live, _, fresh in pending:
        if any(counter.numel(t) for t in fresh):
            raise StagingUnsupported(f"{type(live).__name__}: this version loads it only in part")
    if not pairs:
        raise StagingUnsupported("the version loads no parameter of the model")
    return PreparedWeights(step, pairs)


def _load_numel(tensor: torch.Tensor) -> int:
    return getattr(tensor, "weight_loader_numel", tensor.numel())


def _process(live: torch.nn.Module, shadow: torch.nn.Module) -> _Pair:
    """``process_weights_after_loading`` on the shadow; what it changed, to move onto the live module."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if _is_deferred_attention(live):
        raise StagingUnsupported(f"{type(live).__name__}: vLLM processes it after all other layers")
    before = {k: v for k, v in shadow.__dict__.items() if k not in _TREE}
    shadow.__dict__.pop("_already_called_process_weights_after_loading", None)
    method = getattr(shadow, "quant_method", None)
    if isinstance(method, QuantizeMethodBase):
        method.process_weights_after_loading(shadow)
        update_tp_status = getattr(shadow, "update_param_tp_status", None)
        if update_tp_status is not None:
            update_tp_status()
    after = {k: v for k, v in shadow.__dict__.items() if k not in _TREE}
    pair = _Pair(
        live=live,
        shadow=shadow,
        attrs={k: v for k, v in after.items() if before.get(k, _MISSING) is not v},
        removed=tuple(k for k in before if k not in after),
    )
    _check_fits(pair)
    return pair


_MISSING = object()
#: The name of the loaders vLLM's in-place reload wraps parameters' own in (reload.layerwise).
_ONLINE_LOADER = "online_process_loader"


def _shadow(module: torch.nn.Module, out: list) -> torch.nn.Module:
    """A shallow clone of ``module`` and its children: the same configuration,
    fresh parameters in the shapes vLLM loads them in."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

    clone = module.__class__.__new__(module.__class__)
    clone.__dict__.update(module.__dict__)
    clone.__dict__["_modules"] = {
        name: None if child is None else _shadow(child, out) for name, child in module._modules.items()
    }
    clone.__dict__["_buffers"] = dict(module._buffers)
    clone.__dict__["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    params: dict[str, torch.Tensor | None] = {}
    info = LAYERWISE_INFO.get(module)
    if info is not None:
        for name, meta in info.restore_metadata[0].items():
            with info.restore_device:
                fresh = materialize_meta_tensor(meta)
            # (a tensor takes any Python attribute; torch's stub declares none)
            fresh._replica_fresh = True  # pyright: ignore[reportAttributeAccessIssue]
            params[name] = _rebind(fresh, module, clone)
    for name, tensor in module._parameters.items():
        if name not in params:  # built after create_weights (bias): a private copy, processing may change it
            params[name] = None if tensor is None else _private(tensor, module, clone)
    clone.__dict__["_parameters"] = params
    out.append((module, clone))
    return clone


def _private(tensor: torch.Tensor, module, clone) -> torch.Tensor:
    copy = tensor.detach().clone()
    copy.__class__ = tensor.__class__
    # (torch's stub gives Tensor the read-only __dict__ of a class, a mappingproxy; a tensor's is a dict)
    copy.__dict__ = dict(tensor.__dict__)  # pyright: ignore[reportAttributeAccessIssue]
    return _rebind(copy, module, clone)


def _rebind(tensor: torch.Tensor, module, clone) -> torch.Tensor:
    """Weight loaders bound to the live module (or to vLLM's placeholder for it) load into the
    clone. A loader an in-place reload wrapped (vLLM's ``online_process_loader``, which buffers
    into the live layer's reload state) is unwrapped to the loader it wraps."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    # (tensor.__dict__ is a dict: torch's stub makes it a class's read-only mappingproxy, as in _private)
    loader = tensor.__dict__.get("weight_loader")
    while loader is not None and getattr(loader, "__name__", None) == _ONLINE_LOADER and hasattr(loader, "__wrapped__"):
        loader = tensor.__dict__["weight_loader"] = loader.__wrapped__  # pyright: ignore[reportIndexIssue]
    for key, value in list(tensor.__dict__.items()):
        if isinstance(value, MethodType) and (value.__self__ is module or value.__self__ is layer_ref_sentinel):
            tensor.__dict__[key] = value.__func__.__get__(clone)  # pyright: ignore[reportIndexIssue]
    return tensor


def _check_fits(pair: _Pair) -> None:
    for kind in ("_parameters", "_buffers"):
        live, shadow = getattr(pair.live, kind), getattr(pair.shadow, kind)
        for name, tensor in live.items():
            new = shadow.get(name)
            if tensor is None:
                continue
            if new is None or new.shape != tensor.shape or new.dtype != tensor.dtype or new.device != tensor.device:
                raise StagingUnsupported(
                    f"{type(pair.live).__name__}.{name}: processed into "
                    f"{None if new is None else (tuple(new.shape), new.dtype)}, the live tensor "
                    f"is {(tuple(tensor.shape), tensor.dtype)}"
                )


def _is_deferred_attention(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return is_deferred_attention_layer(module)


class _CopyCounter(TorchDispatchMode):
    """Elements copied into each storage while loading (dispatch modes are per
    thread: the engine's own thread is not affected)."""

    def __init__(self):
        super().__init__()
        self._copied: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst = args[0]
            key = dst.untyped_storage().data_ptr()
            self._copied[key] = self._copied.get(key, 0) + dst.numel()
        return func(*args, **(kwargs or {}))

    def numel(self, tensor: torch.Tensor) -> int:
        return self._copied.get(tensor.untyped_storage().data_ptr(), 0)
