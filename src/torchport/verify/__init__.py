"""Prove a port is right: run a model on the target device and on a reference, module by module.

Example:
    >>> report = torchport.verify.compare(model, inputs, device="npu")
    >>> print(report)                     # one row per module call, in execution order
    >>> report.first_divergence           # the first module out of tolerance, or None
    >>> report.plot("verify.png")
"""

from __future__ import annotations

from .divergence import ModelError, StructureError, compare
from .hooks import ROOT, Recorder
from .report import LayerRow, Report
from .target import TargetError, load_target, unpack
from .tolerance import TOLERANCES, tolerance

__all__ = [
    "LayerRow",
    "ModelError",
    "ROOT",
    "Recorder",
    "Report",
    "StructureError",
    "TOLERANCES",
    "TargetError",
    "compare",
    "load_target",
    "tolerance",
    "unpack",
]
