"""The nested values modules take and return: tensors inside tuples, lists, dicts and Hugging Face ModelOutputs.

A value is walked into ``(path, leaf)`` pairs, where a path reads like Python: ``""`` for the value itself,
``"[0]"`` for a tuple or list entry, ``".logits"`` for a mapping key (``"['a b']"`` when the key is not a name).
Tuples, lists and mappings (dicts, ``ModelOutput``, ``BatchEncoding``) are entered; every other object is a leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["call_model", "leaves", "map_tensors", "signature"]


def _key_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if isinstance(key, str) and key.isidentifier() else f"{path}[{key!r}]"


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of ``value`` with its path, in order.

    Example:
        >>> list(leaves((torch.ones(2), {"a": None})))
        [('[0]', tensor([1., 1.])), ('[1].a', None)]
    """
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from leaves(item, _key_path(path, key))
    else:
        yield path, value


def signature(value: Any) -> dict[str, str]:
    """Path -> kind of every leaf (``"tensor"``, ``"None"``, or the leaf's type name), to compare two structures.

    Example:
        >>> signature((torch.ones(2), None))
        {'[0]': 'tensor', '[1]': 'None'}
    """
    out = {}
    for path, leaf in leaves(value):
        out[path] = "tensor" if isinstance(leaf, torch.Tensor) else "None" if leaf is None else type(leaf).__name__
    return out


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """Rebuild ``value`` with ``fn`` applied to every tensor; mappings become plain dicts, named tuples stay named.

    Example:
        >>> map_tensors(lambda t: t * 2, {"x": torch.ones(1), "n": 3})
        {'x': tensor([2.]), 'n': 3}
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [map_tensors(fn, item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [map_tensors(fn, item) for item in value]
    if isinstance(value, Mapping):
        return {key: map_tensors(fn, item) for key, item in value.items()}
    return value


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    """Call ``model`` the way torchport passes inputs: a tensor as the one argument, a tuple or list as positional
    arguments, a mapping as keyword arguments (anything else as the one argument).

    Example:
        >>> call_model(torch.nn.Linear(2, 3), torch.ones(1, 2)).shape
        torch.Size([1, 3])
    """
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)
