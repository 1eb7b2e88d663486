"""onnxruntime sessions with the execution provider of a device, and the lazy imports of the export extra.

Which provider runs a device type is the backend's answer (:attr:`torchport.backends.Backend.onnx_provider`); this
module knows each provider's package and options (:func:`device_providers`), checks what the installed onnxruntime
offers, and falls back to the CPU provider with one warning per missing provider.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any

from ..backends import Backend
from ..device import DeviceLike, resolve

__all__ = ["EXTRA", "device_providers", "onnxruntime_package", "providers", "require", "session"]

logger = logging.getLogger("torchport")

#: How to install what torchport.export needs.
EXTRA = 'pip install "torchport[export]"'

#: The onnxruntime package that has each device provider (the CPU provider is in every one).
PACKAGES = {"CPUExecutionProvider": "onnxruntime", "CUDAExecutionProvider": "onnxruntime-gpu",
            "MIGraphXExecutionProvider": "onnxruntime-migraphx", "CANNExecutionProvider": "onnxruntime-cann"}
#: Options of onnxruntime's CANNExecutionProvider, and the values it accepts for the two precision choices.
CANN_PROVIDER_OPTIONS = ("device_id", "npu_mem_limit", "arena_extend_strategy", "enable_cann_graph", "dump_graphs",
                         "dump_om_model", "precision_mode", "op_select_impl_mode", "optypelist_for_implmode")
CANN_PRECISION_MODES = ("force_fp32", "force_fp16", "allow_fp32_to_fp16", "must_keep_origin_dtype",
                        "allow_mix_precision")
CANN_IMPL_MODES = ("high_precision", "high_performance")

_warned: set[str] = set()
_warned_lock = threading.Lock()


def require(module: str, purpose: str) -> Any:
    """Import ``module`` (``"onnx"``, ``"onnxruntime"``, ``"onnxscript"``) or raise an ImportError that names
    the extra to install.

    Example:
        >>> ort = require("onnxruntime", "to run the exported model")
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"torchport.export needs {module} {purpose}, and it could not be imported ({exc}); "
                          f"install it with: {EXTRA}") from exc


def _warn_once(key: str, message: str, *args: Any) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message, *args)


def onnxruntime_package(backend: Backend) -> str:
    """The onnxruntime package whose execution provider runs ``backend``'s devices.

    Example:
        >>> onnxruntime_package(get_backend("npu"))
        'onnxruntime-cann'
    """
    return PACKAGES.get(backend.onnx_provider, "onnxruntime")


def device_providers(backend: Backend, index: int, options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """onnxruntime execution providers for device ``index`` of ``backend``, best first, each with its provider
    options; ``options`` are the caller's options for the device's own provider (checked where torchport knows the
    provider's options).

    Example:
        >>> device_providers(get_backend("cuda"), 1, {})
        [('CUDAExecutionProvider', {'device_id': 1}), ('CPUExecutionProvider', {})]
    """
    name = backend.onnx_provider
    if name == "CPUExecutionProvider":
        if options:
            raise ValueError(f"onnxruntime's CPUExecutionProvider takes no provider options here; got "
                             f"{', '.join(sorted(options))}")
        return [("CPUExecutionProvider", {})]
    chosen = {"device_id": index, **options}
    if name == "CANNExecutionProvider":
        unknown = sorted(set(options) - set(CANN_PROVIDER_OPTIONS))
        if unknown:
            raise ValueError(f"CANNExecutionProvider has no option {', '.join(map(repr, unknown))}; its options: "
                             f"{', '.join(CANN_PROVIDER_OPTIONS)}")
        for key, valid in (("precision_mode", CANN_PRECISION_MODES), ("op_select_impl_mode", CANN_IMPL_MODES)):
            if key in options and options[key] not in valid:
                raise ValueError(f"CANNExecutionProvider {key}={options[key]!r} is not valid; valid: "
                                 f"{', '.join(valid)}")
        # Matrix operators in fp16, vector operators kept in fp32 where they support it: closer to an fp32 PyTorch
        # result than force_fp16 (ATC's inference default), faster than must_keep_origin_dtype.
        chosen = {"device_id": index, "precision_mode": "allow_fp32_to_fp16",
                  "op_select_impl_mode": "high_performance", **options}
    return [(name, chosen), ("CPUExecutionProvider", {})]


def providers(device: DeviceLike = None, **provider_options: Any) -> list[tuple[str, dict[str, Any]]]:
    """The ``(provider, options)`` list a session on ``device`` uses, after dropping the providers that the
    installed onnxruntime lacks (warning once for each, with the package that has it).

    Example:
        >>> torchport.export.providers("cpu")
        [('CPUExecutionProvider', {})]
    """
    ort = require("onnxruntime", "to run ONNX models")
    backend, index = resolve(device)
    wanted = device_providers(backend, index, provider_options)
    available = set(ort.get_available_providers())
    chosen = [(name, options) for name, options in wanted if name in available]
    for name, _ in wanted:
        if name not in available:
            _warn_once(name, "onnxruntime %s has no %s (it offers %s); running on %s instead. For %s, install %s "
                             "in place of onnxruntime", ort.__version__, name, ", ".join(sorted(available)),
                       chosen[0][0] if chosen else "CPUExecutionProvider", backend.device(index),
                       onnxruntime_package(backend))
    return chosen or [("CPUExecutionProvider", {})]


def session(path: str | os.PathLike[str], device: DeviceLike = None, **provider_options: Any) -> Any:
    """An ``onnxruntime.InferenceSession`` for the ONNX file at ``path`` with the execution provider of ``device``
    (default: :func:`torchport.device`'s choice): CANNExecutionProvider on an Ascend NPU, CUDAExecutionProvider on
    an NVIDIA GPU, the CPU provider otherwise, and the CPU provider behind each for the operators it lacks.
    ``provider_options`` go to the device's provider (on Ascend: ``precision_mode``, ``op_select_impl_mode``,
    ``npu_mem_limit``...). A provider that the installed onnxruntime lacks is dropped with one warning.

    Example:
        >>> sess = torchport.export.session("model.onnx", device="npu:0", precision_mode="force_fp16")
        >>> logits = sess.run(None, {"input_ids": ids.numpy()})[0]
    """
    ort = require("onnxruntime", "to run ONNX models")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"session({path!r}): no such ONNX file (looked in {os.getcwd()})")
    chosen = providers(device, **provider_options)
    sess = ort.InferenceSession(path, providers=[name for name, _ in chosen],
                                provider_options=[options for _, options in chosen])
    active = sess.get_providers()
    if chosen[0][0] not in active:  # present in the package but could not start (missing driver libraries...)
        _warn_once(f"start:{chosen[0][0]}", "onnxruntime could not start %s (the session uses %s); check the "
                                            "device's driver libraries", chosen[0][0], ", ".join(active))
    return sess
