"""Tensors on the simulated NPU: wrappers that hold a CPU tensor, and the one path every operator on them takes.

``SimulatedTensor.__torch_dispatch__`` unwraps the arguments, runs the operator on the CPU and wraps the results; a
PrivateUse1 fallback does the same for factory functions (``torch.zeros(..., device="npu")``). On the way it refuses
what a device would refuse: a device tensor next to a host tensor of one or more dimensions, an operator declared
missing (:mod:`torchport.testing.npu_unsupported`), bfloat16 arithmetic on a chip without it. Random operators draw
from the device's own generator, and ``torch.save`` / ``torch.load`` keep the device of each tensor.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .npu_state import NPU, State, is_active, state
from .npu_unsupported import on_missing

__all__ = ["SimulatedTensor", "register"]

# Ops that may take host tensors next to device tensors, as on CUDA: copies between devices and indexing with
# host index tensors.
_MIXING_ALLOWED = {
    "_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "index", "index_put_", "_index_put_impl_",
    "index_put", "set_", "lift_fresh", "lift_fresh_copy", "alias",
}


_DATA = torch.Tensor.data  # the descriptor whose setter __torch_function__ watches


class SimulatedTensor(torch.Tensor):
    """A tensor on the simulated ``npu`` device; its data is the CPU tensor ``_raw``."""

    _raw: torch.Tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        # ``t.data = other`` (what nn.Module._apply does for .half(), .to(dtype)) swaps the wrapper's metadata in
        # C++; the host data this wrapper stands for must follow, or it keeps the old dtype and values
        if getattr(func, "__self__", None) is _DATA and getattr(func, "__name__", None) == "__set__":
            target, value = args
            with torch._C.DisableTorchFunctionSubclass():
                func(target, value)
            if isinstance(value, SimulatedTensor):
                previous = target.__dict__.get("_tracked")
                target._raw = value._raw
                state().track(target, target.device.index)  # the new storage counted for this tensor too
                if previous is not None:
                    previous()  # and the old one's count released now, not when this tensor dies
            return None
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @staticmethod
    def __new__(cls, raw: torch.Tensor, index: int) -> SimulatedTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, raw.size(), strides=raw.stride(), storage_offset=raw.storage_offset(), dtype=raw.dtype,
            layout=raw.layout, device=torch.device(NPU, index), requires_grad=raw.requires_grad,
            # sizes and strides are asked of __torch_dispatch__, so they follow the host tensor when an out= op
            # or resize_ changes it (torch.arange and torch.eye write into an empty out tensor)
            dispatch_sizes_strides_policy="sizes",
        )
        wrapper._raw = raw
        return wrapper

    def __init__(self, raw: torch.Tensor, index: int) -> None:
        state().track(self, index)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        text = repr(self._raw.detach())
        extra = f", device='{self.device}'"
        if self.grad_fn is not None:
            extra += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return text[:-1] + extra + ")"

    def tolist(self) -> Any:
        return self._raw.tolist()

    def data_ptr(self) -> int:
        # the address of the first element, as a device tensor reports it (a wrapper has no storage of its own and
        # would report its offset alone, so that every tensor at offset 0 looked like the same memory)
        return self._raw.data_ptr()

    def __deepcopy__(self, memo: dict) -> SimulatedTensor:
        # torch's default copies a wrapper by clone() only when its data_ptr() is 0, which a view's is not; copy
        # the host tensor instead, so that views of one tensor stay views of one copy (as on a device)
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment.")
        with torch.no_grad():
            copied = SimulatedTensor(copy.deepcopy(self._raw.detach(), memo), self.device.index)
        copied.requires_grad_(self.requires_grad)
        memo[id(self)] = copied
        for key, value in self.__dict__.items():  # what marks a Parameter (_is_param), and any user attribute
            # not the host tensor, the sizes cached by the dispatch policy, nor the storage's release (the copy has
            # its own)
            if key not in ("_raw", "_tracked") and not key.startswith("_sym_"):
                copied.__dict__[key] = copy.deepcopy(value, memo)
        return copied

    def numpy(self, *, force: bool = False) -> Any:
        if not force:
            raise TypeError(
                f"can't convert {self.device} device type tensor to numpy. "
                "Use Tensor.cpu() to copy the tensor to host memory first."
            )
        return self._raw.detach().numpy()

    def __reduce_ex__(self, protocol: int) -> Any:
        # Host data plus the device index. torch.save tags the host storage "npu:i" (see _tag_storage), so
        # torch.load's map_location decides where it lands, as for a real device tensor.
        return (_rebuild, (self._raw.detach(), self.device.index, self.requires_grad))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        return _run_on_host(func, args, kwargs or {})


# data_ptr of a host storage torch.load restored -> the location map_location sent it to ("cpu" or "npu:i")
_restored: dict[int, str] = {}


def _rebuild(raw: torch.Tensor, index: int, requires_grad: bool) -> torch.Tensor:
    where = _restored.get(raw.untyped_storage().data_ptr()) if raw.numel() else None
    if where == "cpu":
        tensor = raw  # torch.load(..., map_location="cpu")
    else:
        tensor = SimulatedTensor(raw, index if where is None else state().resolve(where))
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _tag_storage(storage: Any) -> str | None:
    """torch.save's location of a storage: "npu:i" for the host storage behind a simulated tensor."""
    if not is_active() or storage.device.type != "cpu" or storage.nbytes() == 0:
        return None
    pointer = storage.data_ptr()
    st = state()
    with st.lock:
        return next((f"npu:{index}" for index, ptr in st.storages if ptr == pointer), None)


