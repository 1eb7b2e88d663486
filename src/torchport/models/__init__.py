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

import dataclasses
import functools
import importlib
import inspect
import logging
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from .._patching import MISSING, Journal, SharedPatches
from . import ops
from .families import FAMILIES, Family
from .._unwrap import peel

__all__ = ["FAMILIES", "is_patched", "patch", "patch_transformers", "patched_families", "supported", "unpatch",
           "unpatch_transformers"]

logger = logging.getLogger("torchport")

_MISSING = MISSING  # the name models pickled by earlier versions refer to
_FLAGS = ("rms_norm", "rope", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy", "causal_mask")
_MASKS = ("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS")  # the table of attention-mask functions
_KERNELS = {"cross_entropy": "cross_entropy", "fused_linear_cross_entropy": "fused_linear_cross_entropy"}

_lock = threading.RLock()
# Shared attributes (a class's forward, a module's function) -> original value and who holds the patch:
# ("transformers", family) for patch_transformers, the id of a model for patch(model, rope=True).
_shared = SharedPatches()
_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()


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


def _resolve(family: Family, name: str) -> Any:
    module = importlib.import_module(family.module)
    value = getattr(module, name, None)
    if value is None:
        import transformers

        raise RuntimeError(
            f"torchport.patch: {family.module} has no {name!r} in transformers {transformers.__version__}; "
            "this version's layout is not in torchport.models.families"
        )
    return value


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


def _hold(owner: Any, attr: str, make: Callable[[Any], Any], holder: Any) -> None:
    """Patch a shared attribute once (``make(original)`` -> replacement) and count ``holder`` among its users."""
    with _lock:
        _shared.hold(owner, attr, make, holder)


def _hold_shared(module_name: str, attr: str, holder: Any) -> bool:
    """Hold one shared patch, named as a :class:`_Record` keeps it: ``(module, attr)`` is the family's rope
    function, or :data:`_MASKS` for the SDPA mask (:func:`torchport.models.ops.make_sdpa_masks`, which wraps an
    entry of that table, held through the table's own entries). False when this transformers has no such thing."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    if (module_name, attr) != _MASKS:
        _hold(module, attr, ops.make_rope, holder)
        return True
    interface = getattr(module, attr, None)
    causal = getattr(module, "causal_mask_function", None)
    if not isinstance(getattr(interface, "_local_mapping", None), dict) or causal is None or "sdpa" not in interface:
        return False
    _hold(interface, "_local_mapping", lambda table: ops.make_sdpa_masks(table, interface, causal), holder)
    return True


def _release(holder: Any) -> None:
    with _lock:
        _shared.release(holder)


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """How one replaced forward is made from the table: ``kind`` is ``"norm"`` (``option``: in place),
    ``"mlp"`` (``option``: the gated kernels allowed) or ``"causal_lm"`` (the fused linear cross-entropy)."""

    kind: str
    model_type: str
    option: Any = None


@functools.lru_cache(maxsize=None)
def _make(recipe: _Recipe) -> Callable[..., Any]:
    family = FAMILIES[recipe.model_type]
    if recipe.kind == "norm":
        return ops.make_norm_forward(family.norm, recipe.option)
    if recipe.kind == "mlp":
        return ops.make_mlp_forward(family.mlp, recipe.option, _original(_resolve(family, family.mlp.cls)))
    return ops.make_fused_linear_forward(_original(_resolve(family, family.causal_lm)), family.softcap, family.base)


class _Forward:
    """A module's forward as :func:`patch` replaces it: ``__func__(__self__, ...)``, like a bound method (with the
    signature of one), that pickles and deep-copies as the recipe that made it. A bound method would pickle as
    ``getattr(module, "forward")``, which on loading finds the class's forward: a saved model would come back
    half patched, without a word."""

    __slots__ = ("__func__", "__self__", "recipe")

    def __init__(self, module: nn.Module, recipe: _Recipe) -> None:
        self.__self__, self.recipe = module, recipe
        self.__func__ = _make(recipe)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _Forward, (self.__self__, self.recipe)

    @property
    def __signature__(self) -> inspect.Signature:  # what inspect.signature(module.forward) reports (HF reads it)
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __repr__(self) -> str:
        return f"<torchport forward {self.__func__.__qualname__} of {type(self.__self__).__name__}>"


class _Record:
    """What :func:`patch` changed on one model: a journal of the attributes it set (``(owner, attr, previous
    value)``), and the shared patches it holds (rope: ``(module name, function name)``; the SDPA mask:
    :data:`_MASKS`). Kept in the model's ``__dict__``; a deep copy or an unpickled copy of the model (a reference
    model, an EMA copy, ``torch.load`` of a saved one) is a patched model of its own, with its own record and
    holds."""

    def __init__(self, model: nn.Module, journal: Journal, shared: list[tuple[str, str]]) -> None:
        self.journal, self.shared = journal, shared
        self.model = weakref.ref(model)
        # A model dropped without unpatch() still gives back its holds on shared attributes.
        self.finalizer = weakref.finalize(model, _release, id(model))
        _models.add(model)

    def __reduce__(self) -> tuple[Any, ...]:
        # The model is made (and memoised) before its __dict__, which holds this record, is copied or loaded: the
        # copy's modules own the saved entries, and the copy takes holds of its own.
        return _restore_record, (self.model(), self.journal.attrs(), self.shared)


def _restore_record(model: nn.Module, saved: list[tuple[Any, str, Any]], shared: list[tuple[str, str]]) -> _Record:
    with _lock:
        for module_name, attr in shared:
            _hold_shared(module_name, attr, id(model))
        return _Record(model, Journal(saved), list(shared))


def _unwrap(model: Any) -> nn.Module:
    """The transformers model inside PEFT-style wrappers (``wrapper.base_model.model``)."""
    inner = peel(model)
    if not isinstance(inner, nn.Module) or not hasattr(inner, "config"):
        raise TypeError(
            f"torchport.patch: expected a transformers model (or a PEFT wrapper of one), got {type(model).__name__}"
        )
    return inner


def _original(cls: type, attr: str = "forward") -> Any:
    """``cls.attr`` as transformers defines it, even while patch_transformers holds it."""
    return _shared.original(cls, attr)


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
