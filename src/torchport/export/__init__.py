"""Deploy a model: ONNX export checked against PyTorch in onnxruntime, sessions on the device's execution provider,
and the ATC command that compiles the file for an Ascend NPU.

Needs the export extra (``pip install "torchport[export]"``: onnx, onnxruntime, onnxscript), imported on first use.

Example:
    >>> report = torchport.export.onnx(model, x, "model.onnx", opset=15, dynamic_batch=True)
    >>> print(report)                       # opset, exporter, inputs, max abs and relative error against PyTorch
    >>> sess = torchport.export.session("model.onnx")          # CANN, CUDA or CPU provider for the device
    >>> script = torchport.export.write_atc_script("model.onnx", soc_version="Ascend910B1")
"""

from __future__ import annotations

from .atc import (ATC_OPSETS, DEFAULT_BATCH_SIZES, PRECISION_MODES, SOC_EXAMPLES, atc_command, check_opset,
                  graph_inputs, run_atc, soc_version, write_atc_script)
from .exporter import DTYPES, DYNAMO_MIN_OPSET, MIN_OPSET, TOLERANCES, ExportError, graph_feeds, onnx
from .report import Check, ExportReport, GraphInput
from .runtime import EXTRA, providers, require, session
from .timing import sweep_onnx

__all__ = ["ATC_OPSETS", "Check", "DEFAULT_BATCH_SIZES", "DTYPES", "DYNAMO_MIN_OPSET", "EXTRA", "ExportError",
           "ExportReport", "GraphInput", "MIN_OPSET", "PRECISION_MODES", "SOC_EXAMPLES", "TOLERANCES", "atc_command",
           "check_opset", "graph_feeds", "graph_inputs", "onnx", "providers", "require", "run_atc", "session", "soc_version",
           "sweep_onnx", "write_atc_script"]