def _restore_storage(storage: Any, location: str) -> Any:
    """torch.load's restore of a storage: stays in host memory; _rebuild wraps it according to ``location``."""
    if not is_active() or not location.startswith(("npu", "cpu")):
        return None
    where = "cpu" if location.startswith("cpu") else f"npu:{state().resolve(location)}"
    if storage.nbytes():
        _restored[storage.data_ptr()] = where
    return storage


def _run_on_host(func, args: tuple, kwargs: dict, dispatched: bool = False) -> Any:  # noqa: ANN001
    st = state()
    if not dispatched:  # reached through __torch_dispatch__, above the PrivateUse1 key: act as the dispatcher would
        qualified = func.name()
        fallback = sys.modules.get("torchport.compat.cpu_fallback")
        if fallback is not None and qualified in fallback.registered(NPU):
            return func.redispatch(_PRIVATEUSE1, *fallback.numbers_as_tensors(func, args), **kwargs)
        if qualified in st.missing:
            on_missing(st, qualified)
    name = func.__name__.split(".")[0]
    if name == "to" and not dispatched:
        # aten::to reaches __torch_dispatch__ only where autograd is off (inference mode, inside kernels). Run as one
        # host call it would return its input, the wrapper, for .to("cpu"); its own decomposition copies (_to_copy).
        return func.decompose(*args, **kwargs)
    sim_devices: list[torch.device] = []
    host_device: torch.device | None = None
    originals: dict[int, torch.Tensor] = {}

    def unwrap(x: Any) -> Any:
        nonlocal host_device
        if isinstance(x, SimulatedTensor):
            sim_devices.append(x.device)
            originals[id(x._raw)] = x
            return x._raw
        if isinstance(x, torch.Tensor):
            originals[id(x)] = x
            if x.dim() > 0:
                host_device = x.device
        return x

    host_args, host_kwargs = tree_map(unwrap, (args, kwargs))
    if not st.chip.bf16 and sim_devices and name not in _BF16_MOVES and not name.startswith("sym_"):
        _refuse_bf16(st, func, host_args, host_kwargs)
    if name not in _MIXING_ALLOWED and sim_devices:
        others = sorted({str(d) for d in sim_devices} | ({str(host_device)} if host_device is not None else set()))
        if len(others) > 1:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{others[0]} and {others[1]}! (in {func})"
            )

    target: int | None = sim_devices[0].index if sim_devices else st.current
    requested = kwargs.get("device")
    if requested is not None:
        requested = torch.device(requested)
        if requested.type == NPU:
            target = st.resolve(requested)
            host_kwargs["device"] = torch.device("cpu")
        else:
            target = None
    if host_kwargs.get("pin_memory"):
        host_kwargs["pin_memory"] = False
    if target is not None and torch.Tag.nondeterministic_seeded in func.tags:
        if _takes_generator(func):
            if host_kwargs.get("generator") is None:
                host_kwargs["generator"] = st.generators[target]
        else:  # rand_like, native_dropout...: draw from the device's generator through the host default one
            out = _with_device_rng(st.generators[target], func, host_args, host_kwargs)
            return tree_map(lambda x: _wrap_result(x, originals, target), out)

    out = func(*host_args, **host_kwargs)

    return tree_map(lambda x: _wrap_result(x, originals, target), out)


