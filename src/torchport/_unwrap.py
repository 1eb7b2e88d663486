"""The transformers model inside PEFT-style wrappers (``wrapper.base_model.model``), for models/ and modes/."""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["peel", "transformers_model"]


def _pretrained() -> type | tuple[()]:
    # Never imports transformers: a model of it would have imported it.
    module = sys.modules.get("transformers")
    return () if module is None else module.PreTrainedModel


def peel(model: Any) -> Any:
    """``model`` without its PEFT-style wrappers: ``base_model.model`` is followed, at any depth, until a
    transformers ``PreTrainedModel`` or an object that wraps no module.

    Example:
        >>> peel(get_peft_model(llama, lora_config)) is llama
        True
    """
    pretrained = _pretrained()
    seen: set[int] = set()
    while not isinstance(model, pretrained) and id(model) not in seen:
        seen.add(id(model))
        inner = getattr(getattr(model, "base_model", None), "model", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def transformers_model(model: Any) -> nn.Module | None:
    """The transformers ``PreTrainedModel`` that ``model`` is or wraps (see :func:`peel`), or None.

    Example:
        >>> transformers_model(torch.nn.Linear(2, 2)) is None
        True
    """
    pretrained = _pretrained()
    inner = peel(model) if pretrained else None
    return inner if pretrained and isinstance(inner, pretrained) else None
