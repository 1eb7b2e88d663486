"""Rotary position embedding with Hugging Face's ``apply_rotary_pos_emb`` contract (half-split rotation).

``q [batch, heads, seq, head_dim]`` and ``k [batch, kv_heads, seq, head_dim]`` are rotated by ``cos``/``sin`` of
shape ``[batch or 1, seq, head_dim]`` (or ``[seq, head_dim]``): ``x·cos + rotate_half(x)·sin``. Implementations:
``triton`` on CUDA/ROCm (q and k in one launch), ``npu`` through ``torch_npu.npu_rotary_mul`` on Ascend, and the
``reference`` below.

Example:
    >>> q, k = torchport.kernels.rope(q, k, cos, sin)
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..backends.npu import device_chip, operator_limits
from . import registry
from .checks import check_floating, check_same_device, check_same_dtype, widen
from .spec import CustomOp, OpSpec, randn, rope_tables

__all__ = ["RoPE", "rope"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@registry.register_kernel("rope", "reference")
def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x·cos + rotate_half(x)·sin`` for q and k, in float32, rounded once to each input's dtype."""
    c, s = widen(cos).unsqueeze(1), widen(sin).unsqueeze(1)
    out = []
    for x in (q, k):
        h = widen(x)
        out.append((h * c + _rotate_half(h) * s).to(x.dtype))
    return out[0], out[1]


@registry.register_kernel("rope", "triton", devices=["cuda"], priority=20)
def _rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton import rope as kernel

    return kernel.rope(q, k, cos, sin, rope_reference)


# (id, weak reference, version, within [-1, 1]) of the cos/sin tensors checked: a model computes them once per step
# and every layer rotates with them, so the range costs one synchronisation per step, not one per layer
_ranges: dict[int, tuple[weakref.ref, int, bool]] = {}


def _within(t: torch.Tensor, low: float, high: float) -> bool:
    base = t if t._base is None else t._base  # a view's values lie within its base's
    entry = _ranges.get(id(base))
    if entry is not None and entry[0]() is base and entry[1] == base._version:
        return entry[2]
    inside = bool(((base >= low) & (base <= high)).all())
    if len(_ranges) > 64:
        _ranges.clear()
    _ranges[id(base)] = (weakref.ref(base), base._version, inside)
    return inside


def _npu_refuses(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why torch_npu.npu_rotary_mul cannot take these tensors (its documented limits), or None."""
    limits = operator_limits("npu_rotary_mul")
    batch, heads, _, dim = q.shape
    if dim >= limits["head_dim_below"]:
        return f"npu_rotary_mul takes head_dim below {limits['head_dim_below']}, not {dim}"
    if batch >= limits["batch_below"] or max(heads, k.shape[1]) >= limits["heads_below"]:
        return f"npu_rotary_mul takes batch and heads below {limits['batch_below']}, not {list(q.shape)}"
    if (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled() and \
            batch * max(heads, k.shape[1]) > limits["batch_heads_max_with_r_grad"]:
        return (f"npu_rotary_mul differentiates cos/sin only for batch x heads <= "
                f"{limits['batch_heads_max_with_r_grad']}, not {batch} x {max(heads, k.shape[1])}")
    chip = device_chip(q.device)
    if chip is not None and chip.family in limits["compiled_kernel_families"]:
        kernel = limits["compiled_kernel"]
        if dim != kernel["head_dim"] or cos.shape[0] != kernel["r_batch"]:
            return (f"npu_rotary_mul on {chip.soc_version} takes head_dim {kernel['head_dim']} and cos/sin of batch "
                    f"{kernel['r_batch']}, not head_dim {dim} and batch {cos.shape[0]}")
    low, high = limits["r_range"]
    if not (_within(cos, low, high) and _within(sin, low, high)):
        return (f"npu_rotary_mul takes cos/sin within [{low:g}, {high:g}]; these exceed it (a rotary embedding that "
                "scales them, such as YaRN's or LongRoPE's attention scaling)")
    return None


@registry.register_kernel("rope", "npu", devices=["npu"], priority=10,
                          requires=registry.fused_op_reason("npu_rotary_mul"))
def _rope_npu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # torch_npu.npu_rotary_mul(x, r1, r2) = x·r1 + rotate_half(x)·r2, r1/r2 broadcast to x ([B, 1, S, D] here)
    reason = _npu_refuses(q, k, cos, sin)
    if reason is not None:
        raise registry.Unsupported(reason)
    rotary_mul = registry.fused_op("npu_rotary_mul", q.device)
    c, s = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)
    return rotary_mul(q, c, s), rotary_mul(k, c, s)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embeddings to ``q`` and ``k``; returns the rotated ``(q, k)``.

    Args:
        q: ``[batch, heads, seq, head_dim]`` (head_dim even), any strides.
        k: ``[batch, kv_heads, seq, head_dim]``, q's dtype.
        cos, sin: ``[batch or 1, seq, head_dim]`` or ``[seq, head_dim]``, as Hugging Face's rotary embeddings
            return them (``cat(freqs, freqs)`` along the last dim).

    Example:
        >>> q, k = rope(torch.randn(1, 8, 16, 64), torch.randn(1, 2, 16, 64), cos, sin)
    """
    check_floating("rope", q=q, k=k, cos=cos, sin=sin)
    check_same_device("rope", q=q, k=k, cos=cos, sin=sin)
    check_same_dtype("rope", q=q, k=k)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"rope: q and k must be [batch, heads, seq, head_dim], got q {list(q.shape)} and k {list(k.shape)}"
        )
    batch, _, seq, dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq, dim):
        raise ValueError(
            f"rope: k {list(k.shape)} must match q {list(q.shape)} in batch, seq and head_dim (heads may differ)"
        )
    if dim % 2:
        raise ValueError(f"rope: head_dim must be even to rotate halves, got {dim} (q {list(q.shape)})")
    if cos.shape != sin.shape:
        raise ValueError(f"rope: cos and sin must have one shape, got {list(cos.shape)} and {list(sin.shape)}")
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1:] != (seq, dim):
        raise ValueError(
            f"rope: cos/sin must be [batch or 1, seq, head_dim] = [{batch} or 1, {seq}, {dim}] for q "
            f"{list(q.shape)}, got {list(cos.shape)}"
        )
    if torch.compiler.is_dynamo_compiling():  # a constant to dynamo: its graph calls the custom op
        return registry.custom_op("rope")(q, k, cos, sin)
    return registry.call("rope", q.device, q, k, cos, sin)