# What a chip without bfloat16 still does with bfloat16 tensors: allocate, fill, copy and convert them (views never
# reach a kernel). Anything else that reads one computes in bfloat16, which the chip's kernels lack.
_BF16_MOVES = frozenset({
    "_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "clone", "fill_", "zero_", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "lift_fresh_copy", "set_", "resize_", "detach",
    "alias", "_reshape_alias", "view", "as_strided", "t", "transpose", "permute", "expand", "select", "slice",
    "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "narrow", "_unsafe_view", "unfold", "diagonal",
    "chunk", "_local_scalar_dense", "dim", "numel", "is_contiguous", "is_strides_like_format",
    "is_non_overlapping_and_dense", "is_same_size", "_has_compatible_shallow_copy_type",
})


def _refuse_bf16(st: State, func, args: tuple, kwargs: dict) -> None:  # noqa: ANN001
    if _returns_view_of(func):
        return
    if any(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 for x in tree_flatten((args, kwargs))[0]):
        raise RuntimeError(
            f"{func}: {st.chip.soc_version} ({st.chip.family}) has no bfloat16 kernels; torch_npu computes in "
            "bfloat16 from the Ascend910B1 on (simulated chip, torchport.testing)"
        )


_views: dict[Any, bool] = {}


def _returns_view_of(func) -> bool:  # noqa: ANN001
    known = _views.get(func)
    if known is None:
        known = _views[func] = any(r.alias_info is not None and not r.alias_info.is_write
                                   for r in func._schema.returns)
    return known


def _wrap_result(x: Any, originals: dict[int, torch.Tensor], target: int | None) -> Any:
    if isinstance(x, torch.Tensor):
        if id(x) in originals:  # in-place ops return their input: give back the caller's tensor
            return originals[id(x)]
        if target is not None and not isinstance(x, SimulatedTensor) and x.device.type == "cpu":
            return SimulatedTensor(x, target)
    return x


def _with_device_rng(generator: torch.Generator, func, args: tuple, kwargs: dict) -> Any:  # noqa: ANN001
    host = torch.random.default_generator
    saved = host.get_state()
    host.set_state(generator.get_state())
    try:
        return func(*args, **kwargs)
    finally:
        generator.set_state(host.get_state())
        host.set_state(saved)


_generator_ops: dict[Any, bool] = {}


def _takes_generator(func) -> bool:  # noqa: ANN001
    known = _generator_ops.get(func)
    if known is None:
        known = _generator_ops[func] = any(arg.name == "generator" for arg in func._schema.arguments)
    return known


def _factory_fallback(op, *args, **kwargs):  # noqa: ANN001
    """PrivateUse1 kernel for ops whose inputs hold no simulated tensor (factories: empty, zeros, arange...)."""
    st = state()
    qualified = op.name()
    if qualified in st.missing:
        on_missing(st, qualified)
    return _run_on_host(op, args, kwargs, dispatched=True)


# The kernels torchport.compat.cpu_fallback registers on PrivateUse1 run in place of the simulation's own, as they
# would in place of torch_npu's. Asking the dispatcher itself would cost 14 us per operator (more than CPU's add);
# the fallback's registry answers in a dictionary lookup.
_PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)


def _host(x: torch.Tensor) -> torch.Tensor:
    return x._raw if isinstance(x, SimulatedTensor) else x


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """Copy between host and device, reached from C++ paths that skip Python dispatch (``torch.tensor(...)``)."""
    _host(dst).copy_(_host(src))
    return dst


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    _host(dst).resize_(src.shape).copy_(_host(src))
    return dst


def register() -> list[torch.library.Library]:
    """Register the PrivateUse1 kernels of the simulated NPU (the factory fallback, the host-device copies) and
    torch.save's and torch.load's handling of its tensors; returns the libraries, which must stay alive."""
    torch.serialization.add_safe_globals([_rebuild])  # torch.load(weights_only=True) of simulated tensors
    torch.serialization.register_package(5, _tag_storage, _restore_storage)  # before cpu's (10)
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_factory_fallback, "PrivateUse1")
    copies = torch.library.Library("aten", "IMPL")
    copies.impl("_copy_from", _copy_from, "PrivateUse1")
    copies.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
    return [fallback, copies]
