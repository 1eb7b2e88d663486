"""Patches on torch's own API: every place a CUDA device can be named is mapped onto the target."""

from __future__ import annotations

import functools
from typing import Any

import torch

from .redirect import Patcher, Target, called_by_user

__all__ = ["install"]

# Factory functions that take device= but are missing from torch.utils._device._device_constructors().
_EXTRA_FACTORIES = ("zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
                    "randint_like", "normal")
_TENSOR_NEW = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided")


def _map_kwarg(target: Target, kwargs: dict[str, Any], key: str, api: str) -> None:
    if key in kwargs:
        kwargs[key] = target.map_index(kwargs[key], api)


def _factories() -> list[str]:
    from torch.utils._device import _device_constructors

    constructors = _device_constructors()
    names = [name for name in dir(torch) if not name.startswith("_") and getattr(torch, name, None) in constructors]
    return sorted({*names, *(name for name in _EXTRA_FACTORIES if hasattr(torch, name))})


def _device_kwarg(target: Target, fn: Any, api: str) -> Any:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        _map_kwarg(target, kwargs, "device", api)
        return fn(*args, **kwargs)

    return call


def _first_arg_or_device(target: Target, fn: Any, api: str) -> Any:
    """For ``to(device, ...)``-style methods: the first positional argument or ``device=``."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], (str, torch.device, int)) and not isinstance(args[0], bool):
            args = (target.map_index(args[0], api), *args[1:])
        _map_kwarg(target, kwargs, "device", api)
        return fn(self, *args, **kwargs)

    return call


# Keys of torch.compile's ``options`` that torch.compile itself takes out, whatever the backend (torch 2.13)
_COMPILE_OWN_OPTIONS = ("guard_filter_fn", "use_aoti")


def _default_compile_backend() -> Any:
    try:
        from torch._dynamo.backends.registry import get_default_backend  # torch >= 2.12 (set_default_backend)
    except ImportError:
        return "inductor"
    return get_default_backend()


def _compile(target: Target, original: Any) -> Any:
    """``torch.compile`` with Inductor (its default backend, or named) on a target Inductor generates no code for
    (:meth:`~torchport.backends.Backend.inductor_compiles`: the simulated NPU, an Ascend chip without torch_npu's NPU
    Inductor) compiles with torchport's backend, which hands each graph to the target's compiler
    (:func:`torchport.compile.torchport_backend`: TorchAir on Ascend, the captured graph where there is none).
    Inductor's ``options`` become that backend's ``inductor`` settings, torch.compile's own keys among them staying
    where torch.compile takes them; ``mode`` passes on (it applies where Inductor compiles). Another backend the
    program names, or sets as the default, is its choice and is kept."""
    redirects = functools.cache(lambda: not target.backend.inductor_compiles())  # asked at the first compile

    @functools.wraps(original)
    def call(model: Any = None, **kwargs: Any) -> Any:
        backend = kwargs.get("backend")
        if backend is None:
            backend = _default_compile_backend()
        if backend == "inductor":
            if redirects():
                from ..compile.dynamo_backend import torchport_backend

                target.recorder.record("torch.compile(backend=inductor)")
                kwargs["backend"] = torchport_backend
                options = kwargs.get("options")
                if isinstance(options, dict) and options:
                    own = {key: options[key] for key in _COMPILE_OWN_OPTIONS if key in options}
                    rest = {key: value for key, value in options.items() if key not in own}
                    kwargs["options"] = {**own, **({"inductor": rest} if rest else {})}
        return original(model, **kwargs)

    return call


def _load(target: Target, original: Any) -> Any:
    from torch.serialization import default_restore_location

    def restore(storage: Any, location: str) -> Any:
        return default_restore_location(storage, str(target.map(location)))

    @functools.wraps(original)
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if map_location is None:
            map_location = restore  # a checkpoint saved from CUDA lands on the target; host tensors stay on host
        elif isinstance(map_location, dict):
            map_location = {k: target.map(v, "torch.load") for k, v in map_location.items()}
        elif not callable(map_location):
            map_location = target.map_index(map_location, "torch.load")
        return original(f, map_location, *args, **kwargs)

    return load


def _instance_check(base: type) -> type:
    class Meta(type):
        def __instancecheck__(cls, instance: Any) -> bool:
            return isinstance(instance, base)

        def __subclasscheck__(cls, subclass: type) -> bool:
            return issubclass(subclass, base)

    return Meta


def _generator(target: Target, original: type) -> type:
    class Generator(metaclass=_instance_check(original)):
        """torch.Generator, with CUDA devices mapped onto the target."""

        def __new__(cls, device: Any = "cpu") -> Any:
            mapped = target.map_index(device, "torch.Generator")
            if mapped is device:
                return original(device)
            return target.backend.new_generator(target.index(mapped))

    return Generator


def _device_class(target: Target, original: type) -> type:
    class device(metaclass=_instance_check(original)):  # noqa: N801 - torch's name
        """torch.device, with a bare index (``torch.device(0)``: device 0 of the accelerator, which the host lacks)
        on the target; any other arguments make torch's own device."""

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and not kwargs and isinstance(args[0], int) and not isinstance(args[0], bool):
                return target.map_index(args[0], "torch.device(int)")
            return original(*args, **kwargs)

    device.__qualname__ = device.__name__ = original.__name__
    device.__module__ = original.__module__
    device.__wrapped__ = original  # type: ignore[attr-defined]  # TorchScript compiles it as torch.device (compat.jit)
    return device


