"""One-line patching of Hugging Face transformers models with torchport kernels.

:func:`patch` changes one model instance (its modules' forwards; weights stay), :func:`patch_transformers` changes
the transformers classes of a family so every model of it (already built or built later) uses the kernels, and
:func:`unpatch` puts back exactly what was there. What is replaced, per family, is data: see
:mod:`torchport.models.families`. The kernels choose their implementation per tensor device, so a patched model
runs on an NPU, a GPU or the CPU.

Example:
    >>> import torchport
    >>> model = torchport.patch(AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-0.6B"))
    >>> loss = model(input_ids, labels=input_ids).loss     # no logits are materialised in training
    >>> torchport.unpatch(model)
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from torch import nn

from .._patching import MISSING, Journal
from . import ops
from ._held import _MASKS, _Forward, _hold, _hold_shared, _lock, _models, _Recipe, _Record, _release, _resolve, _shared
from ._held import _restore_record  # noqa: F401  (models pickled by earlier versions name it here)
from .families import FAMILIES, Family
from .._unwrap import peel

__all__ = ["FAMILIES", "is_patched", "patch", "patch_transformers", "patched_families", "supported", "unpatch",
           "unpatch_transformers"]

logger = logging.getLogger("torchport")

_MISSING = MISSING  # like _Forward, _Recipe, _Record, _restore_record: names that models pickled earlier refer to
_FLAGS = ("rms_norm", "rope", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy", "causal_mask")
_KERNELS = {"cross_entropy": "cross_entropy", "fused_linear_cross_entropy": "fused_linear_cross_entropy"}


def supported() -> list[str]:
    """The ``config.model_type`` values :func:`patch` knows.

    Example:
        >>> "llama" in torchport.models.supported()
        True
    """
    return sorted(FAMILIES)


def _family(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(
            f"torchport.patch: model_type {model_type!r} is not supported; supported: {', '.join(supported())}. "
            "Patch the kernels in by hand (torchport.kernels) or open an issue with the model's config."
        )
    return FAMILIES[model_type]


def _flags(given: dict[str, bool]) -> dict[str, bool]:
    unknown = sorted(set(given) - set(_FLAGS))
    if unknown:
        raise TypeError(f"torchport.patch: unknown flag(s) {unknown}; flags: {', '.join(_FLAGS)}")
    flags = {"rms_norm": True, "rope": True, "swiglu": True, "geglu": True, "cross_entropy": False,
             "fused_linear_cross_entropy": True, "causal_mask": True, **given}
    from .. import kernels

    for flag, kernel in _KERNELS.items():
        if flags[flag] and not hasattr(kernels, kernel):
            logger.warning("torchport.patch: torchport.kernels has no %s in this version; %s is left off",
                           kernel, flag)
            flags[flag] = False
    return flags


def _unwrap(model: Any) -> nn.Module:
    """The transformers model inside PEFT-style wrappers (``wrapper.base_model.model``)."""
    inner = peel(model)
    if not isinstance(inner, nn.Module) or not hasattr(inner, "config"):
        raise TypeError(
            f"torchport.patch: expected a transformers model (or a PEFT wrapper of one), got {type(model).__name__}"
        )
    return inner


def _defines_forward(module: nn.Module, cls: type) -> bool:
    """``module`` is a ``cls`` running ``cls``'s own forward (not a subclass's), so the table describes it."""
    if not isinstance(module, cls):
        return False
    owner = next(klass for klass in type(module).__mro__ if "forward" in vars(klass))
    return owner is cls


def _forward_slot(module: nn.Module) -> str:
    # Accelerate's hooks (device_map, offloading) put a wrapper in module.forward that calls module._old_forward:
    # replacing _old_forward keeps the hook around the kernel.
    return "_old_forward" if "_old_forward" in module.__dict__ else "forward"


def patch(model: Any, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True, geglu: bool = True,
          cross_entropy: bool = False, fused_linear_cross_entropy: bool = True, causal_mask: bool = True) -> Any:
    """Run a transformers model's norms, gated MLPs, RoPE and loss through torchport kernels.

    The family comes from ``model.config.model_type`` (see :func:`supported`); PEFT wrappers are looked through.
    Module forwards are replaced on this instance only (classes, parameters and ``state_dict`` are untouched),
    except ``rope``: transformers calls ``apply_rotary_pos_emb`` as a module-level function, so it is replaced in
    the family's modeling module until the last model holding it is unpatched. Patching again re-applies with the
    new flags. Thread-safe.

    Args:
        model: a transformers model of a supported family, or a PEFT model wrapping one.
        rms_norm: RMSNorm modules -> :func:`torchport.kernels.rms_norm` (in place where safe, see the table).
        rope: ``apply_rotary_pos_emb`` -> :func:`torchport.kernels.rope`.
        swiglu, geglu: gated MLPs whose activation is SiLU / tanh-GELU -> the fused kernel.
        cross_entropy: the causal LM's loss -> :func:`torchport.kernels.cross_entropy` (logits still made).
        fused_linear_cross_entropy: in training with labels, the loss straight from the final hidden states and
            ``lm_head`` without logits (``output.logits`` is None then), soft-capped as the model soft-caps its
            logits (Gemma 2's ``final_logit_softcapping``); evaluation and generation are unchanged. Not applied
            to a LoRA-wrapped ``lm_head``.
        causal_mask: under ``torch.compile``, a causal attention mask with no padding, no sliding window and no
            cache offset is left to SDPA's ``is_causal`` instead of being built as a tensor, as transformers already
            does in eager mode (:func:`torchport.models.ops.make_sdpa_masks`; shared by every model, like ``rope``).

    The losses are float32, as transformers' own. A patched model pickles, saves (``torch.save``) and
    deep-copies as a patched model: the copy runs the same kernels and is unpatched on its own.

    Returns:
        ``model`` itself.

    Example:
        >>> model = torchport.patch(AutoModelForCausalLM.from_config(config))
    """
    flags = _flags(dict(rms_norm=rms_norm, rope=rope, swiglu=swiglu, geglu=geglu, cross_entropy=cross_entropy,
                        fused_linear_cross_entropy=fused_linear_cross_entropy, causal_mask=causal_mask))
    inner = _unwrap(model)
    family = _family(getattr(inner.config, "model_type", None))
    with _lock:
        _unpatch_model(inner)
        journal = Journal()
        put = journal.set
        model_type = inner.config.model_type
        norm_cls = _resolve(family, family.norm.cls)
        mlp_cls = _resolve(family, family.mlp.cls)
        glus = frozenset(op for op in ("swiglu", "geglu") if flags[op])
        counts = {"rms_norm": 0, "mlp": 0}
        for name, module in inner.named_modules():
            if flags["rms_norm"] and _defines_forward(module, norm_cls):
                in_place = name.rsplit(".", 1)[-1] not in family.norm.residual_outputs
                put(module, _forward_slot(module), _Forward(module, _Recipe("norm", model_type, in_place)))
                counts["rms_norm"] += 1
            elif glus and _defines_forward(module, mlp_cls):
                if ops.gated_kernel(getattr(module, family.mlp.act, None)) in glus:
                    put(module, _forward_slot(module), _Forward(module, _Recipe("mlp", model_type, glus)))
                    counts["mlp"] += 1
                else:
                    logger.info("torchport.patch: %s keeps its MLP (activation %s has no gated kernel here)",
                                name, type(getattr(module, family.mlp.act, None)).__name__)
        lm_cls = _resolve(family, family.causal_lm)
        if _defines_forward(inner, lm_cls):
            if flags["cross_entropy"]:
                put(inner, "_loss_function", ops.causal_lm_loss)  # what the loss_function property returns
            if flags["fused_linear_cross_entropy"]:
                put(inner, _forward_slot(inner), _Forward(inner, _Recipe("causal_lm", model_type)))
        shared = []
        if flags["rope"] and _hold_shared(family.module, family.rope, id(inner)):
            shared.append((family.module, family.rope))
        if flags["causal_mask"] and _hold_shared(*_MASKS, id(inner)):
            shared.append(_MASKS)
        inner.__dict__["_torchport_patch"] = _Record(inner, journal, shared)
        logger.info("torchport.patch: %s (%s): %d norms, %d MLPs, flags %s", type(inner).__name__,
                    inner.config.model_type, counts["rms_norm"], counts["mlp"],
                    ", ".join(flag for flag, on in flags.items() if on))
    return model


def patch_transformers(model_type: str | None = None, **flags: bool) -> list[str]:
    """Patch transformers' classes for one family (or every supported one): every model of it, built before or
    after, runs the kernels, and :func:`unpatch` (with no model) restores them.

    Norms are patched at the class level, where a norm does not know its place in the layer: for families with
    norms feeding the residual stream (``residual_outputs`` in the table) every norm then runs with
    ``in_place=False``. Flags as for :func:`patch`.

    Returns:
        The families patched.

    Example:
        >>> torchport.patch_transformers("llama")
        ['llama']
        >>> model = AutoModelForCausalLM.from_config(LlamaConfig(...))   # built with torchport forwards
    """
    chosen = supported() if model_type is None else [model_type]
    families = {name: _family(name) for name in chosen}
    flags = _flags(flags)
    glus = frozenset(op for op in ("swiglu", "geglu") if flags[op])
    with _lock:
        for name, family in families.items():
            holder = ("transformers", name)
            _release(holder)  # patching again applies the new flags
            module = importlib.import_module(family.module)
            if flags["rms_norm"]:
                in_place = not family.norm.residual_outputs
                _hold(_resolve(family, family.norm.cls), "forward",
                      lambda _: ops.make_norm_forward(family.norm, in_place), holder)
            if glus:
                _hold(_resolve(family, family.mlp.cls), "forward",
                      lambda original: ops.make_mlp_forward(family.mlp, glus, original), holder)
            if flags["rope"]:
                _hold(module, family.rope, ops.make_rope, holder)
            if flags["causal_mask"]:
                _hold_shared(*_MASKS, holder)
            lm_cls = _resolve(family, family.causal_lm)
            if flags["cross_entropy"]:
                # The loss_function property returns self._loss_function when there is one; a staticmethod keeps
                # the class attribute from binding self.
                _hold(lm_cls, "_loss_function", lambda _: staticmethod(ops.causal_lm_loss), holder)
            if flags["fused_linear_cross_entropy"]:
                _hold(lm_cls, "forward",
                      lambda original: ops.make_fused_linear_forward(original, family.softcap, family.base), holder)
    logger.info("torchport.patch_transformers: %s", ", ".join(families))
    return list(families)


def patched_families() -> list[str]:
    """The families whose transformers classes :func:`patch_transformers` has patched now.

    Example:
        >>> torchport.patch_transformers("llama"); torchport.models.patched_families()
        ['llama']
    """
    with _lock:
        holders = _shared.holders()
    return sorted(name for kind, name in (h for h in holders if isinstance(h, tuple)) if kind == "transformers")


def unpatch_transformers(model_type: str | None = None) -> list[str]:
    """Undo :func:`patch_transformers` for one family (or every family), leaving models patched by :func:`patch`
    as they are. Safe to call when the family is not patched.

    Returns:
        The families that were patched and no longer are.

    Example:
        >>> torchport.models.unpatch_transformers("llama")
        ['llama']
    """
    if model_type is not None:
        _family(model_type)  # an unknown family is an error that lists the supported ones
    chosen = supported() if model_type is None else [model_type]
    with _lock:
        before = set(patched_families())
        for name in chosen:
            _release(("transformers", name))
    return sorted(before & set(chosen))


def _unpatch_model(inner: nn.Module) -> None:
    record = inner.__dict__.pop("_torchport_patch", None)
    failures = []
    if record is not None:
        failures = record.journal.restore()
        record.finalizer.detach()
    _release(id(inner))
    _models.discard(inner)
    if failures:
        raise RuntimeError(f"torchport.unpatch: {type(inner).__name__} could not get back: {'; '.join(failures)}")


def unpatch(model: Any = None) -> Any:
    """Undo :func:`patch` on ``model``, or, with no model, undo every patch: each model patched by :func:`patch`
    and :func:`patch_transformers`. Originals come back by identity. Safe to call when nothing is patched.

    Returns:
        ``model`` (None when none was given).

    Example:
        >>> torchport.unpatch(model)
        >>> torchport.unpatch()        # everything, transformers classes included
    """
    with _lock:
        if model is not None:
            _unpatch_model(_unwrap(model))
            return model
        for inner in list(_models):
            _unpatch_model(inner)
        for name in FAMILIES:
            _release(("transformers", name))
    return None


def is_patched(model: Any = None) -> bool:
    """Whether ``model`` is patched by :func:`patch`, or, with no model, whether anything is patched."""
    with _lock:
        if model is None:
            return bool(_shared) or len(_models) > 0
        return "_torchport_patch" in _unwrap(model).__dict__
