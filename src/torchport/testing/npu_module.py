"""The ``torch.npu`` module of the simulated NPU: torch_npu's public API over the simulator's state."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import time
import types
import warnings
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["build", "register_autocast"]

# The fields of torch_npu's _NPUDeviceProperties (Ascend/pytorch torch_npu/csrc/npu/Module.cpp, branches v2.6.0 to
# v2.12.0 and master): Module.cpp sets name (the SoC name), total_memory, cube_core_num, vector_core_num,
# L2_cache_size, uuid and (26.x releases) multi_processor_count = vector_core_num or else cube_core_num; the others,
# major and minor included, are never set and read None.
_NPUDeviceProperties = namedtuple(
    "_NPUDeviceProperties",
    "name total_memory cube_core_num vector_core_num L2_cache_size major minor is_multi_gpu_board is_integrated "
    "multi_processor_count max_threads_per_multi_processor warp_size regs_per_multiprocessor gcnArchName uuid",
)


class _CUuuid:
    """torch_npu's device UUID object: 16 ``bytes``, printed in the usual 8-4-4-4-12 form."""

    def __init__(self, index: int) -> None:
        self.bytes = [0x54, 0x50, 0x4E, 0x50, *([0] * 11), index]  # "TPNP": made up, one per device

    def __str__(self) -> str:
        text = bytes(self.bytes).hex()
        return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def build(state: Any) -> types.ModuleType:
    """Make the ``torch.npu`` module object bound to the simulator ``state``."""
    mod = types.ModuleType("torch.npu", "Simulated torch_npu device module (torchport.testing).")

    def index_of(device: Any = None) -> int:
        if isinstance(device, (Stream,)):
            return device.device_index
        return state.resolve(device)

    # -- device -------------------------------------------------------------------------------------------------
    def is_available() -> bool:
        return True

    def device_count() -> int:
        return state.device_count

    def current_device() -> int:
        return state.current

    def set_device(device: Any) -> None:
        state.current = index_of(device)

    def synchronize(device: Any = None) -> None:
        index_of(device)  # host arithmetic is synchronous; still reject a bad device

    def get_device_name(device: Any = None) -> str:
        index_of(device)  # checked, then ignored: torch_npu names the SoC of the process, whatever the index
        return state.chip.soc_version

    def get_device_properties(device: Any = None) -> _NPUDeviceProperties:
        index = index_of(device)
        chip = state.chip
        return _NPUDeviceProperties(
            name=chip.soc_version, total_memory=state.memory[index].total, cube_core_num=chip.ai_cores,
            vector_core_num=chip.vector_cores, L2_cache_size=chip.l2_bytes, major=None, minor=None,
            is_multi_gpu_board=None, is_integrated=None, multi_processor_count=chip.multi_processor_count,
            max_threads_per_multi_processor=None, warp_size=None, regs_per_multiprocessor=None, gcnArchName=None,
            uuid=_CUuuid(index))

    def get_device_capability(device: Any = None) -> tuple[int, int] | None:
        # torch_npu (26.x releases; 7.3.0 and older warn and answer None): "major.minor" from
        # TORCH_NPU_DEVICE_CAPABILITY when set, else a warning and None
        found = re.match(r"^(\d+)\.(\d+)$", os.environ.get("TORCH_NPU_DEVICE_CAPABILITY", ""))
        if found is None:
            warnings.warn("torch.npu.get_device_capability: an NPU has no CUDA compute capability; set "
                          "TORCH_NPU_DEVICE_CAPABILITY=major.minor to report one (simulated NPU)", stacklevel=2)
            return None
        return int(found.group(1)), int(found.group(2))

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        mem = state.memory[index_of(device)]
        return mem.total - mem.reserved, mem.total

    def utilization(device: Any = None) -> int:
        index_of(device)
        return 0

    class device:  # noqa: N801 - torch_npu's name
        """Context manager that changes the current device."""

        def __init__(self, device: Any) -> None:
            self.index = index_of(device) if device is not None and device != -1 else None
            self.previous = None

        def __enter__(self) -> None:
            self.previous = state.current
            if self.index is not None:
                state.current = self.index

        def __exit__(self, *exc: Any) -> None:
            state.current = self.previous

    # -- memory -------------------------------------------------------------------------------------------------
    def memory_allocated(device: Any = None) -> int:
        return state.memory[index_of(device)].allocated

    def max_memory_allocated(device: Any = None) -> int:
        return state.memory[index_of(device)].peak_allocated

    def memory_reserved(device: Any = None) -> int:
        return state.memory[index_of(device)].reserved

    def max_memory_reserved(device: Any = None) -> int:
        return state.memory[index_of(device)].peak_reserved

    def reset_peak_memory_stats(device: Any = None) -> None:
        mem = state.memory[index_of(device)]
        with state.lock:
            mem.peak_allocated, mem.peak_reserved = mem.allocated, mem.reserved

    def memory_stats(device: Any = None) -> dict[str, int]:
        mem = state.memory[index_of(device)]
        return {
            "allocated_bytes.all.current": mem.allocated,
            "allocated_bytes.all.peak": mem.peak_allocated,
            "reserved_bytes.all.current": mem.reserved,
            "reserved_bytes.all.peak": mem.peak_reserved,
            "allocation.all.allocated": mem.alloc_count,
            "allocation.all.freed": mem.free_count,
        }

    def empty_cache() -> None:
        with state.lock:
            for mem in state.memory:
                mem.reserved -= mem.cached
                mem.cached = 0

    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction={fraction} must be in (0, 1]")
        state.memory_fraction[index_of(device)] = float(fraction)

    # -- random numbers -----------------------------------------------------------------------------------------
    def manual_seed(seed: int) -> None:
        state.generators[state.current].manual_seed(int(seed))
        state.initial_seeds[state.current] = int(seed)

    def manual_seed_all(seed: int) -> None:
        for i, gen in enumerate(state.generators):
            gen.manual_seed(int(seed))
            state.initial_seeds[i] = int(seed)

    def seed() -> None:
        state.initial_seeds[state.current] = state.generators[state.current].seed()

    def seed_all() -> None:
        for i, gen in enumerate(state.generators):
            state.initial_seeds[i] = gen.seed()

    def initial_seed() -> int:
        return state.initial_seeds[state.current]

    def get_rng_state(device: Any = "npu") -> torch.Tensor:
        return state.generators[index_of(device)].get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "npu") -> None:
        state.generators[index_of(device)].set_state(new_state.cpu())

    def get_rng_state_all() -> list[torch.Tensor]:
        return [g.get_state() for g in state.generators]

    def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
        for gen, new in zip(state.generators, new_states, strict=True):
            gen.set_state(new.cpu())

    # -- streams and events (host work is synchronous: events time the host clock) -----------------------------
    class Event:
        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
            self.enable_timing = enable_timing
            self._time: float | None = None

        def record(self, stream: Stream | None = None) -> None:
            self._time = time.perf_counter()

        def wait(self, stream: Stream | None = None) -> None:
            pass

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end_event: Event) -> float:
            if not (self.enable_timing and end_event.enable_timing):
                raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
            if self._time is None or end_event._time is None:
                raise RuntimeError("Both events must be recorded before calculating elapsed time.")
            return (end_event._time - self._time) * 1e3

    class Stream:
        def __init__(self, device: Any = None, priority: int = 0) -> None:
            self.device_index = index_of(device)
            self.priority = priority

        @property
        def device(self) -> torch.device:
            return torch.device("npu", self.device_index)

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def wait_event(self, event: Event) -> None:
            pass

        def wait_stream(self, stream: Stream) -> None:
            pass

        def record_event(self, event: Event | None = None) -> Event:
            event = event or Event()
            event.record(self)
            return event

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Stream) and other is self

        __hash__ = object.__hash__

    default_streams: dict[int, Stream] = {}
    # The current stream is per thread, as in torch_npu and CUDA: a stream context in one thread (a prefetching
    # worker, say) does not change the stream another thread's work goes to.
    per_thread = threading.local()

    def current_streams_of_thread() -> dict[int, Stream]:
        if not hasattr(per_thread, "streams"):
            per_thread.streams = {}
        return per_thread.streams

    def default_stream(device: Any = None) -> Stream:
        index = index_of(device)
        if index not in default_streams:
            default_streams[index] = Stream(index)
        return default_streams[index]

    def current_stream(device: Any = None) -> Stream:
        index = index_of(device)
        return current_streams_of_thread().get(index) or default_stream(index)

    def set_stream(stream: Stream) -> None:
        current_streams_of_thread()[stream.device_index] = stream

    @contextlib.contextmanager
    def stream(s: Stream | None) -> Iterator[None]:
        if s is None:
            yield
            return
        current_streams = current_streams_of_thread()
        previous = current_streams.get(s.device_index)
        current_streams[s.device_index] = s
        try:
            yield
        finally:
            if previous is None:
                current_streams.pop(s.device_index, None)
            else:
                current_streams[s.device_index] = previous

    # -- dtypes and autocast ------------------------------------------------------------------------------------
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return state.chip.bf16

    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32] if state.chip.bf16 else [torch.float16, torch.float32]

    amp = types.ModuleType("torch.npu.amp", "Automatic mixed precision for the simulated NPU.")

    class autocast(torch.amp.autocast):  # noqa: N801 - torch_npu's name
        def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True):
            super().__init__("npu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)

    class GradScaler(torch.amp.GradScaler):
        def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                     growth_interval: int = 2000, enabled: bool = True) -> None:
            super().__init__("npu", init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)

    amp.autocast = autocast
    amp.GradScaler = GradScaler
    amp.custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="npu")
    amp.custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="npu")

    def is_initialized() -> bool:
        return True

    def init() -> None:
        pass

    def _is_in_bad_fork() -> bool:
        return False

    names = dict(locals())
    for key, value in names.items():
        if key not in ("state", "mod", "names") and not key.startswith("__"):
            setattr(mod, key, value)
    mod._lazy_init = init
    mod._torchport_simulated = True
    return mod


