"""The launches of the cross-entropy kernels (:mod:`.cross_entropy`): the hand-chosen heuristics, the candidates the
tuner (:mod:`.autotune`) times against them once per shape bucket and device, and the tuned choice per call."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import autotune, next_power_of_2

__all__ = ["Launch", "launch_for", "tuned_launch"]

_ROW_MAX = 4096  # columns a program holds in registers; wider rows measured faster in the chunked kernel
_BLOCK = 8192  # columns per step of the chunked kernel: 16 KiB of bf16, 32 KiB of float32 in registers
_EIGHT_WARPS_MAX = 32768  # rows up to this width: a program of 8 warps per row; up to the next, of 16 warps
_ONE_ROW_PER_PROGRAM_MAX = 65536  # wider rows: a persistent grid, one program of 32 warps per multiprocessor


class Launch(NamedTuple):
    """How :func:`.cross_entropy.loss_and_grad` launches: ``rows`` (``block`` = rows per program, each whole in
    registers) or ``chunked`` (``block`` = columns per step, ``per_sm`` programs per multiprocessor, 0 for one per
    row; ``prefetch``: each walk loads a chunk ahead). A tuple: made per call from the tuner's configuration."""

    kind: str
    block: int
    warps: int
    per_sm: int = 0
    reverse: bool = True
    evict: bool = True
    prefetch: bool = False


