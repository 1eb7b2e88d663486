"""A ``torch.nn.Module`` to an ONNX file, checked by ``onnx.checker`` and by onnxruntime against PyTorch.

Which exporter writes which opset (measured with torch 2.13 on CPU; torch 2.9 to 2.13 have both exporters):

============  =========================================================================================
opset 11–17   the TorchScript-based exporter, ``torch.onnx.export(..., dynamo=False)``: deprecated since
              torch 2.9 but the only one that writes these opsets. Asked for opset 13, the torch.export-based
              exporter writes opset 18 anyway: its down-conversion fails on a plain CNN and it keeps the
              model unchanged. ATC reads opsets 9–18.
opset 18+     the torch.export-based exporter, ``dynamo=True`` (needs onnxscript); it covers more operators
              (a tiny Llama from transformers 5 exports only with it when no attention mask is passed:
              the TorchScript exporter has no ``aten::diff``).
============  =========================================================================================

On a torch without the TorchScript exporter, opsets below 18 are made by the torch.export-based exporter at 18
and ``onnx.version_converter``, and the result must pass ``onnx.checker`` with full checks and the onnxruntime
comparison. That converter has no down-adapter for many operators (Relu 14, Shape 15: measured with onnx 1.23),
so expect most models to be refused there, with the converter's reason.

How the model and its inputs become the graph's inputs and outputs is :mod:`torchport.export.graph`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import math
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..device import DeviceLike
from ..verify.structure import map_tensors
from .graph import Graph, batch_of, cast, default_output_names, prepared, tensor_inputs, tile
from .report import Check, ExportReport, GraphInput
from .runtime import require, session

__all__ = ["DTYPES", "DYNAMO_MIN_OPSET", "ExportError", "MIN_OPSET", "TOLERANCES", "graph_feeds", "onnx"]

logger = logging.getLogger("torchport")

MIN_OPSET = 11
#: The first opset written by the torch.export-based exporter; lower ones come from the TorchScript-based one.
DYNAMO_MIN_OPSET = 18
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16}
#: dtype -> (rtol, atol). A check passes when ‖ort − torch‖₂ / ‖torch‖₂ <= rtol or max |ort − torch| <= atol.
#: Measured on CPU (onnxruntime 1.32, torch 2.13, both exporters): fp32 relative errors 7e-8 (a small CNN) to
#: 1.4e-7 (a 2-layer Llama); fp16 2.8e-4 (the CNN) to 6.1e-4 (the Llama), as onnxruntime computes fp16 in fp16
#: where PyTorch's CPU kernels accumulate in fp32.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-2, 1e-3)}

_TORCHSCRIPT = "the TorchScript-based exporter (torch.onnx.export(dynamo=False))"
_DYNAMO = "the torch.export-based exporter (torch.onnx.export(dynamo=True))"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TWO_GIB = 2**31


class ExportError(RuntimeError):
    """The model could not be exported, or the written file was refused by ``onnx.checker``."""


def onnx(model: torch.nn.Module, example_inputs: Any, path: str | os.PathLike[str], *, opset: int = 18,
         dynamic_batch: bool = False, dtype: str | torch.dtype = "fp32", input_names: Sequence[str] | None = None,
         output_names: Sequence[str] | None = None, device: DeviceLike = "cpu", rtol: float | None = None,
         atol: float | None = None) -> ExportReport:
    """Export ``model`` called on ``example_inputs`` to an ONNX file at ``path``, check it with ``onnx.checker``,
    run it in onnxruntime on the same inputs and compare with PyTorch.

    The model is exported from the CPU in eval mode (a copy is cast or moved when it is elsewhere or in another
    dtype; the caller's model is left as it was). Inputs are passed as :func:`torchport.verify` passes them: a
    tensor as the one argument, a tuple as positional arguments, a dict as keyword arguments; each tensor becomes a
    graph input, other values are fixed into the graph. Every tensor in the output (a tensor, tuple, dict or
    Hugging Face ModelOutput) becomes a graph output.

    Args:
        opset: the ONNX opset; 11–17 use the TorchScript-based exporter, 18 and newer the torch.export-based one.
        dynamic_batch: mark dim 0 dynamic in every input and output whose dim 0 is the batch (the first dim of the
            first tensor input); the file is then also checked at one more batch size.
        dtype: ``"fp32"`` or ``"fp16"``: the precision of the weights and floating-point inputs of the graph.
        input_names: graph input names (default: the dict keys, else the forward's argument names, else input_0...).
        output_names: graph output names (default: from the output's structure: ``logits``, ``output_0``...).
        device: where onnxruntime runs the check (its execution provider as :func:`session` picks it).
        rtol, atol: the tolerances of the check (default: :data:`TOLERANCES` for the dtype).

    Returns:
        An :class:`ExportReport`; ``report.ok`` says whether onnxruntime agreed with PyTorch within tolerance.

    Raises:
        ExportError: the exporter failed (the message names the operator or construct and the exporter tried), or
            ``onnx.checker`` refused the file.
        ImportError: onnx, onnxruntime (or onnxscript, for opset 18+) is missing.

    Example:
        >>> report = torchport.export.onnx(model, torch.randn(1, 3, 224, 224), "model.onnx", opset=15,
        ...                                dynamic_batch=True)
        >>> report.ok, report.max_abs_error
    """
    require("onnx", "to check the exported model")
    require("onnxruntime", "to compare the exported model with PyTorch")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"export.onnx needs a torch.nn.Module, got {type(model).__name__}")
    opset = _check_opset(opset)
    target_dtype = _check_dtype(dtype)
    rtol, atol = _tolerance(target_dtype, rtol, atol)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"export path {path!r}: folder {folder!r} does not exist")
    use_dynamo = opset >= DYNAMO_MIN_OPSET or not _torchscript_exporter_available()
    if use_dynamo:
        require("onnxscript", "for torch's torch.export-based ONNX exporter")

    graph_model, restore = prepared(model, target_dtype)
    try:
        inputs = map_tensors(lambda t: cast(t, target_dtype), example_inputs)
        names, tensors, call = tensor_inputs(model, inputs)
        names = _check_names(list(input_names) if input_names is not None else names, len(tensors), "input_names")
        graph = Graph(graph_model, call).eval()
        with torch.no_grad():
            raw = call(graph_model, tensors)
        reference = Graph.flatten(raw)
        if not reference:
            raise ValueError(f"{type(model).__name__} returned no tensor (a {type(raw).__name__}); an ONNX graph "
                             "needs at least one tensor output")
        outputs = _check_names(list(output_names) if output_names is not None else default_output_names(raw),
                               len(reference), "output_names")
        batch = batch_of(tensors)
        dynamic = [dynamic_batch and batch is not None and t.dim() > 0 and t.shape[0] == batch for t in tensors]
        if dynamic_batch and not any(dynamic):
            raise ValueError("dynamic_batch=True but no input tensor has a batch dimension to make dynamic")
        export_tensors = tensors
        if any(dynamic) and batch == 1:  # torch.export fixes a dimension of size 1; trace with two rows
            export_tensors = tile(tensors, dynamic, 2)
        out_dynamic = [any(dynamic) and r.dim() > 0 and r.shape[0] == batch for r in reference]
        # Every PyTorch result is computed before exporting: the TorchScript exporter puts modules back in the
        # training mode it found on the wrapper, which would change what BatchNorm and Dropout compute afterwards.
        cases = [(batch, tensors, reference)]
        if any(dynamic):
            more = tile(tensors, dynamic, batch + 1)
            with torch.no_grad():
                cases.append((batch + 1, more, graph(*more)))
        notes = _export(graph, export_tensors, path, opset, names, outputs, dynamic, out_dynamic, use_dynamo,
                        type(model).__name__)
        exporter = (_TORCHSCRIPT if not use_dynamo else _DYNAMO if opset >= DYNAMO_MIN_OPSET
                    else f"{_DYNAMO} at opset {DYNAMO_MIN_OPSET} and onnx.version_converter")
        _check_file(path, opset)

        sess = session(path, device)
        checks = [_compare(sess, names, case_inputs, expected, size, rtol, atol)
                  for size, case_inputs, expected in cases]
    finally:
        restore()
    graph_inputs = tuple(GraphInput(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), flag)
                         for name, t, flag in zip(names, tensors, dynamic))
    report = ExportReport(path=path, opset=opset, exporter=exporter, dtype=str(target_dtype).removeprefix("torch."),
                          inputs=graph_inputs, outputs=tuple(outputs), provider=sess.get_providers()[0], rtol=rtol,
                          atol=atol, checks=tuple(checks), notes=tuple(notes))
    if not report.ok:
        logger.warning("export: onnxruntime differs from PyTorch beyond tolerance: relative error %.3g (rtol %g), "
                       "max abs error %.3g (atol %g)", report.rel_error, rtol, report.max_abs_error, atol)
    return report


# -- arguments -------------------------------------------------------------------------------------------------------
def _check_opset(opset: Any) -> int:
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < MIN_OPSET:
        raise ValueError(f"opset={opset!r} is not supported; give an ONNX opset >= {MIN_OPSET} (ATC reads 9 to 18; "
                         f"{DYNAMO_MIN_OPSET} and newer use torch's torch.export-based exporter)")
    return opset


def _check_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is not an export dtype; valid: {', '.join(DTYPES)}")


def _tolerance(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    for name, given in (("rtol", rtol), ("atol", atol)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, (int, float)) or given < 0):
            raise ValueError(f"{name}={given!r} is not a tolerance; give a number >= 0, or None for the default")
    default_rtol, default_atol = TOLERANCES[dtype]
    return (default_rtol if rtol is None else float(rtol)), (default_atol if atol is None else float(atol))


def _check_names(names: list[str], count: int, option: str) -> list[str]:
    if len(names) != count:
        raise ValueError(f"{option} has {len(names)} name(s) ({', '.join(names) or 'none'}) but the graph has {count}")
    bad = [name for name in names if not isinstance(name, str) or not name]
    if bad:
        raise ValueError(f"{option}: {bad!r} are not names; give non-empty strings")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{option}: {', '.join(repeated)} given more than once; graph names must be unique")
    return names


# -- exporting -------------------------------------------------------------------------------------------------------
def _torchscript_exporter_available() -> bool:
    return any(importlib.util.find_spec(name) is not None
               for name in ("torch.onnx._internal.torchscript_exporter", "torch.onnx.utils"))


def _export(graph: Graph, tensors: list[torch.Tensor], path: str, opset: int, names: list[str], outputs: list[str],
            dynamic: list[bool], out_dynamic: list[bool], use_dynamo: bool, model_name: str) -> list[str]:
    """Write the file; returns notes (values the TorchScript tracer fixed into the graph)."""
    if use_dynamo:
        label = f"{_DYNAMO}, opset {max(opset, DYNAMO_MIN_OPSET)}"
    else:
        label = f"{_TORCHSCRIPT}, opset {opset}"
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught, _quiet():
            warnings.simplefilter("always")
            if use_dynamo:
                _export_dynamo(graph, tensors, path, opset, names, outputs, dynamic)
            else:
                axes = {name: {0: "batch"} for name, flag in zip(names, dynamic) if flag}
                axes.update({name: {0: "batch"} for name, flag in zip(outputs, out_dynamic) if flag})
                torch.onnx.export(graph, tuple(tensors), path, dynamo=False, opset_version=opset, input_names=names,
                                  output_names=outputs, dynamic_axes=axes or None)
    except ExportError:
        raise
    except Exception as exc:
        raise ExportError(f"{label} could not export {model_name}: {_construct(exc)}. {_hint(use_dynamo, opset)}") \
            from exc
    notes = []
    for warning in caught:
        if type(warning.message).__name__ == "TracerWarning":
            text = f"the TorchScript tracer fixed a value into the graph ({str(warning.message).split('.')[0]})"
            if text not in notes:
                notes.append(text)
    return notes


def _export_dynamo(graph: Graph, tensors: list[torch.Tensor], path: str, opset: int, names: list[str],
                   outputs: list[str], dynamic: list[bool]) -> None:
    onnx_module = require("onnx", "to write the model")
    batch = torch.export.Dim("batch")
    shapes = (tuple({0: batch} if flag else None for flag in dynamic),) if any(dynamic) else None
    size = sum(p.numel() * p.element_size() for p in graph.parameters())
    program = torch.onnx.export(graph, tuple(tensors), None, dynamo=True, opset_version=max(opset, DYNAMO_MIN_OPSET),
                                input_names=names, output_names=outputs, dynamic_shapes=shapes, verbose=False)
    if opset >= DYNAMO_MIN_OPSET:
        program.save(path, external_data=size >= _TWO_GIB)
        return
    from onnx import version_converter

    try:
        converted = version_converter.convert_version(program.model_proto, opset)
        onnx_module.checker.check_model(converted, full_check=True)
    except Exception as exc:
        raise ExportError(f"this torch ({torch.__version__}) has no TorchScript-based ONNX exporter, and "
                          f"onnx.version_converter could not bring the opset-{DYNAMO_MIN_OPSET} export down to opset "
                          f"{opset}: {_construct(exc)}. Export at opset {DYNAMO_MIN_OPSET} or newer (not readable by "
                          "ATC), or export with a torch that still has the TorchScript exporter (2.9 to 2.13)") from exc
    onnx_module.save(converted, path)


@contextlib.contextmanager
def _quiet() -> Any:
    """The exporters print progress to stdout and log about optional packages; a library keeps quiet."""
    names = ("torch.onnx", "torch.onnx._internal.exporter._registration", "torch.export")
    loggers = [logging.getLogger(name) for name in names]
    levels = [item.level for item in loggers]
    for item in loggers:
        item.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for item, level in zip(loggers, levels):
            item.setLevel(level)


def _construct(exc: BaseException) -> str:
    """The operator or construct an exporter failed on: the innermost cause's first line, and where the model's
    code raised it when the exporter says so."""
    inner = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    text = _ANSI.sub("", str(inner)).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    described = f"{type(inner).__name__}: {first}" if first else type(inner).__name__
    where = re.search(r"The following call raised this error:\s*\n\s*(File [^\n]+)\n\s*([^\n]+)",
                      _ANSI.sub("", str(exc)))
    if where:
        described += f" (at {where.group(1).strip()}: {where.group(2).strip()})"
    return described


def _hint(use_dynamo: bool, opset: int) -> str:
    if use_dynamo:
        return ("torch.export follows the model's Python code: control flow that depends on tensor values, and "
                "operators without an ONNX translation, stop it (see "
                "https://pytorch.org/docs/stable/generated/exportdb/index.html). Opsets 11 to 17 use the "
                "TorchScript-based exporter, which traces one path instead")
    return (f"Rewrite that part with operators ONNX opset {opset} has, or export at opset {DYNAMO_MIN_OPSET} or "
            "newer, where torch's torch.export-based exporter covers more operators (ATC reads opsets 9 to 18)")


def _check_file(path: str, opset: int) -> None:
    onnx_module = require("onnx", "to check the exported model")
    try:
        onnx_module.checker.check_model(path, full_check=True)
    except Exception as exc:
        raise ExportError(f"onnx.checker refused {path}: {_construct(exc)}") from exc
    written = next((entry.version for entry in onnx_module.load(path, load_external_data=False).opset_import
                    if entry.domain in ("", "ai.onnx")), None)
    if written != opset:
        raise ExportError(f"asked for ONNX opset {opset}, the exporter wrote opset {written} to {path}")


# -- checking --------------------------------------------------------------------------------------------------------
def _compare(sess: Any, names: list[str], tensors: list[torch.Tensor], reference: tuple[torch.Tensor, ...],
             batch: int | None, rtol: float, atol: float) -> Check:
    import numpy as np

    feeds = {name: t.numpy() for name, t in zip(names, tensors)}
    got = sess.run(None, feeds)
    max_abs, rel = 0.0, 0.0
    for ours, theirs in zip(got, reference):
        expected = theirs.detach().to(torch.float64).numpy() if theirs.is_floating_point() \
            else theirs.detach().numpy().astype(np.float64)
        actual = np.asarray(ours).astype(np.float64)
        if actual.shape != expected.shape:
            return Check(batch, math.inf, math.inf, False)
        diff = np.abs(actual - expected)
        max_abs = max(max_abs, float(diff.max()) if diff.size else 0.0)
        scale = float(np.linalg.norm(expected))
        error = float(np.linalg.norm(actual - expected))
        rel = max(rel, error / scale if scale > 0 else (0.0 if error == 0 else math.inf))
    ok = (rel <= rtol or max_abs <= atol) and math.isfinite(max_abs)
    return Check(batch, max_abs, rel, ok)


def graph_feeds(model: torch.nn.Module, inputs: Any, names: Sequence[str], dtype: str | torch.dtype = "fp32") -> dict:
    """The onnxruntime feeds (name -> NumPy array) for ``inputs`` as :func:`onnx` turned them into graph inputs.

    Example:
        >>> sess.run(None, graph_feeds(model, torch.randn(4, 3, 32, 32), [i.name for i in report.inputs]))
    """
    target = _check_dtype(dtype)
    _, tensors, _ = tensor_inputs(model, map_tensors(lambda t: cast(t, target), inputs))
    return {name: t.numpy() for name, t in zip(_check_names(list(names), len(tensors), "names"), tensors)}
