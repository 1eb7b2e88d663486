"""torch_npu's fused operators for the simulated NPU, with torch_npu's names, signatures and results.

Each follows its entry in torchport's snapshot of torch_npu's contract (``torchport/backends/data/
torch_npu_contract.json``: the op-plugin schema, the backward, the chips and the documented limits), and
``tests/backends/test_npu_contract.py`` holds them to it:

* the signature is the schema's (names, order, defaults, keyword-only arguments), and so is the number of results;
* a chip that torch_npu does not document the operator for fails when it is called, with RuntimeError (a real
  torch_npu has every operator as an attribute on every chip; :func:`only` simulates an older torch_npu *release*
  without some, whose attribute is then absent);
* arguments outside the documented limits fail with RuntimeError, as the real operator refuses them (where the
  documentation leaves the behaviour open, such as ``npu_rotary_mul``'s r1/r2 outside [-1, 1], the simulation
  refuses too, so that a caller relying on it is caught);
* operators with a backward (derivatives.yaml) are differentiable; the outputs it lists as non-differentiable are
  detached; an operator without one fails in the backward, as autograd does for a derivative that is not
  implemented.

They compute with ordinary PyTorch ops on the simulated device, and count their calls, so tests can check that a
kernel took the fused path. This module is their table (:data:`OPS`, :func:`lookup`, :func:`only`); the operators
are in :mod:`torchport.testing.npu_fused_layers` (norms, rotary embedding, activations, loss),
:mod:`torchport.testing.npu_fused_attention` and :mod:`torchport.testing.npu_fused_quant` (low-bit weights), and the
checks each of them starts with in :mod:`torchport.testing.npu_fused_contract`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .npu_fused_attention import npu_fusion_attention
from .npu_fused_contract import calls
from .npu_fused_layers import npu_cross_entropy_loss, npu_gelu, npu_rms_norm, npu_rotary_mul, npu_swiglu
from .npu_fused_quant import npu_convert_weight_to_int4pack, npu_weight_quant_batchmatmul

__all__ = ["OPS", "calls", "enabled", "lookup", "only"]

OPS: dict[str, Callable[..., Any]] = {
    fn.__name__: fn for fn in (npu_rms_norm, npu_rotary_mul, npu_swiglu, npu_gelu, npu_cross_entropy_loss,
                               npu_fusion_attention, npu_convert_weight_to_int4pack, npu_weight_quant_batchmatmul)
}
enabled: set[str] = set(OPS)


def lookup(name: str) -> Callable[..., Any] | None:
    """The operator ``name`` if the simulated torch_npu release has it (whatever the chip: see the module docs)."""
    return OPS.get(name) if name in enabled else None


@contextlib.contextmanager
def only(names: Iterable[str]) -> Iterator[None]:
    """Simulate a torch_npu release that has only the operators ``names`` (e.g. ``()`` for none) in a block: the
    others are absent attributes, as in a release older than them. (A chip without an operator is another matter:
    :func:`torchport.testing.simulated_chip`.)"""
    names = set(names)
    unknown = names - set(OPS)
    if unknown:
        raise ValueError(f"no simulated fused operator(s) {sorted(unknown)}; simulated: {', '.join(OPS)}")
    saved = set(enabled)
    enabled.clear()
    enabled.update(names)
    try:
        yield
    finally:
        enabled.clear()
        enabled.update(saved)
