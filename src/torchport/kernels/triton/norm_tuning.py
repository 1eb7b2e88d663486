"""Launch configurations of the RMSNorm and LayerNorm kernels (:mod:`.norm`): the hand-tuned heuristics, the
candidates the tuner (:mod:`.autotune`) times against them, and the shape buckets they are chosen for."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import _logging
from . import autotune, next_power_of_2, nvidia, shared_memory_per_program

__all__ = ["BACKWARD", "FORWARD", "backward_launch", "unpipelined_backward"]

# Launch configurations. The tuner (autotune.py) times these candidates once per bucket — the row width rounded up
# to a power of two (the fused kernels' BLOCK_N) and a coarse row count — and keeps the fastest; the first of each
# list is the hand-tuned heuristic, used as it is where nothing can be timed. For the one-kernel backwards, programs
# per multiprocessor only go down from the heuristic, or from one to two: the weight-gradient partial sums (programs x
# n x 4 bytes per parameter) never grow past the heuristic's size, or 2 x SMs x 8192 x 4 bytes (8.25 MiB on a
# 132-SM card).
_ROWS = (256, 65536)  # row-count buckets: 256, 1024, 4096, 16384, 65536 and more
_MAX_WARPS = 32


def _fwd_heuristic(block_n: int) -> tuple[int, int]:
    """(BLOCK_M, num_warps) for rows of ``block_n`` columns held whole in registers."""
    block_m = max(1, min(32, 2048 // block_n))  # short rows: a few KiB per program
    tile = block_m * block_n
    return block_m, 4 if tile <= 2048 else 8 if tile <= 8192 else 16


def _fwd_candidates(block_n: int, rows: int) -> list[autotune.Config]:
    m, w = _fwd_heuristic(block_n)
    return autotune.distinct([
        {"BLOCK_M": m, "num_warps": w},
        {"BLOCK_M": m, "num_warps": max(1, w // 2)},
        {"BLOCK_M": m, "num_warps": min(_MAX_WARPS, w * 2)},
        {"BLOCK_M": max(1, m // 2), "num_warps": w},
        {"BLOCK_M": m * 2, "num_warps": w},
        {"BLOCK_M": m * 2, "num_warps": min(_MAX_WARPS, w * 2)},
    ])


def _bwd_heuristic(block_n: int, is_rms: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, num_warps, programs per multiprocessor, stages of the row loop) for the persistent backward."""
    if 2048 <= block_n <= 8192:
        # H200, 8192 rows bf16, both norms, every candidate with and without a pipelined row loop: 8 warps over
        # 8192 values a step, one program per SM, 3 stages was the fastest launch at 2048, 4096 and 8192 columns or
        # within 1.5% of it (RMSNorm 33.5 / 56.6 / 103.8 us, LayerNorm 34.4 / 58.3 / 106.3), where the earlier
        # heuristics took 71.9 / 62.7 / 119.7 and 61.3 / 82.4 / 152.2 us (results/issue23/bwd_stages_h200.json).
        # Its two buffered tiles take 64 KiB of shared memory in bf16, 128 KiB in float32.
        return min(4, 8192 // block_n), 8, 1, 3
    block_m, num_warps = _fwd_heuristic(block_n)
    per_sm = 8 if block_m * block_n <= 1024 else 4 if block_m * block_n <= 2048 else 2
    if block_n == 256:
        # 8 rows x 2 warps, 4 per SM: 13.9 / 13.9 us (RMSNorm / LayerNorm) against 16.4 / 25.7 with 4 warps, the
        # fastest of 12 launches for both (H200, 8192 rows bf16, results/issue23/fwd_stages_h200.json)
        num_warps = 2
    # 1024 columns (2 rows x 4 warps, 4 per SM): 3 stages took 19.4 / 19.1 us (RMSNorm / LayerNorm) against 21.0 /
    # 22.6 unpipelined on an H200, 8192 rows bf16; at 256 columns the stages moved the best launch by 2% at most
    # (results/issue23/fwd_stages_h200.json)
    return block_m, num_warps, per_sm, 3 if block_n == 1024 else 1


def _bwd_launch(block_m: int, num_warps: int, per_sm: int, stages: int) -> autotune.Config:
    return {"BLOCK_M": block_m, "num_warps": num_warps, "per_sm": per_sm, "stages": stages}


def unpipelined_backward(block_n: int, is_rms: bool) -> autotune.Config:
    """The one-kernel backward's launch without a pipelined row loop: the earlier heuristic from 2048 to 8192 columns
    (H100, 8192 x 4096 bf16, best of 36 unpipelined settings: RMSNorm 4 rows x 16 warps, LayerNorm 2 rows x 8 warps,
    one per SM), the heuristic with its loop unpipelined elsewhere. Taken where the pipelined launch cannot run
    (:func:`backward_launch`)."""
    if not 2048 <= block_n <= 8192:
        m, w, p, _ = _bwd_heuristic(block_n, is_rms)
        return _bwd_launch(m, w, p, 1)
    return _bwd_launch(min(4, 16384 // block_n), 16, 1, 1) if is_rms else _bwd_launch(min(2, 8192 // block_n), 8, 1, 1)


_REDUCTION_BYTES = 16 * 1024  # shared memory kept free for the kernel's row reductions beside the buffered tiles


def backward_launch(config: autotune.Config, block_n: int, bytes_per_value: int, device: torch.device,
                    is_rms: bool) -> autotune.Config:
    """``config`` where its row loop may be pipelined on ``device``, else the unpipelined heuristic of these rows
    (:func:`unpipelined_backward`, faster than the pipelined launch's shape without its stages).
    Pipelined: on NVIDIA GPUs, where the stages were measured, while the tiles that its ``per_sm`` programs buffer
    (``stages - 1`` tiles of ``BLOCK_M x block_n`` values of x and dy each) fit in the shared memory of one
    multiprocessor, taken as what Triton's driver allows one program (not float32 rows on a GPU with less than an
    H100's, nor 1024 columns at four programs per multiprocessor in bf16 below 128 KiB); and under Triton's
    interpreter, which ignores the stages, so that the CPU tests run that code."""
    stages = config.get("stages", 1)
    if stages <= 1 or device.type == "cpu":
        return config
    limit = shared_memory_per_program(device)
    per_sm = config["per_sm"]
    need = per_sm * ((stages - 1) * config["BLOCK_M"] * block_n * bytes_per_value + _REDUCTION_BYTES)
    is_nvidia = nvidia(device)
    # a persistent grid whose programs do not all fit on their multiprocessors at once would run in two waves
    if is_nvidia and limit is not None and need <= limit:
        return config
    fallback = unpipelined_backward(block_n, is_rms)
    key = (device.type, device.index, block_n, bytes_per_value, is_rms, per_sm)
    # once per device and launch shape (the call is on every backward's path), and only when it will be read
    if _logging.enabled("kernels") and key not in _LOGGED_FALLBACKS:
        _LOGGED_FALLBACKS.add(key)
        why = ("not an NVIDIA GPU, where the pipelined loop was not measured" if not is_nvidia
               else "the device's shared memory per program is unknown" if limit is None
               else f"the buffered tiles of its {per_sm} program(s) per multiprocessor need {need} bytes of shared "
                    f"memory, the device has {limit}")
        _logging.log("kernels", "%s backward, %d columns, %d bytes per x + dy value on %s: %s; running %s instead "
                     "of %s", "rms_norm" if is_rms else "layer_norm", block_n, bytes_per_value, device, why,
                     fallback, config)
    return fallback


_LOGGED_FALLBACKS: set[tuple[object, ...]] = set()


def _bwd_candidates(is_rms: bool) -> Callable[[int, int], list[autotune.Config]]:
    def candidates(block_n: int, rows: int) -> list[autotune.Config]:
        m, w, p, s = _bwd_heuristic(block_n, is_rms)
        if s > 1 and block_n < 2048:
            # the loop unpipelined, two warps, twice the rows at half the programs, half the rows (1024 columns on
            # the H200: 18.8 / 20.2 / 20.1 us RMSNorm, 18.9 / 19.3 / 22.7 LayerNorm)
            return autotune.distinct([_bwd_launch(m, w, p, s), unpipelined_backward(block_n, is_rms),
                                      _bwd_launch(m, max(1, w // 2), p, s), _bwd_launch(2 * m, w, max(1, p // 2), s),
                                      _bwd_launch(max(1, m // 2), w, p, s)])
        if s > 1:
            # the earlier heuristic, then the pipelined loop around the heuristic: half the rows, twice the warps,
            # two programs of half the rows per SM (LayerNorm 4096 columns on the H200: 1 row x 8 warps x 2 per SM,
            # 57.5 us). Not twice the rows: in float32 its buffered tiles (256 KiB) pass an H200's shared memory.
            return autotune.distinct([_bwd_launch(m, w, p, s), unpipelined_backward(block_n, is_rms),
                                      _bwd_launch(max(1, m // 2), w, p, s),
                                      _bwd_launch(m, 2 * w, p, s), _bwd_launch(max(1, m // 2), w, 2, s)])
        return autotune.distinct([
            _bwd_launch(m, w, p, s),
            _bwd_launch(m, max(1, w // 2), p, s),
            # one program per SM: also two of half the rows (LayerNorm 8192 x 4096 bf16 on an H200: 1 row x 8 warps
            # x 2 per SM 72.0 us against the heuristic's 82.2; benchmarks/results/issue23/norm_probe_h200.json)
            _bwd_launch(max(1, m // 2), w, 2, s) if p == 1 else _bwd_launch(m, min(_MAX_WARPS, w * 2), p, s),
            _bwd_launch(max(1, m // 2), w, p, s),
            _bwd_launch(m * 2, w, p, s),
            _bwd_launch(m, w, p // 2, s) if p > 1 else _bwd_launch(max(1, m // 2), max(1, w // 2), p, s),
        ])

    return candidates


# The wide-row forward's "hints": 1 walks a row the second time last chunk first with L2 eviction hints, 0 walks it
# forward twice without them (norm._walk); both stay candidates.
def _fwd_chunked_candidates(block_n: int, rows: int) -> list[autotune.Config]:
    return [{"BLOCK_N": c, "num_warps": w, "hints": h}
            for c, w, h in ((4096, 16, 1), (4096, 8, 1), (4096, 8, 0), (2048, 4, 1), (8192, 8, 1), (8192, 16, 1))]


def _bwd_columns_candidates(block_n: int, rows: int) -> list[autotune.Config]:
    """Tiles of the wide-row backward's column kernel (norm_chunked.bwd_columns_kernel): BLOCK_M rows x BLOCK_N
    columns, ``per_sm`` programs per multiprocessor over the whole grid. Its partial weight gradients take
    SMs x per_sm x BLOCK_N x 4 bytes whatever the row length (4.3 MiB on an H100 for the heuristic)."""
    # The heuristic won 6 of 7 buckets on an H100 (8192 rows, 16384-262144 columns, both norms; 0.46 ms at LayerNorm
    # 16384, 1.8 ms at 65536), up to 2x ahead of 8 warps x 4 per SM (results/issue23/norm_wide_run{2,3}_tuner.json).
    return [{"BLOCK_M": m, "BLOCK_N": c, "num_warps": w, "per_sm": p}
            for m, c, w, p in ((4, 1024, 4, 8), (2, 2048, 8, 4), (8, 1024, 8, 4), (4, 1024, 8, 4), (2, 2048, 4, 8),
                               (8, 1024, 4, 8))]


def _bucket(m: int, n: int) -> tuple[int, int]:
    return next_power_of_2(n), autotune.coarse(m, *_ROWS)


_FIELDS = ("block_n", "rows")
# (is_rms, fused) -> Tunable
FORWARD = {
    (True, True): autotune.Tunable("rms_norm.forward", _FIELDS, _bucket, _fwd_candidates),
    (False, True): autotune.Tunable("layer_norm.forward", _FIELDS, _bucket, _fwd_candidates),
    (True, False): autotune.Tunable("rms_norm.forward_chunked", _FIELDS, _bucket, _fwd_chunked_candidates),
    (False, False): autotune.Tunable("layer_norm.forward_chunked", _FIELDS, _bucket, _fwd_chunked_candidates),
}
BACKWARD = {
    (True, True): autotune.Tunable("rms_norm.backward", _FIELDS, _bucket, _bwd_candidates(True)),
    (False, True): autotune.Tunable("layer_norm.backward", _FIELDS, _bucket, _bwd_candidates(False)),
    (True, False): autotune.Tunable("rms_norm.backward_columns", _FIELDS, _bucket, _bwd_columns_candidates),
    (False, False): autotune.Tunable("layer_norm.backward_columns", _FIELDS, _bucket, _bwd_columns_candidates),
}