def _autocast_class(target: Target, original: type) -> type:
    class autocast(original):  # noqa: N801 - torch's name
        """torch.autocast, with device_type "cuda" mapped onto the target and its dtype chosen for it."""

        api = "torch.autocast"  # the name the report counts; torch.cuda.amp.autocast subclasses this class

        def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                     cache_enabled: bool | None = None) -> None:
            if device_type == "cuda":
                target.recorder.record(self.api)
                device_type = target.type
                dtype = target.backend.autocast_dtype(dtype, target.backend.current_index())
            super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    autocast.__qualname__ = original.__qualname__
    autocast.__module__ = original.__module__
    return autocast


def scaler_enabled(target: Target) -> bool:
    """Loss scaling protects fp16 gradients; a target that autocasts CUDA's fp16 to bf16 needs none."""
    return target.backend.autocast_dtype(torch.float16, target.backend.current_index()) == torch.float16


def _grad_scaler_class(target: Target, original: type) -> type:
    class GradScaler(original):
        """torch.amp.GradScaler, with "cuda" mapped onto the target (disabled where autocast uses bf16)."""

        api = "torch.amp.GradScaler"  # the name the report counts; torch.cuda.amp.GradScaler subclasses this class

        def __init__(self, device: str = "cuda", *args: Any, enabled: bool = True, **kwargs: Any) -> None:
            if device == "cuda":
                target.recorder.record(self.api)
                device = target.type
                enabled = enabled and scaler_enabled(target)
            super().__init__(device, *args, enabled=enabled, **kwargs)

    GradScaler.__qualname__ = original.__qualname__
    GradScaler.__module__ = original.__module__
    return GradScaler


def _event_or_stream(target: Target, original: type, api: str, make: Any) -> type:
    class Wrapped(metaclass=_instance_check(original)):
        def __new__(cls, device: Any = None, *args: Any, **kwargs: Any) -> Any:
            mapped = target.map_index(device, api)
            return original(device, *args, **kwargs) if mapped is device else make(mapped, *args, **kwargs)

    Wrapped.__name__ = Wrapped.__qualname__ = original.__name__
    return Wrapped


