"""Libraries that check the device themselves before the program's CUDA path can run (Hugging Face's
``TrainingArguments``, Lightning's ``Trainer`` and ``Fabric``), adapted to the target when the program imports them
(:func:`hooks`, applied by the import guard of :mod:`.cuda_only`)."""

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
        for name, cls in _LIGHTNING.items():
            found[name] = lambda module, cls=cls: _lightning_on_the_host(target, patcher, module, cls)
    return found


# Lightning's modules that define the classes a program names an accelerator in (both package layouts)
_LIGHTNING = {"lightning.pytorch.trainer.trainer": "Trainer", "pytorch_lightning.trainer.trainer": "Trainer",
              "lightning.fabric.fabric": "Fabric", "lightning_fabric.fabric": "Fabric"}


def _cpu_devices(devices: Any) -> Any:
    """Lightning's GPU ``devices`` (a count, ``-1`` for all, indices as a list or ``"0,1"``) as its CPU accelerator
    takes them: a number of processes, one per GPU asked for."""
    if isinstance(devices, (list, tuple)):
        return max(len(devices), 1)
    if isinstance(devices, str) and devices != "auto":
        text = devices.strip()
        if "," in text:
            return max(len([part for part in text.split(",") if part.strip()]), 1)
        return 1 if text in ("-1", "") else int(text) if text.isdigit() else devices
    if isinstance(devices, int) and devices < 1:
        return 1
    return devices


def _lightning_on_the_host(target: Target, patcher: Patcher, module: Any, name: str) -> None:
    """Lightning's ``Trainer(accelerator="gpu")`` / ``Fabric(accelerator="cuda")`` asks ``torch.cuda.is_available()``
    itself and stops ("No supported gpu backend found!") on the CPU target. There the program's accelerator becomes
    ``"cpu"`` and its GPUs as many CPU processes (Lightning itself then takes ``precision="16-mixed"`` as
    bf16-mixed, with its own warning)."""
    def adapted(original: Any) -> Any:
        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> Any:
            accelerator = kwargs.get("accelerator")
            if isinstance(accelerator, str) and accelerator.lower() in ("gpu", "cuda"):
                target.recorder.record(f"{name}(accelerator={accelerator!r})")
                kwargs["accelerator"] = "cpu"
                if "devices" in kwargs:
                    kwargs["devices"] = _cpu_devices(kwargs["devices"])
            return original(self, *args, **kwargs)

        return __init__

    if hasattr(module, name):
        with patcher.lock:  # at import time, on whichever thread imports the module
            patcher.wrap(getattr(module, name), "__init__", adapted)


def _trainer_on_the_host(target: Target, patcher: Patcher, module: Any) -> None:
    """Hugging Face's ``TrainingArguments`` refuses ``bf16=True`` without a GPU unless ``use_cpu=True`` ("Your setup
    doesn't support bf16/gpu"), so a Trainer script written for CUDA stopped there on the CPU target. The target is
    the host: the Trainer runs there (accelerate's CPU path, bf16 autocast included), as ``use_cpu=True`` asks."""
    cls = getattr(module, "TrainingArguments", None)
    if "use_cpu" not in getattr(cls, "__dataclass_fields__", {}):
        return  # a release without the field: nothing known to adapt

    def adapted(original: Any) -> Any:
        @functools.wraps(original)
        def __post_init__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.use_cpu:
                target.recorder.record("TrainingArguments(use_cpu=True)")
                self.use_cpu = True
            return original(self, *args, **kwargs)

        return __post_init__

    with patcher.lock:
        patcher.wrap(cls, "__post_init__", adapted)

