"""``torch.cuda.*`` answered by the target's backend, so CUDA-written code queries the device it really runs on."""

from __future__ import annotations

import contextlib
import functools
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .redirect import Patcher, Target, asked_for_user, asked_outside_inductor, called_by_user

__all__ = ["DeviceProperties", "HostEvent", "HostStream", "install", "make_event", "make_stream"]


class HostEvent:
    """A CUDA-event stand-in for targets without events: host work is synchronous, so the host clock times it."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: HostEvent) -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._time - self._time) * 1e3


class HostStream:
    """A CUDA-stream stand-in for targets without streams: work runs in order on the host."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.priority = priority

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        event = event or HostEvent()
        event.record()
        return event


_HOST_STREAM = HostStream()


class DeviceProperties:
    """What CUDA code reads from ``get_device_properties()``, for targets whose vendor object lacks it or leaves it
    unset: ``name``, ``total_memory``, integer ``major``/``minor`` (the capability the shim's
    ``get_device_capability`` answers: 8.0 where bfloat16 works, else 7.0) and ``multi_processor_count`` (the
    compute units a persistent grid spreads over; on Ascend the vector cores). Every other attribute is the vendor
    object's (``cube_core_num``, ``L2_cache_size``... on Ascend).

    torch_npu's properties (``_NPUDeviceProperties``, Ascend/pytorch ``torch_npu/csrc/npu/Module.cpp`` at master
    9e73e708, v2.6.0-7.3.0 0db038ca, v2.9.0-26.1.0 323a8176) declare ``major`` and ``minor`` but never set them, so
    they read None and ``props.major >= 8`` raises TypeError; ``multi_processor_count`` is None on the 7.3.0
    releases too.
    """

    __slots__ = ("_vendor", "name", "total_memory", "major", "minor", "multi_processor_count")

    def __init__(self, vendor: Any, name: str, total_memory: int, major: int, minor: int,
                 multi_processor_count: int) -> None:
        self._vendor = vendor
        self.name, self.total_memory = name, total_memory
        self.major, self.minor, self.multi_processor_count = major, minor, multi_processor_count

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or self._vendor is None:
            raise AttributeError(f"device properties have no attribute {name!r}")
        return getattr(self._vendor, name)

    def __repr__(self) -> str:
        return (f"DeviceProperties(name={self.name!r}, total_memory={self.total_memory}, major={self.major}, "
                f"minor={self.minor}, multi_processor_count={self.multi_processor_count})")


def _cuda_like(props: Any) -> bool:
    """Whether a vendor's properties already answer what CUDA code reads, as integers (CUDA's, ROCm's)."""
    return all(isinstance(getattr(props, field, None), int) for field in ("major", "minor", "multi_processor_count"))


def make_event(target: Target, device: Any = None, enable_timing: bool = False, **kwargs: Any) -> Any:
    event = target.backend.event(enable_timing=enable_timing)
    return event if event is not None else HostEvent(enable_timing)


def make_stream(target: Target, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:
    stream = target.backend.stream(target.index(device))
    return stream if stream is not None else HostStream(priority=priority)


def _vendor_type(module: Any, name: str) -> tuple[type, ...]:
    found = getattr(module, name, None) if module is not None else None
    return (found,) if isinstance(found, type) else ()


def _factory_type(name: str, make: Any, kinds: tuple[type, ...], on_call: Any) -> type:
    """A class standing for ``torch.cuda.<name>``: calling it returns ``make(...)``'s object, and ``isinstance``
    accepts the objects the target produces (``kinds``)."""

    class _Kind(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, kinds)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, kinds)

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        on_call()
        return make(*args, **kwargs)

    return _Kind(name, (), {"__new__": __new__, "__module__": "torch.cuda",
                            "__doc__": f"torch.cuda.{name}, made on the device the program runs on."})


def _memory(target: Target, key: str, host_key: str) -> Any:
    def read(device: Any = None) -> int:
        stats = target.backend.memory_stats(target.index(device))
        value = stats.get(key)
        return int(value if value is not None else stats.get(host_key) or 0)  # CPU: the process's resident set

    return read


