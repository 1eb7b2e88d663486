"""Weight-only low-bit weights for ``nn.Linear`` layers on every device.

``torchport.quantize(model, format)`` replaces the model's linear layers by :class:`QuantizedLinear` layers that
keep their weight as low-bit codes plus scales (formats in :mod:`torchport.quant.formats`: ``int8``, ``fp8``,
``int4``, ``mxfp4``, ``nvfp4``; ``fp4`` is ``nvfp4``) and decode it inside the matmul: a fused Triton kernel on
CUDA, torch_npu's weight-quant matmul on Ascend (int8, int4), a plain-PyTorch reference elsewhere (see
:mod:`torchport.kernels.lowbit_matmul`). Activations stay in the model's dtype. FP4 runs on every device: where
the chip has no FP4 unit, the codes are decoded to the activation dtype in registers.

Sibling layers that read one input (q/k/v, gate/up) are quantised as one weight and, at batch-1 decode, run as one
kernel (:mod:`torchport.quant.merge`; ``merge=False`` turns it off).

:func:`save` / :func:`load` keep a quantised model in one safetensors file, with the formats in its metadata.

Example:
    >>> import torchport
    >>> model = torchport.quantize(model, "int4", modules=lambda name, m: name != "lm_head")
    >>> torchport.quant.weight_bytes(model)
    >>> torchport.quant.save(model, "model-int4.safetensors")
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Union

import torch
from torch import nn

from .._bytes import weight_bytes
from .formats import FORMATS, Format, QuantizationError, get_format, list_formats
from .linear import QuantizedLinear
from .merge import (SIBLINGS, merge_layers, merge_siblings, merged_groups, quantize_together, sibling_problem,
                    sibling_sets)

__all__ = ["FORMATS", "Format", "QuantizationError", "QuantizedLinear", "SIBLINGS", "default_format", "dequantize",
           "get_format", "list_formats", "load", "merge_siblings", "merged_groups", "quantize", "quantized_modules",
           "save", "weight_bytes"]

logger = logging.getLogger("torchport")

Selector = Union[None, str, Iterable[str], Callable[[str, nn.Module], bool]]
_METADATA_KEY = "torchport.quant"
_METADATA_VERSION = 1
_probed: dict[tuple[str, str, torch.dtype], str | None] = {}


def default_format(device: torch.device | str | None = None) -> str:
    """The low-bit format torchport's memory mode uses on ``device``: ``int4`` (groups of 128) everywhere.

    It is the one format with a fused path on every accelerator torchport knows (Triton on CUDA/ROCm,
    ``npu_weight_quant_batchmatmul`` on Ascend) and the most accurate of the 4-bit formats on random and real
    weights (asymmetric scales per 128).

    Example:
        >>> default_format("cuda")
        'int4'
    """
    return "int4"


def quantized_modules(model: nn.Module) -> dict[str, QuantizedLinear]:
    """The :class:`QuantizedLinear` layers of ``model`` by qualified name.

    Example:
        >>> {name: layer.format for name, layer in quantized_modules(model).items()}
        {'layers.0.mlp.up_proj': 'int4', ...}
    """
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def _select(model: nn.Module, modules: Selector) -> list[tuple[str, nn.Linear]]:
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise QuantizationError(f"{type(model).__name__} has no nn.Linear layer to quantise")
    if modules is None:
        return linears
    if callable(modules):
        chosen = [(name, m) for name, m in linears if modules(name, m)]
    else:
        patterns = [modules] if isinstance(modules, str) else list(modules)
        if not all(isinstance(p, str) for p in patterns):
            raise QuantizationError(f"modules must be None, names or glob patterns, or a function (name, module) -> "
                                    f"bool; got {modules!r}")
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name, _ in linears)]
        if unmatched:
            examples = ", ".join(name for name, _ in linears[:6])
            raise QuantizationError(f"modules {unmatched} match no nn.Linear of the model; its linear layers are named "
                                    f"like: {examples}")
        chosen = [(name, m) for name, m in linears if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    if not chosen:
        raise QuantizationError("the modules filter selected no nn.Linear layer")
    return chosen


def _tied(model: nn.Module) -> set[int]:
    """ids of weights held by more than one module (tied embeddings and output layers)."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {pid for pid, count in owners.items() if count > 1}


def _check_device(fmt: str, device: torch.device, dtype: torch.dtype) -> None:
    """Run a tiny layer of ``fmt`` on ``device`` once; a device that cannot run the format at all (no fused path and
    no reference: a dtype its software stack lacks) is an error that names the formats that work."""
    key = (fmt, device.type, dtype)
    if key not in _probed:
        try:
            layer = QuantizedLinear.from_linear(nn.Linear(256, 16, bias=False, device=device, dtype=dtype), fmt)
            layer(torch.ones(2, 256, device=device, dtype=dtype))
            _probed[key] = None
        except Exception as exc:  # the reason is reported, not the crash
            _probed[key] = f"{type(exc).__name__}: {exc}"
    reason = _probed[key]
    if reason is not None:
        working = [f for f in FORMATS if f != fmt and _probed.get((f, device.type, dtype), "") is None]
        raise QuantizationError(f"format {fmt!r} cannot run on {device.type} here ({reason}); formats that ran on "
                                f"this device: {', '.join(working) or 'none checked yet'}")


