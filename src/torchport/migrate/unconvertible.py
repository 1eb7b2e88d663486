"""What ``torchport migrate`` leaves as written, and the hint it gives for each.

Each entry of :data:`UNCONVERTIBLE` is a dotted-name prefix (matched against imports and against the fully
qualified names of attribute chains), what it is, and what to do by hand. Attributes of the CUDA module that no
rule handles are listed too, so nothing CUDA-specific stays in the code silently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import libcst as cst

if TYPE_CHECKING:
    from .transform import Context

__all__ = ["Hazard", "UNCONVERTIBLE", "HANDLED", "check_import", "check_name"]

from .registry import LEGACY_TYPES
from .registry import SOURCE as _CUDA

SDPA_HINT = "use torch.nn.functional.scaled_dot_product_attention, which picks each device's fused attention"


# torch.accelerator.Graph exists from PyTorch 2.12 only, so migrate does not write it: code must run on older ones too
_GRAPH_HINT = ("use torch.compile(mode='reduce-overhead'), or torch.accelerator.Graph (PyTorch 2.12 and later) "
               "guarded by torch.accelerator.is_available()")


class Hazard(NamedTuple):
    prefix: str
    what: str
    hint: str


UNCONVERTIBLE: tuple[Hazard, ...] = (
    Hazard("flash_attn", "flash_attn (CUDA-only attention kernels)", SDPA_HINT),
    Hazard("cupy", "cupy (CUDA arrays)", "rewrite with torch tensor operations, which run on every device"),
    Hazard("triton", "Triton kernel", "Triton runs on CUDA, ROCm and XPU only: keep a pure-PyTorch fallback for "
                                      "NPU and CPU and choose it when torch.accelerator's device is not one of those"),
    Hazard("torch.utils.cpp_extension", "custom C++/CUDA extension",
           "build the extension per device or provide a pure-PyTorch fallback"),
    Hazard(f"{_CUDA}.nvtx", "NVTX range", "use torch.profiler.record_function(name), which works on every device"),
    Hazard(f"{_CUDA}.graph", "CUDA graph capture", _GRAPH_HINT),
    Hazard(f"{_CUDA}.CUDAGraph", "CUDA graph", _GRAPH_HINT),
    Hazard(f"{_CUDA}.make_graphed_callables", "CUDA graph capture", _GRAPH_HINT),
)

#: attributes of the CUDA module that a rule rewrites, and whether the rule needs them called
HANDLED: dict[str, bool] = {
    "is_available": False, "device_count": False, "current_device": False, "set_device": False,
    "synchronize": False, "current_stream": False, "stream": False, "get_device_name": False,
    "memory_allocated": True, "max_memory_allocated": True, "memory_reserved": True, "max_memory_reserved": True,
    "reset_peak_memory_stats": True, "empty_cache": True, "memory_stats": True, "reset_accumulated_memory_stats": True,
    "reset_max_memory_allocated": True, "reset_max_memory_cached": True, "manual_seed": True, "manual_seed_all": True,
    "Event": True, "Stream": True, "amp.autocast": True, "amp.GradScaler": True,
}


def _hazard(dotted: str) -> Hazard | None:
    for hazard in UNCONVERTIBLE:
        if dotted == hazard.prefix or dotted.startswith(hazard.prefix + "."):
            return hazard
    return None


def check_import(ctx: Context, node: cst.Import | cst.ImportFrom) -> None:
    """Report an import of an unconvertible package, or a from-import out of the CUDA module."""
    if isinstance(node, cst.Import):
        modules = [cst.Module([]).code_for_node(alias.name) for alias in node.names]
    else:
        if node.relative or node.module is None:
            return
        base = cst.Module([]).code_for_node(node.module)
        names = [] if isinstance(node.names, cst.ImportStar) else [a.name.value for a in node.names]
        modules = [f"{base}.{name}" for name in names] or [base]
        if base == f"{_CUDA}.amp" and names and all(f"amp.{name}" in HANDLED for name in names):
            return  # the import rule rewrites it
        if base == _CUDA or base.startswith(_CUDA + "."):
            if not any(_hazard(m) for m in modules):
                ctx.unconverted(node, f"from {base} import ...",
                                f"import torch and write {_CUDA}.NAME, which migrate rewrites, or port by hand")
                return
    for dotted in modules:
        hazard = _hazard(dotted)
        if hazard:
            ctx.unconverted(node, hazard.what, hazard.hint)
            return


def check_name(ctx: Context, node: cst.Attribute, parent: cst.CSTNode | None) -> None:
    """Report a whole dotted name that refers to something unconvertible or unhandled."""
    if isinstance(node.value, cst.Call):
        return  # a method of what a call returned (torch.cuda.FloatTensor(2).fill_): the call is checked itself
    for dotted in ctx.qualified(node):
        hazard = _hazard(dotted)
        if hazard:
            ctx.unconverted(node, hazard.what, hazard.hint)
            return
        if dotted != _CUDA and not dotted.startswith(_CUDA + "."):
            continue
        attribute = dotted[len(_CUDA) + 1 :]
        called = isinstance(parent, cst.Call) and parent.func is node
        if attribute in LEGACY_TYPES:
            _check_legacy_type(ctx, node, parent, attribute, called)
            return
        if attribute in HANDLED and (called or not HANDLED[attribute]):
            return
        shown = dotted if attribute else _CUDA
        hint = ("call it: migrate rewrites only the call" if attribute in HANDLED
                else "look for the same function in torch.accelerator or torch.get_device_module(DEVICE)")
        ctx.unconverted(node, f"no rule for {shown}", hint)
        return


def _check_legacy_type(ctx: Context, node: cst.Attribute, parent: cst.CSTNode | None, name: str,
                       called: bool) -> None:
    """A legacy tensor type is rewritten where it is called or passed to ``.type()``; anywhere else it is reported."""
    if called:
        return  # legacy-tensor-type rewrites the call, or reports why not
    call = ctx.parent(parent) if isinstance(parent, cst.Arg) else None
    func = call.func if isinstance(call, cst.Call) else None
    if isinstance(func, cst.Attribute) and func.attr.value == "type":
        return  # tensor-type rewrites t.type(...)
    dtype = f"torch.{LEGACY_TYPES[name]}"
    if isinstance(func, cst.Name) and func.value == "isinstance":
        ctx.unconverted(node, f"isinstance(t, {_CUDA}.{name})",
                        f'write t.dtype == {dtype} and t.device.type != "cpu"')
        return
    if func is not None and "torch.set_default_tensor_type" in ctx.qualified(func):
        ctx.unconverted(node, f"torch.set_default_tensor_type({_CUDA}.{name})",
                        f"write torch.set_default_dtype({dtype}) and torch.set_default_device(DEVICE)")
        return
    ctx.unconverted(node, f"{_CUDA}.{name} used as a value",
                    "no device-agnostic type stands for it: where it is called write torch.tensor(data, "
                    f"dtype={dtype}, device=DEVICE) or torch.empty(sizes, dtype={dtype}, device=DEVICE), and "
                    f"t.to(DEVICE, {dtype}) for t.type(...)")
