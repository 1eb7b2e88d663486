"""How the fused linear cross-entropy (:mod:`torchport.kernels.linear_ce_passes`) cuts its work: the workspaces it may
hold beyond its outputs, the two passes' blocks of tokens and vocabulary slices (:func:`blocks`), and the whole-row
strategy's chunks of tokens (:func:`row_chunk`, 0 where the two passes run instead).

Example:
    >>> blocks(8192, 4096, 128256, 2), row_chunk(8192, 128256, 2)
    (Blocks(tokens=1024, vocab=16064, grad_vocab=3072), 1024)
"""

from __future__ import annotations

import dataclasses

from .. import _settings

__all__ = ["MAX_ROW_CHUNKS", "ROWS_WORKSPACE_BYTES", "WORKSPACE_BYTES", "Blocks", "blocks", "row_chunk",
           "rows_workspace_bytes", "workspace_bytes"]

WORKSPACE_BYTES = 48 * 2**20  # the least workspace; liger-kernel's chunk of logits is 62.6 MiB at 8192 x 4096 -> 128256
# The whole-row strategy's logits: 1024 tokens x 128256 words in bf16 (250.5 MiB) in one chunk, whose matmuls run at
# 590-690 TFLOP/s on an H100 (RESULTS.md); 0 turns the strategy off (the two passes then always run)
ROWS_WORKSPACE_BYTES = 256 * 2**20
# Most token chunks whose grad_weight products the whole-row strategy sums in the weight's dtype; more tokens run
# the two passes, whose every gradient is rounded once (the error grows about as the chunks' square root)
MAX_ROW_CHUNKS = 8
# Rows x hidden of the pass-1 accumulator: 16 MiB of float32. The matmul accumulating into it then has about 128
# output tiles of 128 x 256, one wave on a 132-multiprocessor H100, whatever the hidden size.
_ACCUMULATOR_ELEMENTS = 4 * 2**20
_ALIGN = 64  # block and slice sizes are multiples of this (aligned rows for the matmuls)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How the two passes cut the work: ``tokens`` x ``vocab`` logits per step of pass 1, N x ``grad_vocab`` per step
    of pass 2."""

    tokens: int
    vocab: int
    grad_vocab: int


def workspace_bytes(n: int, hidden: int, element_size: int) -> int:
    """Bytes the op may hold beyond its outputs for ``n`` tokens of ``hidden`` values of ``element_size`` bytes."""
    return max(WORKSPACE_BYTES, 3 * n * hidden * element_size // 4)


def _balanced(total: int, most: int) -> int:
    """The size of near-equal parts of ``total`` of at most ``most`` each, a multiple of ``_ALIGN`` where it can be."""
    most = max(1, most)
    if total <= most:
        return max(total, 1)
    parts = -(-total // most)
    size = -(-total // parts)
    aligned = -(-size // _ALIGN) * _ALIGN
    return aligned if aligned <= most else max(size, most // _ALIGN * _ALIGN)


def blocks(n: int, hidden: int, vocab: int, element_size: int, accumulators: int = 1) -> Blocks:
    """The block sizes for ``n`` tokens, ``hidden`` -> ``vocab``, with ``accumulators`` float32 ``[tokens, hidden]``
    buffers in pass 1 (0 without ``grad_hidden``, 2 for soft-capping with label smoothing).

    Example:
        >>> blocks(8192, 4096, 128256, 2)
        Blocks(tokens=1024, vocab=16064, grad_vocab=3072)
    """
    budget = workspace_bytes(n, hidden, element_size)
    tokens = _balanced(n, max(_ALIGN, _ACCUMULATOR_ELEMENTS // max(hidden, 1)))
    while tokens > _ALIGN and accumulators * tokens * hidden * 4 > budget // 2:
        tokens = _balanced(n, tokens // 2)
    left = budget - accumulators * tokens * hidden * 4
    per_column = tokens * element_size * (2 if accumulators > 1 else 1)  # the slopes' buffer with 2
    return Blocks(tokens, _balanced(vocab, left // per_column), _balanced(vocab, budget // max(n * element_size, 1)))


def rows_workspace_bytes() -> int:
    """The whole-row strategy's workspace: ``TORCHPORT_LOSS_WORKSPACE_MIB`` when set, else ``ROWS_WORKSPACE_BYTES``.

    Example:
        >>> rows_workspace_bytes()   # 268435456 unless TORCHPORT_LOSS_WORKSPACE_MIB is set
    """
    mib = _settings.value("loss_workspace_mib")
    return ROWS_WORKSPACE_BYTES if mib is None else int(mib * 2**20)


def row_chunk(n: int, vocab: int, element_size: int) -> int:
    """Tokens per chunk of the whole-row strategy for ``n`` tokens of ``vocab`` logits of ``element_size`` bytes, or
    0 where the two passes run instead: no tokens, or more than ``MAX_ROW_CHUNKS`` chunks within
    :func:`rows_workspace_bytes`.

    Example:
        >>> row_chunk(8192, 128256, 2), row_chunk(65536, 128256, 2)
        (1024, 0)
    """
    most = rows_workspace_bytes() // max(vocab * element_size, 1)
    if n == 0 or most < 1:
        return 0
    rows = _balanced(n, most)
    return rows if -(-n // rows) <= MAX_ROW_CHUNKS else 0
