"""The forwards and functions that :func:`torchport.patch` puts in place of Hugging Face's, built from a table row.

Each ``make_*`` returns a plain function with the signature of what it replaces, so the same function serves as a
class attribute (:func:`torchport.patch_transformers`) and, bound with ``types.MethodType``, as one module's forward
(:func:`torchport.patch`). Whatever a kernel cannot take (another activation, ``unsqueeze_dim != 1``, a wrapped
``lm_head``) goes to the original code, unchanged.

Example:
    >>> forward = make_norm_forward(FAMILIES["llama"].norm, in_place=True)
    >>> y = forward(model.model.norm, hidden_states)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kernels.checks import capturing
from .families import GATED_ACTIVATIONS, MLP, Norm

__all__ = [
    "causal_lm_loss",
    "gated_kernel",
    "make_fused_linear_forward",
    "make_mlp_forward",
    "make_norm_forward",
    "make_rope",
    "make_sdpa_masks",
]

IGNORE_INDEX = -100


def make_norm_forward(spec: Norm, in_place: bool) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``forward(self, x)`` of an RMSNorm module through :func:`torchport.kernels.rms_norm`."""

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(hidden_states, self.weight, getattr(self, spec.eps), spec.offset, in_place=in_place)

    forward.__qualname__ = f"torchport.{spec.cls}.forward"
    forward.in_place = in_place  # type: ignore[attr-defined]
    return forward


@functools.cache
def _activation_kernels() -> dict[type, str]:
    from transformers.activations import ACT2CLS

    found = {}
    for name, op in GATED_ACTIVATIONS.items():
        entry = ACT2CLS.get(name)
        if entry is not None:
            found[entry[0] if isinstance(entry, tuple) else entry] = op
    return found


def gated_kernel(activation: object) -> str | None:
    """The gated kernel (``"swiglu"``/``"geglu"``) equal to ``activation(gate) * up``, or None."""
    return _activation_kernels().get(type(activation))


def make_mlp_forward(spec: MLP, ops: frozenset[str],
                     original: Callable[..., torch.Tensor]) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``forward(self, x)`` of a gated MLP: projections, then :func:`swiglu` or :func:`geglu` when ``ops`` allows
    the module's activation, else ``original``."""

    # read once here, not per call: a plain dict is what torch.compile traces without guarding a cache wrapper
    by_activation = dict(_activation_kernels())

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        op = by_activation.get(type(getattr(self, spec.act)))
        if op not in ops:
            return original(self, x)
        if spec.gate_up is not None:
            # Two views of one projection output (no copy); the kernels take rows of any stride.
            gate, up = getattr(self, spec.gate_up)(x).chunk(2, dim=-1)
        else:
            gate, up = getattr(self, spec.gate)(x), getattr(self, spec.up)(x)
        # in_place: gate and up are fresh projection outputs that no autograd node saved (a linear layer saves
        # its input, not its output), so the backward may write their gradients over them.
        return getattr(self, spec.down)(getattr(kernels, op)(gate, up, in_place=True))

    forward.__qualname__ = f"torchport.{spec.cls}.forward"
    return forward


