"""CUDA-only dependencies met by a program running on another target: one clear message each, and a hint."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Any

from .redirect import Patcher, Target

__all__ = ["CUDA_ONLY_PACKAGES", "install"]

# Top-level package -> what to do instead. Raising ImportError lets the common
# `try: import flash_attn / except ImportError: <fallback>` take its fallback.
CUDA_ONLY_PACKAGES = {
    "flash_attn": "use torch.nn.functional.scaled_dot_product_attention (transformers: attn_implementation='sdpa'); "
                  "on Ascend, torch_npu.npu_fusion_attention",
    "flash_attn_interface": "use torch.nn.functional.scaled_dot_product_attention",
    "cupy": "use torch tensor operations on the device, or numpy on the host",
    "cupyx": "use torch tensor operations on the device, or numpy on the host",
    "pycuda": "use torch tensor operations and torch.Event/torch.Stream",
}


_CPP_EXTENSION = "torch.utils.cpp_extension"


_PROBE = importlib.util.find_spec.__code__


def _probing() -> bool:
    """Whether the running import search was started by ``importlib.util.find_spec`` rather than an import."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code is _PROBE:
            return True
        frame = frame.f_back
    return False


class _Guard(importlib.abc.MetaPathFinder):
    def __init__(self, target: Target, after: dict[str, Any]) -> None:
        self.target = target
        self.after = after  # module name -> what to do with the module once it is loaded

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name in self.after:
            return self._after_loading(name)
        top = name.partition(".")[0]
        hint = CUDA_ONLY_PACKAGES.get(top)
        if hint is None or _probing():
            # a library asking importlib.util.find_spec whether the package exists is told it does not, so it
            # takes its own fallback (transformers probes flash_attn this way at import)
            return None
        self.target.recorder.find(top, hint)
        raise ImportError(
            f"{top} is CUDA-only and cannot run on {self.target.type} (torchport shim): {hint}", name=name
        )

    def _after_loading(self, name: str) -> Any:
        # Adapt a module when the program imports it, not before (cpp_extension imports setuptools: 0.2 s).
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, original_exec = spec.loader, spec.loader.exec_module

        def exec_module(module: Any) -> None:
            loader.exec_module = original_exec
            original_exec(module)
            self.after[name](module)

        loader.exec_module = exec_module
        return spec


def install(target: Target, patcher: Patcher, after: dict[str, Any] | None = None) -> Any:
    """Refuse CUDA-only imports and CUDA extension builds with a clear message; returns the import guard. ``after``
    maps more module names to what to do with each once loaded (now, for those already imported)."""
    for name in list(sys.modules):
        if name.partition(".")[0] in CUDA_ONLY_PACKAGES:
            target.recorder.find(name.partition(".")[0], CUDA_ONLY_PACKAGES[name.partition(".")[0]])

    def guarded(original: Any, api: str) -> Any:
        @functools.wraps(original)
        def call(name: str, *args: Any, **kwargs: Any) -> Any:
            sources = list(kwargs.get("sources") or (args[0] if args and isinstance(args[0], (list, tuple)) else []))
            wants_cuda = (kwargs.get("with_cuda") or kwargs.get("cuda_sources")
                          or any(str(s).endswith((".cu", ".cuh")) for s in sources))
            if wants_cuda:
                hint = "rewrite the kernel with torch ops or Triton, or run this program on an NVIDIA GPU"
                target.recorder.find(f"CUDA extension {name!r}", hint)
                raise RuntimeError(
                    f"{api}({name!r}) builds a CUDA extension, which cannot run on {target.type} "
                    f"(torchport shim): {hint}"
                )
            return original(name, *args, **kwargs)

        return call

    def guard_builds(cpp_extension: Any) -> None:
        with patcher.lock:
            patcher.wrap(cpp_extension, "load", lambda fn: guarded(fn, f"{_CPP_EXTENSION}.load"))
            patcher.wrap(cpp_extension, "load_inline", lambda fn: guarded(fn, f"{_CPP_EXTENSION}.load_inline"))

    hooks = {**(after or {}), _CPP_EXTENSION: guard_builds}
    guard = _Guard(target, hooks)
    sys.meta_path.insert(0, guard)
    for name, adapt in hooks.items():
        if name in sys.modules:
            adapt(sys.modules[name])
    return guard
