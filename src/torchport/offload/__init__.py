"""Run models larger than device memory: weights on three tiers (device, pinned host memory, disk), copied to the
device ahead of use on a side stream, overlapping compute.

``torchport.offload`` is both this package and a function: ``torchport.offload(model, "8GiB")`` offloads,
``torchport.offload.plan(model, "8GiB")`` only plans. See :mod:`torchport.offload.pipeline` for how copies and
compute are ordered, and :mod:`torchport.offload.placement` for the memory bound.

Example:
    >>> model = torchport.offload(model, budget="8GiB", host_budget="32GiB", disk_dir="/nvme/tier")
    >>> torchport.offload.plan(model_on_cpu, 0.5).tiers()
    {'model.layers.0': 'device', ..., 'model.layers.31': 'host'}
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .budget import format_bytes, parse_budget
from .disk import open_tier, write_tier
from .placement import BlockPlacement, Placement, find_blocks
from .runtime import evict_disk_tier, offload, placement, plan
from .stack import measure_stack

__all__ = ["BlockPlacement", "Placement", "evict_disk_tier", "find_blocks", "format_bytes", "measure_stack",
           "offload", "open_tier", "parse_budget", "placement", "plan", "write_tier"]


class _CallableModule(types.ModuleType):
    """The module type of ``torchport.offload``: calling the module calls :func:`offload`.

    ``torchport.offload`` has to be a package (it holds ``plan``, ``placement``, the disk tier...) and is reached as
    an attribute of ``torchport``, so ``torchport.offload(model, budget)`` calls the package object itself; Python
    looks ``__call__`` up on the type, hence the subclass.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``torchport.offload(model, budget, ...)`` is :func:`torchport.offload.offload`."""
        return offload(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