def launch_for(n: int, v: int, element_size: int, sms: int) -> Launch:
    """The hand-chosen launch for ``n`` rows of ``v`` logits of ``element_size`` bytes: what
    :func:`.cross_entropy.loss_and_grad` runs where nothing is timed, and the first candidate the tuner times."""
    width = next_power_of_2(max(v, 1))
    if width <= _ROW_MAX:
        # 2048 values (4 warps) per program: measured best at 256 and 4096 columns (8192 rows, H100)
        return Launch("rows", max(1, 2048 // width), 4)
    if width <= _EIGHT_WARPS_MAX:
        # 8 warps: 8192 columns 90.4% of the copy ceiling against 79.9% with 16 (16384: 96.0 / 89.8%; 32000:
        # 93.2 / 91.6%; H100, 8192 rows; the H200 showed the same order)
        return Launch("chunked", 4096 if width <= 8192 else _BLOCK, 8, 0)
    if width > _ONE_ROW_PER_PROGRAM_MAX:
        # one program of 32 warps per multiprocessor, chunks of 32768 columns loaded ahead: 132 rows in flight
        # (34 MB at 128256 bf16 columns) fit in L2 for the second walk. H100, one run: 128256 columns 1.672 ms
        # (83.8% of the copy ceiling) against 1.901 ms (73.7%) for a program per row; 262144: 79.0 / 71.5%
        return Launch("chunked", 4 * _BLOCK, 32, 1, prefetch=True)
    return Launch("chunked", min(_BLOCK, width), 16, 0)


# The launch is timed per device: the cards disagree. At 128256 bf16 columns the H100 ran the persistent grid (the
# heuristic) fastest, 1.672 against 1.901 ms for a program per row of 16 warps; on an H200 (kernel alone, in place)
# programs per row of 8 warps took 1.668 against 1.853 ms at 8192 rows, and at short rows other shapes of program
# than the heuristic's were faster: 1024 columns one row of one warp, 19.0 against 22.2 us; 4096 columns the chunked
# kernel, 55.8 against 62.8 us. benchmarks/RESULTS.md, "issue 23 item 3 on an H200". With fewer instructions per logit
# (RESULTS.md, "the cross-entropy bound by its instructions"), an H200 ran 64 logits a thread fastest at 16384-65536
# columns and the persistent grid at 131072 and up; the eviction hints off won nowhere and are no longer timed.
_KIND_ROWS, _KIND_CHUNKED = 0, 1  # a configuration's "kind"
_NO_GRAD, _NEW_GRAD, _GRAD_OVER_LOGITS = 0, 1, 2  # the bucket's "grad": the gradient not wanted, in its own buffer,
# or written over the logits (timed that way: the stores then hit the lines the loads just brought in)


def _to_config(launch: Launch) -> autotune.Config:
    """A launch as the tuner's configuration (every candidate walks a row's second pass backwards: no field)."""
    if launch.kind == "rows":
        return {"kind": _KIND_ROWS, "BLOCK": launch.block, "num_warps": launch.warps}
    return {"kind": _KIND_CHUNKED, "BLOCK": launch.block, "num_warps": launch.warps, "per_sm": launch.per_sm,
            "evict": int(launch.evict), "prefetch": int(launch.prefetch)}


def _from_config(config: autotune.Config) -> Launch:
    if config["kind"] == _KIND_ROWS:
        return Launch("rows", config["BLOCK"], config["num_warps"])
    return Launch("chunked", config["BLOCK"], config["num_warps"], config["per_sm"], evict=bool(config["evict"]),
                  prefetch=bool(config["prefetch"]))


def _bucket(n: int, v: int, grad: int) -> tuple[int, int, int]:
    return next_power_of_2(v), autotune.coarse(n, 256, 65536), grad


def _candidates(width: int, rows: int, grad: int) -> list[autotune.Config]:
    """The heuristic first. Rows held whole (up to ``_ROW_MAX``): fewer rows or warps per program, twice the warps,
    and the chunked kernel over one or two chunks. Longer rows: programs per row of 4-8 warps over chunks of 32 or
    64 logits a thread, and the persistent grid with its loads ahead. Chunks never wider than ``width``, the row
    length rounded up to a power of two."""
    heuristic = launch_for(rows, width, 2, 0)  # the heuristic depends on the width alone
    if heuristic.kind == "rows":
        m = heuristic.block
        others = [Launch("rows", max(1, m // 4), 1), Launch("rows", max(1, m // 2), 2),
                  Launch("rows", max(1, m // 2), 4), Launch("rows", m, 8), Launch("chunked", 4096, 4, 0)]
    else:
        # 64 logits a thread (8192 columns over 4 warps, 16384 over 8): fastest at 16384-65536 columns on an H200
        others = [Launch("chunked", 8192, 4, 0), Launch("chunked", 16384, 8, 0), Launch("chunked", 8192, 8, 0),
                  Launch("chunked", 4096, 4, 0), Launch("chunked", 4 * _BLOCK, 32, 1, prefetch=True)]
    configs = [_to_config(heuristic)] + [_to_config(c) for c in others]
    for config in configs:
        if config["kind"] == _KIND_CHUNKED:
            config["BLOCK"] = min(config["BLOCK"], width)
    return autotune.distinct(configs)[:6]


_TUNED = autotune.Tunable("cross_entropy.launch", ("block_v", "rows", "grad"), _bucket, _candidates)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes ``a`` and ``b`` span intersect."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def tuned_launch(logits: torch.Tensor, dx: torch.Tensor, run: Callable[[Launch, torch.Tensor, torch.Tensor], None],
                  want_grad: bool) -> Launch:
    """The tuner's launch for these sizes, timed on the first call of a shape bucket. ``run(launch, x, out)``
    launches once on logits ``x`` with the gradient written to ``out``. When the gradient goes over the logits,
    candidates are timed in place on a copy of the logits (made once; the logits the final launch reads stay
    intact), so the first call of such a bucket holds one more tensor of the logits' size, besides the tuner's own
    buffer for clearing L2. Out of memory there leaves the heuristic, which the tuner then keeps for the process."""
    n, v = logits.shape
    over = want_grad and (dx is logits or _overlap(dx, logits))
    sizes = (n, v, _GRAD_OVER_LOGITS if over else _NEW_GRAD if want_grad else _NO_GRAD)
    config = _TUNED.lookup(logits.device, logits.dtype, *sizes)
    if config is None:
        copy: list[torch.Tensor] = []

        def launch_one(config: autotune.Config) -> None:
            if not over:
                run(_from_config(config), logits, dx)
                return
            if not copy:
                copy.append(logits.clone())
            run(_from_config(config), copy[0], copy[0])

        config = _TUNED.tune(logits.device, logits.dtype, sizes, launch_one)
    return _from_config(config)