class RoPE(nn.Module):
    """``nn.Module`` form of :func:`rope`: ``forward(q, k, cos, sin) -> (q, k)``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope(q, k, cos, sin)


# -- torch.ops.torchport.rope's backward (kernels/library.py) ------------------------------------------------------
def _table_grad(parts: tuple[torch.Tensor, ...], table: torch.Tensor) -> torch.Tensor:
    """Sum of ``[B, H, S, D]`` products over heads, and over the batch where ``table`` broadcasts it."""
    total = sum(p.sum(1) for p in parts)
    if table.dim() == 2:
        total = total.sum(0)
    elif table.shape[0] == 1 and total.shape[0] != 1:
        total = total.sum(0, keepdim=True)
    return total.to(table.dtype)


def _backward(grads: tuple[torch.Tensor, ...], needs: tuple[bool, ...], q: torch.Tensor | None,
              k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The rope kernel itself, once: ``out = x·cos + rotate_half(x)·sin`` is linear in x, and its transpose is the
    same rotation by ``sin' = -(sin's halves exchanged)``: ``g1 = d1·c1 + d2·s2, g2 = d2·c2 - d1·s1``. cos and sin
    get their (rarely wanted) gradients in plain PyTorch, from q and k, which are saved only then."""
    dq, dk = grads
    half = sin.shape[-1] // 2
    sin_t = -torch.cat((sin[..., half:], sin[..., :half]), dim=-1)
    gq, gk = rope(dq.detach(), dk.detach(), cos.detach(), sin_t.detach())
    dcos = dsin = None
    if (needs[2] or needs[3]) and q is not None and k is not None:
        dq32, dk32, q32, k32 = widen(dq), widen(dk), widen(q), widen(k)
        dcos = _table_grad((dq32 * q32, dk32 * k32), cos)
        dsin = _table_grad((dq32 * _rotate_half(q32), dk32 * _rotate_half(k32)), sin)
    return gq, gk, dcos, dsin


def _saved(needs: tuple[bool, ...]) -> tuple[bool, ...]:
    tables = needs[2] or needs[3]  # q and k only for the gradient of cos and sin
    return tables, tables, True, True


def _inputs(gen: torch.Generator | None, batch: int, q_heads: int, kv_heads: int, seq: int,
            head_dim: int) -> tuple[torch.Tensor, ...]:
    q, k = randn(gen, (batch, q_heads, seq, head_dim)), randn(gen, (batch, kv_heads, seq, head_dim))
    return (q, k, *(t.expand(batch, seq, head_dim) for t in rope_tables(seq, head_dim)))


def _bytes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    # fwd: read q, k, write q, k; bwd: read dq, dk, write dq, dk; plus cos and sin, read once in each pass
    return 4 * (q.numel() + k.numel()) * q.element_size() + 4 * cos.numel() * cos.element_size()


SPEC = registry.register_op(OpSpec(
    "rope", "RoPE", "Hugging Face ``apply_rotary_pos_emb`` on q and k", ("RoPE", "rope"),
    "batch × q heads × kv heads × sequence × head dim",
    sizes={"test": (2, 3, 1, 7, 16), "smoke": (2, 4, 2, 64, 32), "small": (1, 8, 2, 256, 64),
           "medium": (2, 32, 8, 1024, 128), "large": (4, 32, 8, 4096, 128), "benchmark": (4, 32, 8, 2048, 128)},
    make=_inputs, call=rope, differentiable=2, bytes_moved=_bytes,
    custom_op=CustomOp("(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)", like=(0, 1),
                       backward=_backward, saved=_saved),
))
