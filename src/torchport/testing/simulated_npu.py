"""A simulated Ascend NPU: tensors whose ``device.type`` is ``"npu"`` and whose arithmetic runs on the host.

It registers PyTorch's PrivateUse1 backend under the name ``npu`` (as torch_npu does) and installs a ``torch.npu``
module with torch_npu's public API (see :mod:`torchport.testing.npu_module`). Tensors are wrapper subclasses that
hold a CPU tensor; one ``__torch_dispatch__`` unwraps the arguments, runs the op on the CPU and wraps the results,
and one PrivateUse1 fallback does the same for factory functions (``torch.zeros(..., device="npu")``), so no op
is registered one by one.

What it keeps faithful, because code under test depends on it:

- devices mix like on a real accelerator: an op on an ``npu`` tensor and a host tensor of one or more dimensions
  raises "Expected all tensors to be on the same device"; copies, ``.to()`` and indexing with host indices work;
- memory counters count the bytes of live simulated storages (views share), with a caching-allocator model
  (freed bytes stay reserved until ``empty_cache``), peaks, and an out-of-memory error past the device's size;
- each device has its own random generator, seeded by ``torch.manual_seed`` and ``torch.npu.manual_seed``;
- ``torch.autocast("npu")`` casts like CUDA's autocast (matmul-like ops to the low dtype; reductions, norms and
  losses to float32; mixed-dtype ops to the widest).
- operators can be declared missing (:func:`torchport.testing.unsupported_ops`): running one then fails as
  PyTorch's dispatcher fails for a device without a kernel ("Could not run 'aten::erfinv' with arguments from the
  'PrivateUse1' backend..."), or, with ``torch_npu_fallback=True``, runs on the host after torch_npu's warning, as
  torch_npu's own CPU fallback does (and fails, as torch_npu's does, when ``TORCH_NPU_FALLBACK_CPU_DISABLE`` is a
  non-zero integer); the npu backend's ``has_kernel`` and ``op_support`` agree with that, and a kernel registered
  for the operator on PrivateUse1 (:func:`torchport.compat.cpu_fallback`) runs instead, as the real dispatcher
  would run it.
- the device is one Ascend chip (:class:`torchport.backends.npu.ChipProfile`, Ascend910B3 unless
  ``TORCHPORT_SIMULATE=npu:<soc>`` or :func:`torchport.testing.simulated_chip` says otherwise): its name, cores and
  memory are what ``torch.npu`` reports; on a chip without bfloat16 (Ascend910A, Ascend310P) an operator computing
  on bfloat16 tensors fails (copies and views of them work), and a torch_npu fused operator the chip lacks fails
  when called (:mod:`torchport.testing.npu_fused_ops`).

Limits, all from PyTorch's Python backend mechanism: backward runs on ``npu:0`` only (the autograd engine sizes its
device queues from a C++ device guard that reports one device), ``torch.Generator("npu")`` cannot be made
(PrivateUse1 generators need a C++ hook), so :func:`torchport.generator` hands out a host generator for it, and
under a ``TorchDispatchMode`` ``torch.tensor(data, device="npu")`` fails an internal assertion of PyTorch's
trampoline for Python-registered kernels (seen with torch 2.13; ``.to("npu")`` works).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..backends.npu import ChipProfile, chip_profile

__all__ = ["SimulatedTensor", "activate", "declare_unsupported", "is_active", "state", "use_chip"]

_NPU = "npu"
GiB = 1024**3
_BLOCK = 512  # the caching allocator's rounding, as in CUDA's and torch_npu's allocators

# Ops that may take host tensors next to device tensors, as on CUDA: copies between devices and indexing with
# host index tensors.
_MIXING_ALLOWED = {
    "_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "index", "index_put_", "_index_put_impl_",
    "index_put", "set_", "lift_fresh", "lift_fresh_copy", "alias",
}


@dataclasses.dataclass
class _DeviceMemory:
    total: int
    allocated: int = 0
    peak_allocated: int = 0
    reserved: int = 0
    peak_reserved: int = 0
    cached: int = 0
    alloc_count: int = 0
    free_count: int = 0


class _State:
    def __init__(self, device_count: int, total_memory: int, chip: ChipProfile) -> None:
        self.device_count = device_count
        self.chip = chip
        self.memory = [_DeviceMemory(total_memory) for _ in range(device_count)]
        self.generators = [torch.Generator() for _ in range(device_count)]
        self.initial_seeds = [g.initial_seed() for g in self.generators]
        self.memory_fraction = [1.0] * device_count
        self.storages: dict[tuple[int, int], list[int]] = {}  # (device, data_ptr) -> [wrapper count, bytes]
        self.lock = threading.RLock()
        self.local = threading.local()
        # operators declared missing: one (overloads, torch_npu_fallback) entry per active declaration
        self.declarations: list[tuple[frozenset[str], bool]] = []
        self.missing: frozenset[str] = frozenset()  # "aten::add.Tensor", "aten::erfinv" (the default overload)
        self.host_fallback = False
        self.support: dict[str, str | None] = {}  # operator -> op_support answer, for the declarations in force
        self.fallback_warned: set[str] = set()

    def redeclare(self) -> None:
        with self.lock:
            self.missing = frozenset().union(*(d[0] for d in self.declarations))
            self.host_fallback = self.declarations[-1][1] if self.declarations else False
            self.support.clear()

    # -- current device (per thread, as on CUDA and torch_npu) --------------------------------------------------
    @property
    def current(self) -> int:
        return getattr(self.local, "index", 0)

    @current.setter
    def current(self, index: int) -> None:
        self.local.index = index

    def check_index(self, index: int) -> int:
        if not 0 <= index < self.device_count:
            raise RuntimeError(
                f"Invalid device npu:{index}: the simulated NPU has {self.device_count} device(s), "
                f"indices 0 to {self.device_count - 1}"
            )
        return index

    def resolve(self, device: torch.device | str | int | None) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return self.check_index(device)
        device = torch.device(device)
        if device.type != _NPU:
            raise ValueError(f"expected an npu device, got {device}")
        return self.current if device.index is None else self.check_index(device.index)

    # -- memory accounting --------------------------------------------------------------------------------------
    def track(self, wrapper: SimulatedTensor, index: int) -> None:
        storage = wrapper._raw.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        key = (index, storage.data_ptr())
        with self.lock:
            entry = self.storages.get(key)
            if entry is None:
                self._allocate(index, nbytes)
                entry = self.storages[key] = [0, nbytes]
            entry[0] += 1
        weakref.finalize(wrapper, self._release, key)

    def _allocate(self, index: int, nbytes: int) -> None:
        mem = self.memory[index]
        rounded = -(-nbytes // _BLOCK) * _BLOCK
        from_cache = min(mem.cached, rounded)
        grow = rounded - from_cache
        limit = int(mem.total * self.memory_fraction[index])
        if mem.reserved + grow > limit:
            raise torch.OutOfMemoryError(
                f"NPU out of memory (simulated). Tried to allocate {nbytes / 2**20:.2f} MiB on npu:{index} "
                f"({mem.total / GiB:.2f} GiB total; {mem.allocated / GiB:.2f} GiB already allocated; "
                f"{mem.reserved / GiB:.2f} GiB reserved in total; limit {limit / GiB:.2f} GiB)"
            )
        mem.cached -= from_cache
        mem.reserved += grow
        mem.allocated += nbytes
        mem.alloc_count += 1
        mem.peak_allocated = max(mem.peak_allocated, mem.allocated)
        mem.peak_reserved = max(mem.peak_reserved, mem.reserved)

    def _release(self, key: tuple[int, int]) -> None:
        with self.lock:
            entry = self.storages.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] > 0:
                return
            del self.storages[key]
            mem = self.memory[key[0]]
            mem.allocated -= entry[1]
            mem.cached += -(-entry[1] // _BLOCK) * _BLOCK
            mem.free_count += 1


_state: _State | None = None
_activate_lock = threading.Lock()


def state() -> _State:
    if _state is None:
        raise RuntimeError("the simulated NPU is not active; call torchport.testing.simulate_npu() first")
    return _state


def is_active() -> bool:
    """Whether this process runs the simulated NPU."""
    return _state is not None


class SimulatedTensor(torch.Tensor):
    """A tensor on the simulated ``npu`` device; its data is the CPU tensor ``_raw``."""

    _raw: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, raw: torch.Tensor, index: int) -> SimulatedTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, raw.size(), strides=raw.stride(), storage_offset=raw.storage_offset(), dtype=raw.dtype,
            layout=raw.layout, device=torch.device(_NPU, index), requires_grad=raw.requires_grad,
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
    if _state is None or storage.device.type != "cpu" or storage.nbytes() == 0:
        return None
    pointer = storage.data_ptr()
    with _state.lock:
        return next((f"npu:{index}" for index, ptr in _state.storages if ptr == pointer), None)


def _restore_storage(storage: Any, location: str) -> Any:
    """torch.load's restore of a storage: stays in host memory; _rebuild wraps it according to ``location``."""
    if _state is None or not location.startswith(("npu", "cpu")):
        return None
    where = "cpu" if location.startswith("cpu") else f"npu:{_state.resolve(location)}"
    if storage.nbytes():
        _restored[storage.data_ptr()] = where
    return storage


