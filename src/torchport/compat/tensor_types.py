"""The legacy typed tensors of ``torch.cuda`` (``FloatTensor``, ``LongTensor``...) made on the target device.

Old CUDA code builds tensors with ``torch.cuda.FloatTensor(ndarray)``, ``torch.cuda.LongTensor(n)`` or
``torch.cuda.FloatTensor(2, 3)``, converts with ``t.type(torch.cuda.FloatTensor)`` (or the type's name as a string),
tests ``isinstance(t, torch.cuda.FloatTensor)`` and calls ``torch.set_default_tensor_type(torch.cuda.HalfTensor)``.
Each ``torch.cuda.<Name>Tensor`` becomes a class whose call makes a tensor of that dtype on the target, keeping the
constructor's overloads: integers or a ``torch.Size`` are a shape (uninitialised memory, ``torch.empty``), a
sequence or an array is data (copied, as onto a GPU), a tensor is converted; whose ``isinstance`` accepts a tensor
of that dtype on the target's device type; and which, as the default tensor type, sets the default dtype and the
target as the default device.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

from .redirect import Patcher, Target

__all__ = ["DTYPES", "install"]

#: the legacy names of torch.cuda's tensor types, and their dtypes
DTYPES = {
    "FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
    "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8, "BoolTensor": torch.bool,
}


def _is_shape(args: tuple[Any, ...]) -> bool:
    """Whether positional arguments are the sizes overload: integers (Python's or NumPy's) or one torch.Size."""
    if len(args) == 1 and isinstance(args[0], torch.Size):
        return True
    return bool(args) and all(_is_integer(a) for a in args)


def _is_integer(value: Any) -> bool:
    if isinstance(value, (bool, torch.Tensor)):
        return False
    try:
        operator.index(value)  # an int, a NumPy integer; not an array of several elements
    except TypeError:
        return False
    return True


def _tensor_type(target: Target, name: str, dtype: torch.dtype) -> type:
    api = f"torch.cuda.{name}"

    class _Kind(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, torch.Tensor) and obj.dtype == dtype and obj.device.type == target.type

        def __subclasscheck__(cls, sub: type) -> bool:
            return sub is cls

    def __new__(cls: type, *args: Any, device: Any = None, size: Any = None) -> torch.Tensor:  # noqa: N807
        target.recorder.record(api)
        where = target.device(None if device is None else target.index(device))
        if size is not None:
            args = (*args, *size)
        if not args:
            return torch.empty(0, dtype=dtype, device=where)
        if _is_shape(args):
            return torch.empty(*args, dtype=dtype, device=where)
        if len(args) > 1:
            raise TypeError(f"{api}(...) takes sizes (ints or a torch.Size) or one sequence, array or tensor of data; "
                            f"got {', '.join(type(a).__name__ for a in args)}")
        data = args[0]
        if isinstance(data, torch.Tensor):
            return data.to(where, dtype)  # the same tensor when it already is one of these, as on CUDA
        return torch.tensor(data, dtype=dtype, device=where)  # a copy, as a CUDA tensor made from host data is

    return _Kind(name, (), {"__new__": __new__, "__module__": "torch.cuda", "dtype": dtype,
                            "__doc__": f"{api}, made on the device the program runs on ({dtype})."})


def install(target: Target, patcher: Patcher) -> None:
    """Replace ``torch.cuda``'s legacy tensor types; ``Tensor.type`` converts to them on ``target`` and
    ``torch.set_default_tensor_type`` takes them."""
    types = {name: _tensor_type(target, name, dtype) for name, dtype in DTYPES.items()}
    for name, kind in types.items():
        patcher.set(torch.cuda, name, kind)
    by_name = {f"torch.cuda.{name}": kind for name, kind in types.items()}
    kinds = set(types.values())

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
            kind = by_name.get(dtype, dtype) if isinstance(dtype, str) else dtype
            if kind is None or kind not in kinds:
                return original(self, dtype, non_blocking, **kwargs)
            target.recorder.record("Tensor.type(torch.cuda)")
            non_blocking = kwargs.pop("async", non_blocking)
            return self.to(target.device(), kind.dtype, non_blocking=non_blocking)

        return type_

    patcher.wrap(torch.Tensor, "type", make)

    def default_type(original: Any) -> Any:
        @functools.wraps(original)
        def set_default_tensor_type(t: Any) -> None:
            kind = by_name.get(t, t) if isinstance(t, str) else t
            if kind not in kinds:
                return original(t)
            target.recorder.record("torch.set_default_tensor_type(torch.cuda)")
            torch.set_default_dtype(kind.dtype)  # refuses integer types, as torch does for them
            torch.set_default_device(target.device())
            return None

        return set_default_tensor_type

    patcher.wrap(torch, "set_default_tensor_type", default_type)