def _distributed(target: Target, patcher: Patcher) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return

    def map_backend(name: Any) -> Any:
        if name is None and target.type == "cpu":
            # no backend named: torch picks the present accelerator's (NCCL alone on a GPU machine, whose CPU
            # tensors then have none), where the program runs on the CPU
            return target.backend.dist_backend
        if not isinstance(name, str) or "nccl" not in name:
            return name
        target.recorder.record("dist.init_process_group(nccl)")
        if ":" not in name:
            return target.backend.dist_backend
        # "cpu:gloo,cuda:nccl" -> "cpu:gloo,<type>:<backend>" (on the CPU target the cpu entry stands alone)
        parts = [part for part in name.split(",") if not part.startswith("cuda:")]
        if target.type != "cpu":
            parts.append(f"{target.type}:{target.backend.dist_backend}")
        return ",".join(parts)

    def init_process_group(original: Any) -> Any:
        @functools.wraps(original)
        def call(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
            backend = map_backend(kwargs.pop("backend", backend))
            if "device_id" in kwargs:
                device_id = target.map_index(kwargs["device_id"], "dist.init_process_group(device_id)")
                kwargs["device_id"] = None if target.type == "cpu" else device_id
            return original(backend, *args, **kwargs)

        return call

    patcher.wrap(dist, "init_process_group", init_process_group)
    # the modules that bound the function at their import (a device mesh starts the default group itself)
    from torch.distributed import distributed_c10d

    patcher.wrap(distributed_c10d, "init_process_group", init_process_group)
    try:
        from torch.distributed import device_mesh
    except ImportError:  # a torch built without distributed support
        pass
    else:
        patcher.wrap(device_mesh, "init_process_group", init_process_group)

    from torch.nn.parallel import DistributedDataParallel

    original_init = DistributedDataParallel.__init__

    @functools.wraps(original_init)
    def ddp_init(self: Any, module: Any, device_ids: Any = None, output_device: Any = None, *args: Any,
                 **kwargs: Any) -> None:
        if device_ids is not None or output_device is not None:
            target.recorder.record("DistributedDataParallel(device_ids)")
            if target.type == "cpu":  # DDP of a CPU module takes no device ids
                device_ids = output_device = None
            else:
                device_ids = [target.map_index(d) for d in device_ids] if device_ids is not None else None
                output_device = target.map_index(output_device) if output_device is not None else None
        original_init(self, module, device_ids, output_device, *args, **kwargs)

    patcher.set(DistributedDataParallel, "__init__", ddp_init)
    _device_mesh(target, patcher)


def _device_mesh(target: Target, patcher: Patcher) -> None:
    """``init_device_mesh("cuda", ...)`` and ``DeviceMesh("cuda", ...)`` build the mesh on the target's device type,
    so DTensor, which asks the mesh's device module (random operators divide by its device count), runs there."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch built without distributed support
        return
    original_init = DeviceMesh.__init__

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if "device_type" in kwargs:
            kwargs["device_type"] = target.map(kwargs["device_type"], "DeviceMesh(cuda)")
        elif args:
            args = (target.map(args[0], "DeviceMesh(cuda)"), *args[1:])
        original_init(self, *args, **kwargs)

    patcher.set(DeviceMesh, "__init__", init)


def _data_parallel(target: Target, patcher: Patcher) -> None:
    """DataParallel scatters through CUDA-only kernels even for one device: elsewhere the module runs directly on
    the target (DataParallel with no device ids does exactly that)."""
    from torch.nn import DataParallel

    original_init = DataParallel.__init__

    @functools.wraps(original_init)
    def init(self: Any, module: Any, device_ids: Any = None, output_device: Any = None, dim: int = 0) -> None:
        torch.nn.Module.__init__(self)
        self.module, self.device_ids, self.dim = module, [], dim
        first = device_ids[0] if device_ids else None
        self.module.to(target.device(None if first is None else target.index(first)))
        target.recorder.record("DataParallel")
        if target.recorder.counts["DataParallel"] == 1:
            target.recorder.find("DataParallel", f"runs on one {target.type} device here; use "
                                 "DistributedDataParallel (torchrun) to train on several")

    patcher.set(DataParallel, "__init__", init)


def _profiler(target: Target, patcher: Patcher) -> None:
    import torch.profiler

    cuda = torch.profiler.ProfilerActivity.CUDA
    replacement = getattr(torch.profiler.ProfilerActivity, target.backend.profiler_activity or "", None)
    original_init = torch.profiler.profile.__init__

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, activities: Any = None, **kwargs: Any) -> None:
        if activities is not None and cuda in activities:
            target.recorder.record("torch.profiler(ProfilerActivity.CUDA)")
            activities = [a for a in activities if a != cuda] + ([replacement] if replacement is not None else [])
            activities = list(dict.fromkeys(activities)) or [torch.profiler.ProfilerActivity.CPU]
        original_init(self, *args, activities=activities, **kwargs)

    patcher.set(torch.profiler.profile, "__init__", init)


def install(target: Target, patcher: Patcher, make_event: Any, make_stream: Any) -> None:
    """Patch torch's public API so that CUDA device names land on ``target``.

    ``make_event(device, **kwargs)`` and ``make_stream(device, **kwargs)`` build the target's event and stream.
    """
    for name in _factories():
        patcher.wrap(torch, name, lambda fn, name=name: _device_kwarg(target, fn, f"torch.{name}(device=cuda)"))
    patcher.wrap(torch, "load", lambda fn: _load(target, fn))
    patcher.wrap(torch, "Generator", lambda cls: _generator(target, cls))
    if target.host:  # an accelerator's own torch.device(0) is already its device 0
        patcher.wrap(torch, "device", lambda cls: _device_class(target, cls))

    tensor, module = torch.Tensor, torch.nn.Module
    patcher.wrap(tensor, "to", lambda fn: _first_arg_or_device(target, fn, "Tensor.to(cuda)"))
    for name in _TENSOR_NEW:
        patcher.wrap(tensor, name, lambda fn, name=name: _device_kwarg(target, fn, f"Tensor.{name}(device=cuda)"))
    patcher.wrap(module, "to", lambda fn: _first_arg_or_device(target, fn, "Module.to(cuda)"))
    patcher.wrap(module, "to_empty", lambda fn: _device_kwarg(target, fn, "Module.to_empty(device=cuda)"))

    def tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        target.recorder.record("Tensor.cuda")
        return self.to(target.device(None if device is None else target.index(device)), non_blocking=non_blocking,
                       **kwargs)

    def module_cuda(self: torch.nn.Module, device: Any = None) -> Any:
        target.recorder.record("Module.cuda")
        return self.to(target.device(None if device is None else target.index(device)))

    patcher.set(tensor, "cuda", tensor_cuda)
    patcher.set(module, "cuda", module_cuda)

    original_is_cuda = torch._C.TensorBase.is_cuda

    def is_cuda(self: torch.Tensor) -> bool:
        if called_by_user():
            target.recorder.record("Tensor.is_cuda")
            return self.device.type == target.type
        return original_is_cuda.__get__(self)

    patcher.set(tensor, "is_cuda", property(is_cuda))

    original_pin = tensor.pin_memory

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        if not target.backend.pins_memory:
            target.recorder.record("Tensor.pin_memory")
            return self  # nothing to pin for: the target computes from host memory
        return original_pin(self) if device is None else original_pin(self, target.map_index(device))

    patcher.set(tensor, "pin_memory", pin_memory)

    autocast = _autocast_class(target, torch.amp.autocast)
    patcher.set(torch.amp, "autocast", autocast)
    patcher.set(torch, "autocast", autocast)
    patcher.set(torch.amp.autocast_mode, "autocast", autocast)
    patcher.set(torch.amp, "GradScaler", _grad_scaler_class(target, torch.amp.GradScaler))
    patcher.wrap(torch, "Event", lambda cls: _event_or_stream(target, cls, "torch.Event", make_event))
    patcher.wrap(torch, "Stream", lambda cls: _event_or_stream(target, cls, "torch.Stream", make_stream))
    _distributed(target, patcher)
    _data_parallel(target, patcher)
    _profiler(target, patcher)
    patcher.wrap(torch, "compile", lambda fn: _compile(target, fn))
