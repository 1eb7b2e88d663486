"""Libraries that check the device themselves before the program's CUDA path can run, adapted to the target when the
program imports them (:func:`hooks`, applied by the import guard of :mod:`.cuda_only`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .redirect import Patcher, Target

__all__ = ["hooks"]


def hooks(target: Target, patcher: Patcher) -> dict[str, Callable[[Any], None]]:
    """Module name -> the adaptation to make once that module is loaded, for this target."""
    found: dict[str, Callable[[Any], None]] = {}
    if target.host:
        found["transformers.training_args"] = lambda module: _trainer_on_the_host(target, patcher, module)
    return found


def _trainer_on_the_host(target: Target, patcher: Patcher, module: Any) -> None:
    """Hugging Face's ``TrainingArguments`` refuses ``bf16=True`` without a GPU unless ``use_cpu=True`` ("Your setup
    doesn't support bf16/gpu"), so a Trainer script written for CUDA stopped there on the CPU target. The target is
    the host: the Trainer runs there (accelerate's CPU path, bf16 autocast included), as ``use_cpu=True`` asks."""
    cls = getattr(module, "TrainingArguments", None)
    if cls is None or "use_cpu" not in getattr(cls, "__dataclass_fields__", {}):
        return  # a release without the field: nothing known to adapt
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.use_cpu:
            target.recorder.record("TrainingArguments(use_cpu=True)")
            self.use_cpu = True
        return original(self, *args, **kwargs)

    with patcher.lock:
        patcher.set(cls, "__post_init__", __post_init__)