def quantize(model: nn.Module, format: str, *, group_size: int | None = None, modules: Selector = None,
             merge: bool | Iterable[Sequence[str]] = True) -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` layers (all, or those ``modules`` selects) by :class:`QuantizedLinear`
    layers holding their weights in ``format``; returns ``model``, changed in place (a bare ``nn.Linear`` is
    returned as a new :class:`QuantizedLinear`).

    Args:
        model: the model; its layers are quantised on the device they are on.
        format: ``int8``, ``fp8``, ``int4``, ``mxfp4``, ``nvfp4`` or ``fp4`` (= ``nvfp4``).
        group_size: inputs per scale for ``int4``: any even divisor of every selected layer's input features
            (default: 128, or for a layer 128 does not divide, its largest even divisor between 32 and 128, else
            its whole row).
            ``mxfp4`` and ``nvfp4`` have fixed blocks (32, 16); ``int8`` and ``fp8`` one scale per output channel.
        modules: None (every ``nn.Linear``), a name or glob pattern or a list of them (``"*.mlp.*"``), or a
            function ``(name, module) -> bool``. Layers whose weight is tied to another module (an output layer
            sharing the embedding) are left as they are, with a warning.
        merge: sibling layers that read the same input are quantised as one weight (their codes row slices of it,
            so memory is unchanged) and run as one kernel at batch-1 decode (:mod:`torchport.quant.merge`).
            True: the child-name sets of :data:`SIBLINGS` (``q_proj``/``k_proj``/``v_proj``,
            ``gate_proj``/``up_proj``, ...); a list of tuples of child names; False: every layer on its own. A set
            whose layers differ in input features, dtype, device or bias stays unmerged (logged). nvfp4 layers
            merged share one global scale.

    Every selected layer is checked before any is changed: a group size that does not divide a layer's input
    features, an unknown format, a model quantised already, a format the device cannot run at all are
    :class:`QuantizationError` and the model stays untouched.

    Example:
        >>> torchport.quantize(model, "fp4", modules=lambda name, m: "lm_head" not in name)
    """
    # the codes are made as normal tensors even inside torch.inference_mode: their in-place updates (a state-dict
    # load) are then counted, which the caches derived from them rely on
    with torch.inference_mode(False):
        return _quantize(model, format, group_size, modules, merge)


def _quantize(model: nn.Module, format: str, group_size: int | None, modules: Selector,
              merge: bool | Iterable[Sequence[str]]) -> nn.Module:
    fmt = get_format(format)
    if quantized_modules(model):
        raise QuantizationError(
            f"{type(model).__name__} is quantised already ({len(quantized_modules(model))} QuantizedLinear layers); "
            f"quantise a model once, from its original weights (torchport.quant.dequantize(model) gives back dense "
            f"layers, with the rounding of the first quantisation)"
        )
    chosen = _select(model, modules)
    tied = _tied(model)
    skipped = [name for name, m in chosen if id(m.weight) in tied]
    if skipped:
        logger.warning("torchport.quantize: %s left unquantised: their weights are tied to another module", skipped)
    chosen = [(name, m) for name, m in chosen if id(m.weight) not in tied]
    for name, m in chosen:
        try:
            fmt.group_size(group_size, m.in_features)
        except QuantizationError as exc:
            raise QuantizationError(f"layer {name or type(m).__name__!r}: {exc}") from None
        if not m.weight.is_floating_point():
            raise QuantizationError(f"layer {name or type(m).__name__!r} has a {m.weight.dtype} weight; only floating "
                                    f"weights quantise")
    for device, dtype in {(m.weight.device, m.weight.dtype) for _, m in chosen}:
        if device.type != "meta":
            _check_device(fmt.name, device, dtype)
    layers = dict(chosen)
    groups = []
    for names in sibling_sets([name for name in layers if name], merge):
        problem = sibling_problem([layers[n] for n in names])
        if problem is None:
            groups.append(names)
        else:
            logger.info("torchport.quantize: %s quantised one by one, not merged: %s", names, problem)
    for names in groups:
        for name, layer in zip(names, quantize_together([layers.pop(n) for n in names], fmt.name, group_size, names)):
            _replace(model, name, layer)
    for name, m in layers.items():
        layer = QuantizedLinear.from_linear(m, fmt.name, group_size)
        if not name:  # the model is itself a linear layer: the quantised layer is returned instead
            return layer
        _replace(model, name, layer)
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def dequantize(model: nn.Module) -> nn.Module:
    """Replace every :class:`QuantizedLinear` of ``model`` by an ``nn.Linear`` with the dequantised weight (the
    rounding of the quantisation stays); returns ``model``.

    Example:
        >>> dequantize(quantize(model, "int8"))
    """
    for name, layer in quantized_modules(model).items():
        dense = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        dense.weight = nn.Parameter(layer.dequantized_weight(), requires_grad=False)
        dense.bias = layer.bias
        _replace(model, name, dense)
    return model


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict's entries, each tied tensor under its first name only (as ``named_parameters`` lists them)."""
    keys = set(model.state_dict(keep_vars=True))
    unique = dict(model.named_parameters())
    unique.update(model.named_buffers())
    return {name: t for name, t in unique.items() if name in keys}


def save(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Save a (partly) quantised model's state in one safetensors file; the formats and the merged sibling groups
    go in its metadata (:func:`load` merges them again). Tied tensors are stored once.

    Example:
        >>> save(quantize(model, "int4"), "model-int4.safetensors")
    """
    from safetensors.torch import save_file

    layers = {name: {"format": layer.format, "group_size": layer.group_size, "in_features": layer.in_features,
                     "out_features": layer.out_features, "bias": layer.bias is not None,
                     "dtype": str(layer.dtype).removeprefix("torch.")}
              for name, layer in quantized_modules(model).items()}
    info = {"version": _METADATA_VERSION, "layers": layers, "merged": merged_groups(model)}
    metadata = {_METADATA_KEY: json.dumps(info)}
    tensors = {}
    for name, t in _unique_state(model).items():
        t = t.detach().to("cpu").contiguous()
        # a merged layer's codes are a slice of its group's tensor; safetensors stores tensors that own their memory
        tensors[name] = t.clone() if t.untyped_storage().nbytes() != t.nbytes else t
    save_file(tensors, os.fspath(path), metadata=metadata)


def load(model: nn.Module, path: str | os.PathLike[str], *, device: torch.device | str | None = None) -> nn.Module:
    """Load a file written by :func:`save` into ``model`` (the same architecture, unquantised, e.g. built on the
    ``meta`` device or from its config): the layers the file holds quantised are replaced first, then every
    tensor is loaded (strictly: a missing or unexpected tensor is an error). Returns ``model``, on ``device``
    (default: where its parameters are; the CPU for a model on the meta device).

    Example:
        >>> model = load(LlamaForCausalLM(config), "model-int4.safetensors", device="cuda")
    """
    with torch.inference_mode(False):  # the codes as normal tensors, as quantize makes them
        return _load(model, path, device)


def _load(model: nn.Module, path: str | os.PathLike[str], device: torch.device | str | None) -> nn.Module:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(os.fspath(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if _METADATA_KEY not in metadata:
        raise QuantizationError(f"{os.fspath(path)} was not written by torchport.quant.save (no {_METADATA_KEY!r} "
                                f"metadata); load a plain checkpoint with torchport.load_safetensors")
    info = json.loads(metadata[_METADATA_KEY])
    if info.get("version") != _METADATA_VERSION:
        raise QuantizationError(f"{os.fspath(path)} has torchport.quant metadata version {info.get('version')}; "
                                f"this torchport reads version {_METADATA_VERSION}")
    layers: Mapping[str, dict] = info["layers"]
    state = [*model.parameters(), *model.buffers()]
    on_meta = any(t.is_meta for t in state)
    if device is None:
        device = next((t.device for t in state if not t.is_meta), torch.device("cpu"))
    present = {name for name, m in model.named_modules()}
    missing = sorted(set(layers) - present)
    if missing:
        raise QuantizationError(f"{os.fspath(path)} has quantised layers the model lacks: {missing[:8]}")
    for name, spec in layers.items():
        current = model.get_submodule(name)
        if isinstance(current, QuantizedLinear):
            if (current.format, current.group_size) != (spec["format"], spec["group_size"]):
                raise QuantizationError(f"layer {name!r} is quantised as {current.format}/{current.group_size}; the "
                                        f"file holds {spec['format']}/{spec['group_size']}")
            continue
        if not isinstance(current, nn.Linear) or (current.in_features, current.out_features) != (
                spec["in_features"], spec["out_features"]):
            raise QuantizationError(f"layer {name!r} of the model is {current!r}; the file holds a "
                                    f"{spec['in_features']}->{spec['out_features']} linear layer")
        _replace(model, name, QuantizedLinear(spec["in_features"], spec["out_features"], spec["format"],
                                              spec["group_size"], bias=spec["bias"],
                                              dtype=getattr(torch, spec["dtype"]), device="meta" if on_meta else device))
    if on_meta:
        model.to_empty(device=device)
    else:
        model.to(device)
    tensors = load_file(os.fspath(path), device="cpu")
    expected = set(_unique_state(model))
    missing_keys = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - set(model.state_dict()))
    if missing_keys or unexpected:
        raise QuantizationError(f"{os.fspath(path)} does not fit the model: missing {missing_keys[:8]}, "
                                f"unexpected {unexpected[:8]}")
    model.load_state_dict(tensors, strict=False)
    for names in info.get("merged", []):
        merged = [n for n in names if getattr(model.get_submodule(n), "_group", None) is not None]
        if merged:  # a model quantised and merged already, loaded into: its own groups stay
            if len(merged) < len(names) or len({id(model.get_submodule(n)._group) for n in names}) > 1:
                logger.info("torchport.quant.load: %s were merged in the file; the model merges them otherwise, "
                            "which stays", tuple(names))
            continue
        merge_layers(model, names)
    return model
