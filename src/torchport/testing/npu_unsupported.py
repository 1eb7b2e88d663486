"""Operators declared missing on the simulated NPU (:func:`torchport.testing.unsupported_ops`).

Running one fails as PyTorch's dispatcher fails for a device without a kernel, or, declared with
``torch_npu_fallback=True``, runs on the host after torch_npu's warning, as torch_npu's own CPU fallback does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from .npu_state import NPU, State, state

__all__ = ["declare_unsupported", "dispatcher_has", "has_privateuse1_kernel", "on_missing", "withdraw"]

# Operators the simulation needs to move tensors and allocate: declaring them missing would stop it working.
_PRIMITIVES = frozenset({
    "aten::empty", "aten::empty_strided", "aten::_to_copy", "aten::copy_", "aten::_copy_from",
    "aten::_copy_from_and_resize", "aten::resize_", "aten::set_", "aten::lift_fresh",
})


def has_privateuse1_kernel(op: str) -> bool:
    """Whether a kernel registered for ``op`` on PrivateUse1 runs in place of the simulation's own."""
    # torchport's kernels pick their implementation per device themselves; a kernel of theirs registered for the
    # npu is their npu implementation, which the simulation runs as it runs every other one: on the host
    return not op.startswith("torchport::") and dispatcher_has(op, "PrivateUse1")


def dispatcher_has(op: str, key: str) -> bool:
    """Whether PyTorch's dispatcher has a kernel for ``op`` under dispatch key ``key``."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except RuntimeError:  # an operator the dispatcher knows by another name (aten::sym_size is aten::sym_size.int)
        return False


def _returns_view(op: str) -> bool:
    namespace, _, rest = op.partition("::")
    name, _, overload = rest.partition(".")
    schema = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")._schema
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def on_missing(st: State, qualified: str) -> None:
    """Fail as the dispatcher does for a device without a kernel, or warn as torch_npu's CPU fallback does."""
    support = st.support.get(qualified, "unknown")
    if support == "unknown":
        from ..compile.op_support import device_op_support

        support = st.support[qualified] = device_op_support(NPU, qualified)
    if support == "native":  # e.g. aten::erfinv when only its default overload was declared: it calls erfinv.out
        return
    if support == "host":
        if qualified not in st.fallback_warned:
            st.fallback_warned.add(qualified)
            warnings.warn(f"CAUTION: The operator '{qualified}' is not currently supported on the NPU backend and "
                          "will fall back to run on the CPU. This may have performance implications.", stacklevel=3)
        return
    backends = [key for key in ("CPU", "CUDA", "Meta") if dispatcher_has(qualified, key)]
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
        if not any(dispatcher_has(name, "CPU") for name in names):
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
