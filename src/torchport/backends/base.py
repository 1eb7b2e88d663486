"""What every device backend answers, with the generic answer built on ``torch.get_device_module``.

A backend subclass overrides only what its device does differently. The generic answers call the device module
(``torch.cuda``, ``torch.npu``, ``torch.xpu``...), which every vendor implements with the same names; that also
covers devices registered from Python through PrivateUse1, for which ``torch.accelerator``'s memory and
synchronize functions refuse to run ("Allocator for npu is not a DeviceAllocator").
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .. import _settings
from .dtype_probe import PROBED_DTYPES, DtypeProbe, probe

__all__ = ["Backend", "DtypeProbe", "PROBED_DTYPES"]

class Backend:
    """One device type. Instances are made and cached by the registry (``torchport.backends.get_backend``)."""

    name: ClassVar[str]
    #: torch.distributed backend for this device type.
    dist_backend: ClassVar[str] = "gloo"
    #: Environment variable that restricts which devices a process sees.
    visible_devices_variable: ClassVar[str | None] = None
    #: Whether ``safetensors.torch.load_file(..., device=...)`` can place tensors on this device directly.
    safetensors_direct: ClassVar[bool] = False
    #: Whether host tensors can be pinned for fast, asynchronous copies to this device.
    pins_memory: ClassVar[bool] = True
    #: Name of the ``torch.profiler.ProfilerActivity`` that records this device's kernels, or None.
    profiler_activity: ClassVar[str | None] = None

    def __init__(self) -> None:
        self._probes: dict[int, dict[torch.dtype, DtypeProbe]] = {}
        self._probe_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<torchport backend {self.name!r}>"

    # -- presence ------------------------------------------------------------------------------------------------
    def module(self) -> types.ModuleType:
        """The ``torch.<type>`` device module, importing the vendor extension if needed."""
        return torch.get_device_module(self.name)

    def is_available(self) -> bool:
        """Whether at least one device of this type can be used by this process."""
        try:
            return bool(self.module().is_available())
        except (RuntimeError, ImportError, AttributeError):
            return False

    def device_count(self) -> int:
        return int(self.module().device_count()) if self.is_available() else 0

    def unavailable_reason(self) -> str:
        """Why no device of this type can be used, and what to do about it."""
        variable = self.visible_devices_variable
        if variable and variable in os.environ:
            return f"none is visible ({variable}={os.environ[variable]!r})"
        return f"this torch build or machine has no {self.name} device"

    def current_index(self) -> int:
        return int(self.module().current_device())

    def set_index(self, index: int) -> None:
        self.module().set_device(index)

    def device(self, index: int) -> torch.device:
        return torch.device(self.name, index)

    # -- description ---------------------------------------------------------------------------------------------
    def device_name(self, index: int) -> str:
        return str(self.module().get_device_name(index))

    def properties(self, index: int) -> dict[str, Any]:
        """Every public plain-valued attribute of the vendor's device-properties object."""
        props = self.module().get_device_properties(index)
        out: dict[str, Any] = {}
        for key in dir(props):
            if key.startswith("_"):
                continue
            try:
                value = getattr(props, key)
            except Exception:  # some vendor properties raise when the field is not supported
                continue
            if isinstance(value, (bool, int, float, str)):
                out[key] = value
            elif isinstance(value, tuple) and all(isinstance(v, (int, float, str)) for v in value):
                out[key] = list(value)
        return out

    def versions(self) -> dict[str, str | None]:
        """Vendor software versions (runtime, driver, extension), None where not readable."""
        return {}

    # -- memory --------------------------------------------------------------------------------------------------
    def mem_get_info(self, index: int) -> tuple[int, int] | None:
        """(free, total) bytes of device memory, or None when the device does not say."""
        free, total = self.module().mem_get_info(index)
        return int(free), int(total)

    def memory_stats(self, index: int) -> dict[str, int | None]:
        """Bytes held by tensors (allocated), by the caching allocator (reserved), and their peaks."""
        m = self.module()
        return {
            "allocated": int(m.memory_allocated(index)),
            "reserved": int(m.memory_reserved(index)),
            "peak_allocated": int(m.max_memory_allocated(index)),
            "peak_reserved": int(m.max_memory_reserved(index)),
        }

    def reset_peak_memory_stats(self, index: int) -> None:
        self.module().reset_peak_memory_stats(index)

    def empty_cache(self) -> None:
        self.module().empty_cache()

    def utilization(self, index: int) -> float | None:
        """Percent of the last sample period in which the device ran work, or None where the device (or the
        software installed for it) does not report it. Here: None."""
        return None

    # -- execution -----------------------------------------------------------------------------------------------
    def synchronize(self, index: int) -> None:
        self.module().synchronize(index)

    def manual_seed_all(self, seed: int) -> None:
        self.module().manual_seed_all(seed)

    def new_generator(self, index: int) -> torch.Generator:
        """An unseeded random generator whose numbers are drawn for this device."""
        return torch.Generator(device=self.device(index))

    def generator(self, seed: int, index: int) -> torch.Generator:
        return self.new_generator(index).manual_seed(seed)

    def event(self, enable_timing: bool = False) -> Any | None:
        """A device event (``record``, ``synchronize``, ``elapsed_time``), or None for devices without events."""
        return self.module().Event(enable_timing=enable_timing)

    def stream(self, index: int) -> Any | None:
        """A new stream on the device, or None for devices without streams."""
        return self.module().Stream(device=self.device(index))

    def current_stream(self, index: int) -> Any | None:
        return self.module().current_stream(index)

    def use_stream(self, stream: Any | None) -> contextlib.AbstractContextManager[Any]:
        """A context in which work is queued on ``stream`` (one from :meth:`stream`); with None, no change."""
        if stream is None:
            return contextlib.nullcontext()
        return self.module().stream(stream)

    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        """An uninitialised host buffer of ``nbytes`` bytes (uint8), page-locked when the device pins memory, so
        that copies from it to the device run asynchronously at full bus speed."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pins_memory)

    # -- vendor operators ------------------------------------------------------------------------------------------
    def fused_op(self, name: str) -> Callable[..., Any] | None:
        """The vendor's fused operator ``name`` (for example ``"npu_rms_norm"``), or None when this device's
        software stack lacks it. Kernel implementations ask for it by the vendor's own name and contract."""
        return None

    # -- compilation -----------------------------------------------------------------------------------------------
    def dynamo_compiler(self) -> tuple[str, Callable[..., Any] | None]:
        """The compiler ``torch.compile(backend="torchport")`` hands graphs to on this device after torchport's
        passes: its name and a dynamo backend ``(GraphModule, example_inputs) -> callable``; None runs the graph
        as it is (eager)."""
        return "eager", None

    def inductor_compiles(self) -> bool:
        """Whether ``torch.compile``'s default backend, Inductor, generates code for this device type: where it does
        not, the shim compiles a program's ``torch.compile(model)`` with torchport's backend instead. Here: whether
        Inductor is :meth:`dynamo_compiler`'s choice."""
        return self.dynamo_compiler()[0] == "inductor"

    # -- attention and float32 matmuls -----------------------------------------------------------------------------
    def attention_implementation(self, index: int) -> str:
        """The Hugging Face ``attn_implementation`` that computes attention best on device ``index`` (what
        :func:`torchport.attention.best` answers). Here: ``"sdpa"``, PyTorch's ``scaled_dot_product_attention``,
        which picks the device's fused kernels itself."""
        return "sdpa"

    def enable_tf32(self, index: int) -> dict[str, Any] | None:
        """Let float32 matmuls and convolutions on this device type run in TensorFloat-32 (inputs rounded to a
        10-bit mantissa, float32 accumulation). Returns the previous values of the switches it set (``{name:
        value}``, for :meth:`restore_tf32`), or None where the device has no TF32 and nothing was changed.
        Here: None."""
        return None

    def restore_tf32(self, previous: dict[str, Any]) -> None:
        """Put back the switches :meth:`enable_tf32` set, with the values it returned."""
        if previous:
            raise ValueError(f"the {self.name} backend sets no TF32 switches; got {', '.join(previous)}")

    def preferred_conv_memory_format(self, index: int) -> torch.memory_format:
        """The memory format in which this device's convolutions run fastest: ``torch.channels_last`` where its
        convolution library computes in NHWC (so that NCHW tensors cost a transpose per convolution), else
        ``torch.contiguous_format``. The ``channels_last`` compile pass converts 4-D convolution inputs when this
        says ``torch.channels_last``. Here: the default format (Ascend NPUs keep it too: torch_npu allocates NPU
        tensors only in contiguous format and converts to its internal NC1HWC0 layout itself)."""
        return torch.contiguous_format

    # -- dtypes --------------------------------------------------------------------------------------------------
    def claims_dtype(self, dtype: torch.dtype, index: int) -> bool:
        """The vendor's own word on whether a dtype is supported, used when probing is switched off."""
        if dtype == torch.bfloat16:
            check = getattr(self.module(), "is_bf16_supported", None)
            return bool(check()) if check is not None else False
        return True

    def dtype_probes(self, index: int) -> dict[torch.dtype, DtypeProbe]:
        """Run (once per device, then cached) a small matmul + softmax in each of fp32, bf16 and fp16
        (:func:`torchport.backends.dtype_probe.probe`)."""
        with self._probe_lock:
            if index not in self._probes:
                self._probes[index] = {dtype: probe(self, dtype, index) for dtype in PROBED_DTYPES}
            return self._probes[index]

    def preferred_dtype(self, index: int, probe: bool | None = None) -> torch.dtype:
        """bf16 if it works on the device, else fp16, else fp32."""
        for dtype in (torch.bfloat16, torch.float16):
            if self.dtype_works(dtype, index, probe):
                return dtype
        return torch.float32

    def autocast_dtype(self, requested: torch.dtype | None, index: int) -> torch.dtype:
        """The dtype ``torch.autocast`` should use here when code asked for ``requested`` (None: fp16, CUDA's
        default): the request when it works on the device, else the preferred low-precision dtype."""
        requested = requested or torch.float16
        if self.dtype_works(requested, index):
            return requested
        preferred = self.preferred_dtype(index)
        return preferred if preferred != torch.float32 else torch.bfloat16

    def dtype_works(self, dtype: torch.dtype, index: int, probe: bool | None = None) -> bool:
        """Whether a dtype computes correctly: by probe, or by the vendor's word when probing is off.

        ``probe=None`` follows ``TORCHPORT_PROBE``.
        """
        if not (_settings.get().probe if probe is None else probe):
            return self.claims_dtype(dtype, index)
        return self.dtype_probes(index)[dtype].works

    # -- deployment ------------------------------------------------------------------------------------------------
    #: The onnxruntime execution provider that runs ONNX models on this device type (:mod:`torchport.export.runtime`
    #: knows its package and options).
    onnx_provider: ClassVar[str] = "CPUExecutionProvider"

    # -- operators -------------------------------------------------------------------------------------------------
    #: The dispatcher key of this device's kernels (``"CUDA"``, ``"PrivateUse1"``...), None when it has none.
    dispatch_key: ClassVar[str | None] = None
    #: A file of ``torchport/compile/data`` listing the operators this device's library registers kernels for,
    #: read by ``torchport coverage`` where the library is not loaded; None when torchport ships none.
    op_snapshot: ClassVar[str | None] = None
    #: Whether the device's library runs an operator it has no kernel for on the CPU by itself.
    host_fallback: ClassVar[bool] = False

    def has_kernel(self, op: str) -> bool | None:
        """Whether this device's library registers a kernel of its own for ``op`` (``"aten::add.Tensor"``; the
        default overload has no suffix), as this process's dispatcher says. None when the library is not loaded
        here (it has no kernel for ``aten::empty.memory_format``, which every device registers)."""
        key = self.dispatch_key
        if key is None or not _dispatcher_has(_ALLOCATOR_OP, key):
            return None
        return _dispatcher_has(op, key)


_ALLOCATOR_OP = "aten::empty.memory_format"


def _dispatcher_has(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except RuntimeError:  # no such operator in this torch
        return False
