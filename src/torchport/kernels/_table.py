"""The table of ``torchport kernels``: per op and device, the implementation a call would use now and why no
faster one runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _settings
from . import registry

__all__ = ["table"]


def table(devices: Sequence[torch.device] | None = None) -> list[dict[str, Any]]:
    """One row per op and device: the implementation a call would use now, and in ``notes`` why no faster one runs
    (forced by ``TORCHPORT_KERNELS``, a library or vendor operator missing, another device type only, or the chosen
    one is the fastest there is).

    ``devices`` defaults to the CPU and the first device of every accelerator present.

    Example:
        >>> table([torch.device("cpu")])[0]["notes"][0]
        'reference is the only implementation for cpu'
    """
    registry._ensure_loaded()
    if devices is None:
        from ..device import devices as present

        seen: dict[str, torch.device] = {}
        for dev in [torch.device("cpu"), *present()]:
            seen.setdefault(dev.type, dev)
        devices = list(seen.values())
    rows = []
    for op in sorted(registry._ops):
        impls = sorted(registry._ops[op].values(), key=lambda i: -i.priority)
        for dev in devices:
            try:
                impl = registry.select(op, dev, quiet=True)
                chosen, notes = impl.name, _why_not_faster(op, impls, dev, impl)
            except registry.KernelError as exc:
                chosen, notes = "error", [str(exc)]
            rows.append({
                "op": op,
                "device": str(dev),
                "implementation": chosen,
                "candidates": [impl.name for impl in impls if impl.serves(dev.type)],
                "notes": notes,
            })
    return rows


def _why_not_faster(op: str, impls: Sequence[registry.Implementation], device: torch.device,
                    chosen: registry.Implementation) -> list[str]:
    """Why ``chosen``, and no implementation ranked above it, runs ``op`` on ``device``: one note per reason.

    ``impls`` are all of the op's implementations, highest priority first.
    """
    mode, forced = registry._mode(op)
    serving = [impl for impl in impls if impl.serves(device.type)]
    reference = next(impl for impl in impls if impl.name == "reference")
    auto = next((impl for impl in serving if registry._available(impl, device) is None), reference)
    notes = []
    if forced:
        overrides = _settings.value("kernels")
        notes.append(f"forced by TORCHPORT_KERNELS ({op}={mode})" if op in overrides
                     else f"forced by TORCHPORT_KERNELS={mode}")
        if auto is not chosen:
            notes.append(f"auto mode would use {auto.name}")
    above = [impl for impl in impls if impl.priority > chosen.priority]
    notes += [f"{impl.name}: {registry._available(impl, device)}" for impl in above
              if impl.serves(device.type) and registry._available(impl, device) is not None]
    if not forced and chosen is serving[0]:
        notes.append(f"{chosen.name} is the only implementation for {device.type}" if len(serving) == 1
                     else f"{chosen.name} is already the fastest implementation for {device.type}")
    notes += [f"{impl.name} runs on {', '.join(sorted(impl.devices or ()))} only" for impl in above
              if not impl.serves(device.type)]
    return notes
