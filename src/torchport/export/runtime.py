"""onnxruntime sessions with the execution provider of a device, and the lazy imports of the export extra.

Which provider a device type uses (and with which options) is the backend's answer
(:meth:`torchport.backends.Backend.onnx_providers`); this module only asks it, checks what the installed
onnxruntime offers, and falls back to the CPU provider with one warning per missing provider.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any

from ..device import DeviceLike, resolve

__all__ = ["EXTRA", "providers", "require", "session"]

logger = logging.getLogger("torchport")

#: How to install what torchport.export needs.
EXTRA = 'pip install "torchport[export]"'

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


def providers(device: DeviceLike = None, **provider_options: Any) -> list[tuple[str, dict[str, Any]]]:
    """The ``(provider, options)`` list a session on ``device`` uses, after dropping the providers that the
    installed onnxruntime lacks (warning once for each, with the package that has it).

    Example:
        >>> torchport.export.providers("cpu")
        [('CPUExecutionProvider', {})]
    """
    ort = require("onnxruntime", "to run ONNX models")
    backend, index = resolve(device)
    wanted = backend.onnx_providers(index, provider_options)
    available = set(ort.get_available_providers())
    chosen = [(name, options) for name, options in wanted if name in available]
    for name, _ in wanted:
        if name not in available:
            _warn_once(name, "onnxruntime %s has no %s (it offers %s); running on %s instead. For %s, install %s "
                             "in place of onnxruntime", ort.__version__, name, ", ".join(sorted(available)),
                       chosen[0][0] if chosen else "CPUExecutionProvider", backend.device(index),
                       backend.onnxruntime_package)
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
