"""Rotary position embedding in Triton, Hugging Face's half-split layout, q and k in one launch.

For ``q [B, Hq, S, D]``, ``k [B, Hk, S, D]`` of s bytes per element, the forward reads q and k and writes both
(2·(Hq+Hk)·B·S·D·s), the backward reads their gradients and writes the input gradients (the same again); cos and
sin add 2·B·S·D·s per direction, read once per position rather than once per head. For q 4x32x2048x128,
k 4x8x2048x128 in bf16: 344 MB, 0.114 ms at the H100's 3022 GB/s copy bandwidth.

One program handles a run of positions of one batch entry: it loads their cos and sin once, then rotates the heads
of q and k, one head at a time; within a head the run's rows are adjacent in memory. When there are fewer runs than
``_MIN_PROGRAMS`` (decode: one position), a second grid axis splits the heads over programs, so that one token's 40
heads are rotated by 40 programs at once instead of one after the other. Strides are arguments, so q and k may be
transposed views of ``[B, S, H, D]`` projections; outputs keep the input's layout.

The backward is the same rotation with the sine negated and its halves exchanged:
forward ``o1 = x1·c1 - x2·s1``, ``o2 = x2·c2 + x1·s2``; backward ``g1 = d1·c1 + d2·s2``, ``g2 = d2·c2 - d1·s1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .. import _autograd, registry
from . import autotune, cdiv, next_power_of_2
from .launch import Kernel

__all__ = ["rope"]

# Launch configurations: positions per program (at most; fewer for short sequences or wide heads) and warps. The
# tuner (autotune.py) times them once per bucket — half the head dim rounded up to a power of two, a coarse count
# of positions (batch x seq) and the head count (q + k) rounded up to a power of two — and keeps the fastest. The
# first is the heuristic: H100, q 4x32x2048x128 + k 4x8x2048x128 bf16, forward: 4 positions x 4 warps 0.0665 ms
# (86% of copy bandwidth); the best of 28 settings was 0.0663 ms, the worst (one position per program) 0.60 ms.
_CANDIDATES = [{"BLOCK_S": s, "num_warps": w} for s, w in ((4, 4), (2, 4), (8, 4), (4, 8), (8, 8), (4, 2))]
_POSITIONS = (256, 65536)  # buckets: 256, 1024, 4096, 16384, 65536 and more
# Fewer runs of positions than this and the heads are split over programs as well (a second grid axis). A decode
# step of Llama-8B (1 position, 32 + 8 heads) took 9.6 us on an H100 as one program rotating 40 heads in turn, and
# 1.9 us as 40 programs of one head.
_MIN_PROGRAMS = 128


def _bucket(positions: int, half: int, heads: int) -> tuple[int, int, int]:
    return next_power_of_2(half), autotune.coarse(positions, *_POSITIONS), next_power_of_2(heads)


def _candidates(block_d: int, positions: int, heads: int) -> list[autotune.Config]:
    return list(_CANDIDATES)


_FIELDS = ("block_d", "positions", "heads")
_TUNED = {False: autotune.Tunable("rope.forward", _FIELDS, _bucket, _candidates),
          True: autotune.Tunable("rope.backward", _FIELDS, _bucket, _candidates)}


@triton.jit
def _rotate_heads(X, OUT, b, s, s_ok, first, last, HALF, x_sb, x_sh, x_ss, o_sb, o_sh, o_ss, c1, c2, sa, sb,
                  BLOCK_D: tl.constexpr):
    """Rotate heads ``first`` to ``last`` (exclusive) of X into OUT."""
    d = tl.arange(0, BLOCK_D)
    ok = s_ok[:, None] & (d < HALF)[None, :]
    src = X + b * x_sb + first * x_sh + s[:, None] * x_ss + d[None, :]
    dst = OUT + b * o_sb + first * o_sh + s[:, None] * o_ss + d[None, :]
    for h in range(first, last):
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst, (x1 * c1 - x2 * sa).to(OUT.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, (x2 * c2 + x1 * sb).to(OUT.dtype.element_ty), mask=ok)
        src += x_sh
        dst += o_sh


@triton.jit
def _rope_kernel(Q, K, COS, SIN, QO, KO, S, HQ, HK, HALF, HEADS_PER,
                 q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, qo_sb, qo_sh, qo_ss, ko_sb, ko_sh, ko_ss,
                 c_sb, c_ss, s_sb, s_ss,
                 BACKWARD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # heads [first, last) of the q-then-k sequence of HQ + HK heads are this program's (all when not split)
    first = tl.program_id(1).to(tl.int64) * HEADS_PER
    last = first + HEADS_PER
    s_blocks = tl.cdiv(S, BLOCK_S)
    pid = tl.program_id(0)
    b = (pid // s_blocks).to(tl.int64)
    s = ((pid % s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    s_ok = s < S
    d = tl.arange(0, BLOCK_D)
    ok = s_ok[:, None] & (d < HALF)[None, :]
    cos = COS + b * c_sb + s[:, None] * c_ss + d[None, :]
    sin = SIN + b * s_sb + s[:, None] * s_ss + d[None, :]
    c1 = tl.load(cos, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:
        sa = -s2
        sb = -s1
    else:
        sa = s1
        sb = s2
    _rotate_heads(Q, QO, b, s, s_ok, tl.minimum(first, HQ), tl.minimum(last, HQ), HALF,
                  q_sb, q_sh, q_ss, qo_sb, qo_sh, qo_ss, c1, c2, sa, sb, BLOCK_D)
    k_first = tl.minimum(tl.maximum(first - HQ, 0), HK)
    k_last = tl.minimum(tl.maximum(last - HQ, 0), HK)
    _rotate_heads(K, KO, b, s, s_ok, k_first, k_last, HALF, k_sb, k_sh, k_ss, ko_sb, ko_sh, ko_ss, c1, c2, sa, sb,
                  BLOCK_D)


_ROPE = Kernel(_rope_kernel)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _unit_last(q), _unit_last(k)
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    if q_out.stride(-1) != 1 and q_out.shape[-1] > 1:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if k_out.stride(-1) != 1 and k_out.shape[-1] > 1:
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    batch, heads_q, seq, dim = q.shape
    heads_k = k.shape[1]
    if batch * seq == 0 or dim == 0 or heads_q + heads_k == 0:
        return q_out, k_out
    half = dim // 2
    args = (q, k, cos, sin, q_out, k_out, backward)
    tunable = _TUNED[backward]
    sizes = (batch * seq, half, heads_q + heads_k)
    config = tunable.lookup(q.device, q.dtype, *sizes)
    if config is None:  # first launch at these sizes: candidates may write q_out and k_out, rewritten below
        config = tunable.tune(q.device, q.dtype, sizes, lambda c: _launch_kernel(c, *args))
    _launch_kernel(config, *args)
    return q_out, k_out


def _launch_kernel(config: autotune.Config, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_out: torch.Tensor, k_out: torch.Tensor, backward: bool) -> None:
    batch, heads_q, seq, dim = q.shape
    half = dim // 2
    block_d = next_power_of_2(half)
    block_s = max(1, min(config["BLOCK_S"], next_power_of_2(seq), 4096 // block_d))
    c_sb = cos.stride(0) if cos.shape[0] > 1 else 0
    s_sb = sin.stride(0) if sin.shape[0] > 1 else 0
    runs = batch * cdiv(seq, block_s)
    heads = heads_q + k.shape[1]
    heads_per = heads if runs >= _MIN_PROGRAMS else cdiv(heads, min(heads, cdiv(_MIN_PROGRAMS, runs)))
    _ROPE.launch(
        (runs, cdiv(heads, heads_per)),
        q, k, cos, sin, q_out, k_out, seq, heads_q, k.shape[1], half, heads_per,
        *q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3],
        c_sb, cos.stride(1), s_sb, sin.stride(1),
        BACKWARD=backward, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=config["num_warps"],
    )


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                settings: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        ctx.settings = (q.shape, q.dtype, k.shape, k.dtype, *settings)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None) -> tuple[Any, ...]:
        cos, sin = ctx.saved_tensors
        q_shape, q_dtype, k_shape, k_dtype, reference, was_forced = ctx.settings
        dq = torch.zeros(q_shape, dtype=q_dtype, device=cos.device) if dq is None else dq
        dk = torch.zeros(k_shape, dtype=k_dtype, device=cos.device) if dk is None else dk
        try:
            gq, gk = _launch(dq, dk, cos, sin, backward=True)
        except Exception as exc:
            # The rotation is linear in q and k: its gradient is the reference rotation's vector-Jacobian product,
            # which needs only the shapes, not the saved inputs.
            q0 = torch.zeros_like(dq)
            k0 = torch.zeros_like(dk)
            gq, gk, _, _ = registry.backward_fallback("rope", "triton", exc, was_forced, reference,
                                                      (q0, k0, cos, sin), (dq, dk))
        return gq, gk, None, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         reference: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    for t in (q, k):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise registry.Unsupported(f"the Triton kernel takes float32, bfloat16 or float16, not {t.dtype}")
    if cos.requires_grad or sin.requires_grad:
        raise registry.Unsupported("gradients with respect to cos and sin are computed by the reference only")
    return _autograd.apply(_RopeFunction, q, k, _unit_last(cos), _unit_last(sin), (reference, registry.forced("rope")))