# -- autocast ------------------------------------------------------------------------------------------------------
# The policy lists follow PyTorch's CUDA autocast (aten/src/ATen/autocast_mode.cpp): matmul-like ops run in the low
# dtype, numerically sensitive ops in float32, and mixed-input ops in the widest input dtype.
_LOWER = (
    "conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution _convolution prelu "
    "addmm addmv addr matmul einsum mm mv linear addbmm baddbmm bmm chain_matmul linalg_multi_dot "
    "lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention"
).split()
_FP32 = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus layer_norm "
    "native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss "
    "cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss "
    "mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
    "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp softmax log_softmax cumprod cumsum prod "
    "sum norm cross_entropy_loss"
).split()
_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot grid_sampler index_put scatter_add tensordot cat stack".split()
_LOW = (torch.float16, torch.bfloat16)
_AUTOCAST_KEYS = DispatchKeySet(DispatchKey.AutocastPrivateUse1)


def _eligible(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == "npu" and x.dtype != torch.float64


def _autocast_kernel(op: Any, policy: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == "lower":
            dtype = torch.get_autocast_dtype("npu")
        elif policy == "fp32":
            dtype = torch.float32
        else:
            floats = [x.dtype for x in tree_flatten((args, kwargs))[0] if _eligible(x)]
            dtype = functools.reduce(torch.promote_types, floats) if floats else None

        def cast(x: Any) -> Any:
            if dtype is None or not _eligible(x) or x.dtype == dtype:
                return x
            if policy == "fp32" and x.dtype not in _LOW:
                return x
            return x.to(dtype)

        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            args, kwargs = tree_map(cast, (args, kwargs))
            return op(*args, **kwargs)

    return kernel


def register_autocast() -> list[torch.library.Library]:
    """Register autocast kernels for the simulated NPU; every other op falls through autocast unchanged."""
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")
    for policy, names in (("lower", _LOWER), ("fp32", _FP32), ("promote", _PROMOTE)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                if "out" in overload:  # autocast does not apply to out= variants
                    continue
                op = getattr(packet, overload)
                lib.impl(name if overload == "default" else f"{name}.{overload}", _autocast_kernel(op, policy),
                         "AutocastPrivateUse1")
    return [fallthrough, lib]
