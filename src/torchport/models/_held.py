"""What :func:`torchport.patch` holds: the shared attributes it replaces (a family's rope function, the SDPA mask
table, classes' forwards under :func:`torchport.patch_transformers`) with who holds each, and the per-model record
and replaced forwards, which pickle and deep-copy as the recipes that made them.

Names here keep the leading underscore they had in :mod:`torchport.models`, which re-exports them: models pickled
by earlier versions refer to ``torchport.models._Forward``, ``_Recipe``, ``_Record`` and ``_restore_record``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from .._patching import Journal, SharedPatches
from . import ops
from .families import FAMILIES, Family

_MASKS = ("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS")  # the table of attention-mask functions

_lock = threading.RLock()
# Shared attributes (a class's forward, a module's function) -> original value and who holds the patch:
# ("transformers", family) for patch_transformers, the id of a model for patch(model, rope=True).
_shared = SharedPatches()
_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()


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


def _original(cls: type, attr: str = "forward") -> Any:
    """``cls.attr`` as transformers defines it, even while patch_transformers holds it."""
    return _shared.original(cls, attr)
