"""CUDA-only dependencies met by a program running on another target: one clear message each, and a hint."""

from __future__ import annotations

import functools
import importlib.abc
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


class _Guard(importlib.abc.MetaPathFinder):
    def __init__(self, target: Target) -> None:
        self.target = target

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        top = name.partition(".")[0]
        hint = CUDA_ONLY_PACKAGES.get(top)
        if hint is None:
            return None
        self.target.recorder.find(top, hint)
        raise ImportError(
            f"{top} is CUDA-only and cannot run on {self.target.type} (torchport shim): {hint}", name=name
        )


def install(target: Target, patcher: Patcher) -> Any:
    """Refuse CUDA-only imports and CUDA extension builds with a clear message; returns the import guard."""
    guard = _Guard(target)
    sys.meta_path.insert(0, guard)
    for name in list(sys.modules):
        if name.partition(".")[0] in CUDA_ONLY_PACKAGES:
            target.recorder.find(name.partition(".")[0], CUDA_ONLY_PACKAGES[name.partition(".")[0]])

    from torch.utils import cpp_extension

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

    patcher.wrap(cpp_extension, "load", lambda fn: guarded(fn, "torch.utils.cpp_extension.load"))
    patcher.wrap(cpp_extension, "load_inline", lambda fn: guarded(fn, "torch.utils.cpp_extension.load_inline"))
    return guard
