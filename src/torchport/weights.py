"""Loading weights onto whatever device is present."""

from __future__ import annotations

import os

import torch

from .device import DeviceLike, resolve

__all__ = ["load_safetensors"]


def load_safetensors(path: str | os.PathLike[str], device: DeviceLike = None) -> dict[str, torch.Tensor]:
    """Load a ``.safetensors`` file into a dict of tensors on a device (default: :func:`torchport.device`).

    The safetensors library memory-maps the file; tensors go straight to the device where safetensors supports
    it (CUDA, NPU, XPU, MPS), otherwise through host memory.

    Raises:
        FileNotFoundError: the file does not exist. IsADirectoryError: the path is a folder.
        ValueError: the file is truncated or is not a safetensors file.

    Example:
        >>> model.load_state_dict(torchport.load_safetensors("model.safetensors"))
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"safetensors file {path!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"{path!r} is a directory; pass one .safetensors file (a sharded checkpoint lists its shards in "
            "model.safetensors.index.json)"
        )
    backend, index = resolve(device)
    target = backend.device(index)
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError as exc:
        raise ImportError("torchport.load_safetensors needs the safetensors package: pip install safetensors") from exc
    try:
        # safetensors takes device strings, not torch.device objects, and rejects "cpu:0"
        tensors = load_file(path, device=str(target) if backend.safetensors_direct else "cpu")
    except SafetensorError as exc:
        size = os.path.getsize(path)
        raise ValueError(
            f"{path!r} ({size} bytes) is not a valid safetensors file: {exc}. It may be truncated or corrupt; "
            "download or save it again"
        ) from exc
    if not backend.safetensors_direct:
        tensors = {name: t.to(target) for name, t in tensors.items()}
    return tensors