def _run_on_host(func, args: tuple, kwargs: dict, dispatched: bool = False) -> Any:  # noqa: ANN001
    st = state()
    if not dispatched:  # reached through __torch_dispatch__, above the PrivateUse1 key: act as the dispatcher would
        qualified = func.name()
        fallback = sys.modules.get("torchport.compat.cpu_fallback")
        if fallback is not None and qualified in fallback.registered(_NPU):
            return func.redispatch(_PRIVATEUSE1, *fallback.numbers_as_tensors(func, args), **kwargs)
        if qualified in st.missing:
            _unsupported(st, qualified)
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
        if requested.type == _NPU:
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


def _refuse_bf16(st: _State, func, args: tuple, kwargs: dict) -> None:  # noqa: ANN001
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
        _unsupported(st, qualified)
    return _run_on_host(op, args, kwargs, dispatched=True)


# The kernels torchport.compat.cpu_fallback registers on PrivateUse1 run in place of the simulation's own, as they
# would in place of torch_npu's. Asking the dispatcher itself would cost 14 us per operator (more than CPU's add);
# the fallback's registry answers in a dictionary lookup.
_PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
# Operators the simulation needs to move tensors and allocate: declaring them missing would stop it working.
_PRIMITIVES = frozenset({
    "aten::empty", "aten::empty_strided", "aten::_to_copy", "aten::copy_", "aten::_copy_from",
    "aten::_copy_from_and_resize", "aten::resize_", "aten::set_", "aten::lift_fresh",
})