def _ranks_sharing(target: Target) -> int:
    """How many processes of one launch share the host target: LOCAL_WORLD_SIZE under torchrun, else 1.

    Each rank of ``torchrun --nproc-per-node N`` runs on the one host, so a program that checks it has a device per
    rank (``if torch.cuda.device_count() < 2: sys.exit(...)``) is told there are N."""
    if not target.host:
        return 0
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:  # not a number: no launcher of ours set it
        return 1


def install(target: Target, patcher: Patcher) -> None:  # noqa: C901 - one small function per torch.cuda name
    """Replace the ``torch.cuda`` functions that CUDA-written programs call by ones that ask ``target``."""
    backend, cuda, record = target.backend, torch.cuda, target.recorder.record

    def redirect(name: str, fn: Any) -> None:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            record(f"torch.cuda.{name}")
            return fn(*args, **kwargs)

        patcher.set(cuda, name, call)

    def for_user(name: str, redirected: Any, asks: Callable[[], bool] = called_by_user) -> None:
        """The program gets the target's answer; torch and other libraries keep CUDA's own (see called_by_user)."""
        original = getattr(cuda, name)

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if asks():
                record(f"torch.cuda.{name}")
                return redirected(*args, **kwargs)
            return original(*args, **kwargs)

        patcher.set(cuda, name, call)

    # "Is there CUDA, and how much?" is also answered to a library checking a "cuda" the program handed it
    for_user("is_available", backend.is_available, asked_for_user)
    for_user("device_count", lambda: max(backend.device_count(), _ranks_sharing(target)), asked_for_user)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all (lazily queued when CUDA is absent)
    for_user("manual_seed", backend.manual_seed_all)
    for_user("manual_seed_all", backend.manual_seed_all)
    for_user("current_device", backend.current_index, asked_outside_inductor)  # Inductor: see get_device_properties
    # On the host every CUDA index means the one CPU (torchrun ranks call set_device(LOCAL_RANK)).
    redirect("set_device", lambda device: None if target.host else backend.set_index(target.index(device)))
    redirect("synchronize", lambda device=None: backend.synchronize(target.index(device)))
    redirect("empty_cache", backend.empty_cache)
    redirect("reset_peak_memory_stats", lambda device=None: backend.reset_peak_memory_stats(target.index(device)))
    redirect("reset_max_memory_allocated", lambda device=None: backend.reset_peak_memory_stats(target.index(device)))
    redirect("memory_allocated", _memory(target, "allocated", "process_rss"))
    redirect("memory_reserved", _memory(target, "reserved", "process_rss"))
    redirect("max_memory_allocated", _memory(target, "peak_allocated", "process_peak_rss"))
    redirect("max_memory_reserved", _memory(target, "peak_reserved", "process_peak_rss"))
    redirect("mem_get_info", lambda device=None: backend.mem_get_info(target.index(device)) or (0, 0))
    redirect("get_device_name", lambda device=None: backend.device_name(target.index(device)))
    redirect("is_bf16_supported",
             lambda *a, **k: backend.dtype_works(torch.bfloat16, backend.current_index()))
    # torch's lazy CUDA calls (seeding) consult is_initialized: only the program is told the target is ready
    for_user("is_initialized", lambda: True)
    for_user("init", lambda: None)

    def get_device_properties(device: Any = None) -> Any:
        index = target.index(device)
        vendor = getattr(backend.module(), "get_device_properties", None) if not target.host else None
        props = vendor(index) if vendor is not None else None
        if props is not None and _cuda_like(props):
            return props
        info = backend.properties(index)  # the backend fills multi_processor_count where the vendor leaves it unset
        major, minor = get_device_capability(index)
        cores = int(info.get("multi_processor_count") or info.get("logical_cores") or 1)
        return DeviceProperties(props, str(info.get("name") or backend.device_name(index)),
                                int(info.get("total_memory") or 0), major, minor, cores)

    def get_device_capability(device: Any = None) -> tuple[int, int]:
        vendor = getattr(backend.module(), "get_device_capability", None) if not target.host else None
        if vendor is not None:
            # torch_npu answers TORCH_NPU_DEVICE_CAPABILITY=major.minor where it is set, else None, warning on every
            # call that an NPU has no CUDA capability: the answer below is the shim's, so its warning is not shown
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                answer = vendor(target.index(device))
                if isinstance(answer, tuple) and len(answer) == 2 and all(isinstance(v, int) for v in answer):
                    return answer
        # No CUDA compute capability here: the generation whose features CUDA code tests for with "major >= 8"
        # (bfloat16, TF32-class matmuls) where the device computes in bfloat16, else 7.0 (fp16 matrix units, no
        # bfloat16): Ascend 910B/910_93 answer 8.0, Ascend 910A and 310P 7.0. Never 9.0, so FP8 paths stay off.
        return (8, 0) if backend.dtype_works(torch.bfloat16, target.index(device)) else (7, 0)

    for_user("get_device_properties", get_device_properties, asked_outside_inductor)
    for_user("get_device_capability", get_device_capability, asked_outside_inductor)

    # Programs and libraries also use these two as types (isinstance, ``torch.cuda.Stream | None`` annotations):
    # they stay classes, whose construction returns the target's object.
    vendor = target.backend.module() if not target.host else None
    patcher.set(cuda, "Event", _factory_type(
        "Event", lambda enable_timing=False, blocking=False, interprocess=False: make_event(
            target, enable_timing=enable_timing),
        (HostEvent, *_vendor_type(vendor, "Event")), lambda: record("torch.cuda.Event")))
    patcher.set(cuda, "Stream", _factory_type(
        "Stream", lambda device=None, priority=0, **kwargs: make_stream(target, device, priority),
        (HostStream, *_vendor_type(vendor, "Stream")), lambda: record("torch.cuda.Stream")))

    def current_stream(device: Any = None) -> Any:
        return backend.current_stream(target.index(device)) or _HOST_STREAM

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        module_stream = getattr(backend.module(), "stream", None) if not isinstance(s, HostStream) else None
        if s is None or module_stream is None:
            yield
        else:
            with module_stream(s):
                yield

    @contextlib.contextmanager
    def device_context(device: Any) -> Iterator[None]:
        if target.host:
            yield
            return
        previous = backend.current_index()
        index = target.index(device) if device is not None and device != -1 else previous
        backend.set_index(index)
        try:
            yield
        finally:
            backend.set_index(previous)

    redirect("current_stream", current_stream)
    redirect("default_stream", current_stream)
    redirect("stream", stream)
    redirect("device", device_context)

    # Subclasses of the torch.amp classes that torch_api.install (run first) put in place: one mapping, and code
    # that subclasses or isinstance-checks torch.cuda.amp's classes keeps working.
    class CudaAutocast(torch.amp.autocast):
        api = "torch.cuda.amp.autocast"

        def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True):
            super().__init__("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    class CudaGradScaler(torch.amp.GradScaler):
        api = "torch.cuda.amp.GradScaler"

        def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                     growth_interval: int = 2000, enabled: bool = True) -> None:
            super().__init__("cuda", init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)

    for name, cls in (("autocast", CudaAutocast), ("GradScaler", CudaGradScaler)):
        cls.__name__ = cls.__qualname__ = name
        patcher.set(cuda.amp, name, cls)

    # NVTX ranges are annotations for NVIDIA's profilers: on other targets they mean nothing.
    @contextlib.contextmanager
    def nvtx_range(*args: Any, **kwargs: Any) -> Iterator[None]:
        record("torch.cuda.nvtx")
        yield

    for name, fn in (("range_push", lambda *a, **k: 0), ("range_pop", lambda *a, **k: 0), ("mark", lambda *a, **k: None),
                     ("range_start", lambda *a, **k: 0), ("range_end", lambda *a, **k: None), ("range", nvtx_range)):
        patcher.wrap(cuda.nvtx, name, lambda _, fn=fn: fn)