def make_rope(original: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` through :func:`torchport.kernels.rope`.

    When ``cos`` covers only a prefix of ``head_dim`` (Phi-3's partial rotary factor), that prefix is rotated and the
    rest passes through, as in the original.
    """

    @functools.wraps(original)
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             *args: Any, unsqueeze_dim: int = 1, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if args or kwargs or unsqueeze_dim != 1 or q.dim() != 4:
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        rotary = cos.shape[-1]
        if rotary == q.shape[-1]:
            return kernels.rope(q, k, cos, sin)
        q_rot, k_rot = kernels.rope(q[..., :rotary], k[..., :rotary], cos, sin)
        return torch.cat([q_rot, q[..., rotary:]], dim=-1), torch.cat([k_rot, k[..., rotary:]], dim=-1)

    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def _plain_causal(kwargs: dict[str, Any], causal: Callable[..., Any]) -> bool:
    """Whether an SDPA mask asked for with ``kwargs`` is the plain lower-triangular mask of a square score matrix,
    which SDPA's ``is_causal=True`` computes without one: no padding mask, no sliding window, transformers' own
    causal mask function, queries and keys of one fixed length, both starting at position 0."""
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    return (kwargs.get("allow_is_causal_skip", True) is True and kwargs.get("attention_mask") is None
            and kwargs.get("local_size") is None and kwargs.get("mask_function") is causal
            # plain ints only: a symbolic length (dynamic shapes, torch.export) must not be fixed by this choice
            and type(q_length) is int and type(kv_length) is int and q_length == kv_length > 1
            and type(kwargs.get("q_offset", 0)) is int and kwargs.get("q_offset", 0) == 0
            and type(kwargs.get("kv_offset", 0)) is int and kwargs.get("kv_offset", 0) == 0)


def make_sdpa_masks(table: dict[str, Callable[..., Any]], interface: Any, causal: Callable[..., Any]
                    ) -> dict[str, Callable[..., Any]]:
    """transformers' table of mask functions (``ALL_MASK_ATTENTION_FUNCTIONS``' own entries ``table``) with its
    ``"sdpa"`` entry wrapped: under ``torch.compile``, a plain causal mask (:func:`_plain_causal`) is not built.

    transformers leaves that mask to SDPA's ``is_causal=True`` in eager mode, but builds it as a tensor while dynamo
    traces (``masking_utils._ignore_causal_mask_sdpa`` answers False when tracing, with the torch versions torchport
    supports), and SDPA with an explicit mask runs 2.6x slower forward and backward on an H100 (benchmarks/RESULTS.md,
    the compiled Llama train step). Everything else (padding, sliding windows, packed sequences, decoding with a
    cache, eager mode) goes to transformers' function unchanged.
    """
    original = interface["sdpa"]

    @functools.wraps(original)
    def sdpa_mask(*args: Any, **kwargs: Any) -> Any:
        if not args and torch.compiler.is_compiling() and _plain_causal(kwargs, causal):
            return None
        return original(*args, **kwargs)

    sdpa_mask.__wrapped__ = original
    return {**table, "sdpa": sdpa_mask}


def _shifted_targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
                     ignore_index: int) -> torch.Tensor:
    # As transformers' ForCausalLMLoss: position t predicts token t+1; the last position predicts nothing.
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _per_item(loss: torch.Tensor, num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = IGNORE_INDEX,
                   shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` through :func:`torchport.kernels.cross_entropy` (no float32 copy of the
    logits): labels shifted left by one, ``ignore_index`` skipped, the mean over counted tokens, or the sum divided
    by ``num_items_in_batch`` when the trainer gives it (gradient accumulation). The loss is float32, as
    transformers' (which upcasts the logits), and not rounded to the logits' dtype on the way.

    Example:
        >>> loss = causal_lm_loss(logits, input_ids, model.config.vocab_size)
    """
    target = _shifted_targets(labels, shift_labels, ignore_index).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = kernels.cross_entropy(logits.reshape(-1, vocab_size), target, ignore_index=ignore_index,
                                 reduction=reduction, loss_dtype=torch.float32)
    return _per_item(loss, num_items_in_batch)


def _fusable(model: nn.Module, labels: Any, logits_to_keep: Any) -> bool:
    if not model.training or labels is None:
        return False  # evaluation and generation keep their logits; as in transformers, no labels means no loss
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        return False
    # A PEFT-wrapped lm_head (LoRA) is not an nn.Linear: its weight alone would drop the adapter.
    return isinstance(model.lm_head, nn.Linear) and type(model.lm_head).forward is nn.Linear.forward


def _head_arguments(lm_forward: Callable[..., Any], base_forward: Callable[..., Any]) -> frozenset[str]:
    """The named parameters of a causal LM's forward that its base model's forward does not name (``labels``,
    ``logits_to_keep``): the LM head consumes them. Read from the installed signatures (``inspect`` follows
    transformers' decorators to the function they wrap), since their names change between releases
    (``past_key_values`` became ``cache`` in 5.24)."""
    named = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    lm = [p.name for p in inspect.signature(lm_forward).parameters.values() if p.kind in named]
    base = {p.name for p in inspect.signature(base_forward).parameters.values() if p.kind in named}
    return frozenset(lm[1:]) - base


def make_fused_linear_forward(original: Callable[..., Any], softcap: str | None,
                              base: str = "model") -> Callable[..., Any]:
    """A causal LM's forward whose training loss is :func:`torchport.kernels.fused_linear_cross_entropy` of the
    final hidden states and ``lm_head``: no ``[tokens, vocab]`` logits are made, and ``logits`` in the output is
    None. ``softcap`` names the config attribute by which the model soft-caps its logits (Gemma 2's
    ``final_logit_softcapping``), passed to the kernel. ``base`` names the attribute holding the base model that
    ``original`` calls. The loss is float32, as transformers'. In evaluation, without labels, with
    ``logits_to_keep`` or a wrapped ``lm_head``, it is ``original``.

    The base model gets the caller's arguments under the caller's names, less those the LM head consumes, and the
    output carries the base model's fields under the installed output class's names: the call is the one
    ``original`` makes in the installed transformers, so it warns about nothing the unpatched model does not.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import can_return_tuple

    carried = [field.name for field in dataclasses.fields(CausalLMOutputWithPast)
               if field.name not in ("loss", "logits")]

    heads: dict[type, frozenset[str]] = {}  # per base-model class; a plain dict, which torch.compile traces

    @can_return_tuple
    def fused(self: nn.Module, **kwargs: Any) -> Any:
        model = getattr(self, base)
        head = heads.get(type(model))
        if head is None:
            head = heads[type(model)] = _head_arguments(original, type(model).forward)
        outputs = model(**{name: value for name, value in kwargs.items() if name not in head})
        hidden = outputs.last_hidden_state
        labels = kwargs.get("labels")
        ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)
        target = _shifted_targets(labels, kwargs.get("shift_labels"), ignore_index).to(hidden.device)
        num_items = kwargs.get("num_items_in_batch")
        # A positive count divides inside the kernel, so that loss.backward() hands it an upstream gradient of 1
        # (no pass over the V x H weight gradient to scale it); 0 (nothing counted) divides outside, as transformers.
        # A tensor count is not read while torch.compile traces or a graph is captured: the kernel's function then
        # divides on the device (0 gives NaN, as 0 / 0 does in transformers).
        inside = num_items is not None and (
            (torch.is_tensor(num_items) and capturing(hidden.device)) or float(num_items) > 0)
        loss = kernels.fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, target, bias=self.lm_head.bias,
            ignore_index=ignore_index, reduction="mean" if num_items is None else "sum",
            num_items_in_batch=num_items if inside else None, loss_dtype=torch.float32,
            softcap=getattr(self.config, softcap, None) if softcap else None,
        )
        return CausalLMOutputWithPast(loss=loss if inside else _per_item(loss, num_items), logits=None,
                                      **{name: getattr(outputs, name, None) for name in carried})

    # Positional arguments are named after the original's signature (self first).
    parameters = list(inspect.signature(original).parameters.values())[1:]
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    logits_to_keep = next((p.default for p in parameters if p.name == "logits_to_keep"), 0)

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if len(args) > len(names) or any(name in kwargs for name in names[:len(args)]):
            return original(self, *args, **kwargs)  # let the original raise its TypeError
        kwargs.update(zip(names, args))
        if not _fusable(self, kwargs.get("labels"), kwargs.get("logits_to_keep", logits_to_keep)):
            return original(self, **kwargs)
        return fused(self, **kwargs)

    return forward