def _has_privateuse1_kernel(op: str) -> bool:
    # torchport's kernels pick their implementation per device themselves; a kernel of theirs registered for the
    # npu is their npu implementation, which the simulation runs as it runs every other one: on the host
    return not op.startswith("torchport::") and _dispatcher_has(op, "PrivateUse1")


def _dispatcher_has(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except RuntimeError:  # an operator the dispatcher knows by another name (aten::sym_size is aten::sym_size.int)
        return False


def _returns_view(op: str) -> bool:
    namespace, _, rest = op.partition("::")
    name, _, overload = rest.partition(".")
    schema = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")._schema
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _unsupported(st: _State, qualified: str) -> None:
    """Fail as the dispatcher does for a device without a kernel, or warn as torch_npu's CPU fallback does."""
    support = st.support.get(qualified, "unknown")
    if support == "unknown":
        from ..compile.op_support import device_op_support

        support = st.support[qualified] = device_op_support(_NPU, qualified)
    if support == "native":  # e.g. aten::erfinv when only its default overload was declared: it calls erfinv.out
        return
    if support == "host":
        if qualified not in st.fallback_warned:
            st.fallback_warned.add(qualified)
            warnings.warn(f"CAUTION: The operator '{qualified}' is not currently supported on the NPU backend and "
                          "will fall back to run on the CPU. This may have performance implications.", stacklevel=3)
        return
    backends = [key for key in ("CPU", "CUDA", "Meta") if _dispatcher_has(qualified, key)]
    if st.host_fallback and "CPU" in backends:  # torch_npu's CPU fallback exists, but the user turned it off
        raise RuntimeError(
            f"The operator '{qualified}' has no NPU kernel and would run on the CPU through torch_npu's fallback, "
            "which TORCH_NPU_FALLBACK_CPU_DISABLE turns off. (simulated by torchport.testing.unsupported_ops)"
        )
    raise NotImplementedError(
        f"Could not run '{qualified}' with arguments from the 'PrivateUse1' backend. This could be because the "
        "operator doesn't exist for this backend, or was omitted during the selective/custom build process (if "
        "using custom build). If you are a Facebook employee using PyTorch on mobile, please visit "
        f"https://fburl.com/ptmfixes for possible resolutions. '{qualified}' is only available for these backends: "
        f"[{', '.join(backends)}]. (simulated by torchport.testing.unsupported_ops)"
    )


def declare_unsupported(ops: Iterable[Any], torch_npu_fallback: bool = False) -> tuple[Any, ...]:
    """Declare operators missing on the simulated NPU; returns the token :func:`withdraw` takes.

    Raises:
        ValueError: an entry is not an operator of this torch, or one no device can lack (see
            :func:`torchport.testing.unsupported_ops`).
    """
    from ..compile.op_support import operator_overloads

    st = state()
    overloads: set[str] = set()
    for entry in ([ops] if isinstance(ops, str) else ops):
        try:
            names = operator_overloads(entry)
        except ValueError as exc:
            raise ValueError(f"unsupported operator {exc}") from None
        if any(name.partition(".")[0] in _PRIMITIVES for name in names):
            raise ValueError(f"unsupported operator {entry!r}: the simulated NPU allocates and moves tensors with "
                             "it; it cannot be declared missing")
        if any(_returns_view(name) for name in names):
            raise ValueError(f"unsupported operator {entry!r} returns a view of its input: every device has its "
                             "views (they only change sizes and strides), and no CPU fallback could alias device "
                             "memory")
        if not any(_dispatcher_has(name, "CPU") for name in names):
            raise ValueError(f"unsupported operator {entry!r}: no device has a kernel of its own for it (PyTorch "
                             "builds it from other operators, so a device cannot lack it); declare the operators it "
                             "runs, which torchport coverage lists")
        overloads.update(names)
    token = (frozenset(overloads), bool(torch_npu_fallback))
    with st.lock:
        st.declarations.append(token)
        st.redeclare()
    return token


def withdraw(token: tuple[Any, ...]) -> None:
    """Undo one :func:`declare_unsupported`."""
    st = state()
    with st.lock:
        st.declarations.remove(token)
        st.redeclare()


def _host(x: torch.Tensor) -> torch.Tensor:
    return x._raw if isinstance(x, SimulatedTensor) else x


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """Copy between host and device, reached from C++ paths that skip Python dispatch (``torch.tensor(...)``)."""
    _host(dst).copy_(_host(src))
    return dst


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    _host(dst).resize_(src.shape).copy_(_host(src))
    return dst


_libraries: list[torch.library.Library] = []


def activate(device_count: int = 1, total_memory: int | None = None, soc: str | None = None) -> None:
    """Register the simulated NPU in this process (idempotent for the same device count and chip).

    ``soc`` names the chip (:func:`torchport.backends.npu.chip_profile`; None: the one already active, else
    Ascend910B3); ``total_memory`` defaults to the chip's memory.

    Raises:
        RuntimeError: a real torch_npu is imported, PrivateUse1 is already taken by another backend, or the
            simulated NPU is already active with another device count or chip.
        ValueError: an unknown ``soc`` (the message lists the known chips).
    """
    global _state
    chip = None if soc is None else chip_profile(soc)
    with _activate_lock:
        if _state is not None:
            if _state.device_count != device_count:
                raise RuntimeError(
                    f"the simulated NPU is already active with {_state.device_count} device(s); "
                    f"asked for {device_count}. The device count is fixed for the life of the process."
                )
            if chip is not None and chip != _state.chip:
                raise RuntimeError(
                    f"the simulated NPU is already active as {_state.chip.soc_version}; asked for "
                    f"{chip.soc_version}. Tests switch chips with torchport.testing.simulated_chip()."
                )
            return
        if "torch_npu" in sys.modules:
            raise RuntimeError(
                "a real torch_npu is imported in this process, so the simulated NPU cannot start: PyTorch lets "
                "one backend take the 'npu' (PrivateUse1) name per process. Unset TORCHPORT_SIMULATE to use the "
                "real NPU."
            )
        taken = torch._C._get_privateuse1_backend_name()
        if taken != "privateuseone":
            raise RuntimeError(
                f"PrivateUse1 is already registered as {taken!r} in this process; the simulated NPU needs it"
            )
        if not 1 <= device_count <= 16:
            raise ValueError(f"device_count={device_count} is not allowed; use 1 to 16")

        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        from . import npu_module

        chip = chip or chip_profile()
        _state = _State(device_count, chip.memory_bytes if total_memory is None else total_memory, chip)
        _setup_privateuseone_for_python_backend(_NPU, backend_module=npu_module.build(_state))
        sys.modules["torch.npu"] = torch.npu
        sys.modules["torch.npu.amp"] = torch.npu.amp

        torch.serialization.add_safe_globals([_rebuild])  # torch.load(weights_only=True) of simulated tensors
        torch.serialization.register_package(5, _tag_storage, _restore_storage)  # before cpu's (10)
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(_factory_fallback, "PrivateUse1")
        copies = torch.library.Library("aten", "IMPL")
        copies.impl("_copy_from", _copy_from, "PrivateUse1")
        copies.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
        _libraries.extend([fallback, copies])
        _libraries.extend(npu_module.register_autocast())

        from ..backends import register_backend
        from ..backends.npu import NpuBackend

        @register_backend(_NPU, replace=True)
        class SimulatedNpuBackend(NpuBackend):
            """The npu backend, except for what a Python-registered device cannot do."""

            safetensors_direct = False
            pins_memory = False  # PyTorch's Python backend hooks cannot provide a pinned allocator
            profiler_activity = None

            def versions(self) -> dict[str, str | None]:
                return {"torch_npu": None, "cann": None, "simulated": "torchport.testing"}

            def new_generator(self, index: int) -> torch.Generator:
                return torch.Generator()

            def fused_op(self, name: str) -> Any:
                from . import npu_fused_ops

                return npu_fused_ops.lookup(name)

            def has_kernel(self, op: str) -> bool | None:
                # every operator with a host kernel runs, except those declared missing (torchport.testing.
                # unsupported_ops); kernels registered on PrivateUse1 count, as they do for a real device
                if _has_privateuse1_kernel(op):
                    return True
                return op not in state().missing and _dispatcher_has(op, "CPU")

            @property
            def host_fallback(self) -> bool:  # type: ignore[override]
                # declared with torch_npu_fallback=True, and not turned off by TORCH_NPU_FALLBACK_CPU_DISABLE
                return state().host_fallback and NpuBackend.host_fallback.fget(self)


def use_chip(soc: str) -> ChipProfile:
    """Make the simulated device chip ``soc`` from now on; returns the chip it was. Device memory keeps its size.

    Raises:
        ValueError: an unknown ``soc`` (the message lists the known chips).
    """
    st = state()
    chip = chip_profile(soc)
    with st.lock:
        previous, st.chip = st.chip, chip
    return previous
