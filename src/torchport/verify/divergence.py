"""Run a model on a target device and on a reference, and find the first module whose output differs.

How the two runs meet without keeping both sets of activations: the target runs first, and each module call's
output is copied to host memory, in the target's dtype, under its call name (``encoder.layers.0#2``); a call that
returns the very tensor an inner call returned (``nn.Sequential``, wrappers) shares that copy. The target model is
then freed and the reference runs; as each of its modules returns, its output is compared with the stored one,
a row of statistics is kept, and the stored copy is dropped. Peak extra host memory is therefore one copy of every
distinct module output of the target forward in the target's dtype (with ``backward=True``, plus one copy of every
parameter gradient), never the reference's activations, and never both runs' activations at once. On the target
device: a copy of the weights plus what the forward itself holds at once (outputs are referenced weakly while
copied), measured at weights + 3 activations for a 16-layer MLP on the simulated NPU.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import weakref
from typing import Any

import torch

from ..device import DeviceLike, resolve
from .hooks import Recorder
from .report import LayerRow, Report
from .structure import call_model, leaves, map_tensors, signature
from .tolerance import tolerance

__all__ = ["ModelError", "StructureError", "compare"]

logger = logging.getLogger("torchport")


class ModelError(RuntimeError):
    """The model raised while running on one side of a comparison.

    Attributes: ``device`` (where it ran, e.g. ``"npu:0 (float32)"``), ``module`` (qualified name of the innermost
    module that was running, ``"(root)"`` for the model's own code, None in the backward pass) and ``module_type``.
    """

    def __init__(self, message: str, device: str, module: str | None, module_type: str | None) -> None:
        super().__init__(message)
        self.device, self.module, self.module_type = device, module, module_type


class StructureError(ValueError):
    """The target and the reference returned differently structured outputs (or ran different modules)."""


def _str_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _model_dtype(model: torch.nn.Module, inputs: Any) -> torch.dtype:
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            return tensor.dtype
    for _, leaf in leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return torch.float32


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _errors(target: torch.Tensor, reference: torch.Tensor) -> tuple[float, float, str]:
    """(max abs error, relative error, note) of a target tensor against the reference, both on the host.

    Positions where both sides hold the same non-finite value (a -inf mask on both) are left out; a non-finite
    value on one side only makes both errors infinite.
    """
    wide = torch.complex128 if target.is_complex() or reference.is_complex() else torch.float64
    t, r = target.to(wide), reference.to(wide)
    if t.numel() == 0:
        return 0.0, 0.0, ""
    finite_t, finite_r = torch.isfinite(t), torch.isfinite(r)
    note = ""
    if not (bool(finite_t.all()) and bool(finite_r.all())):
        same = (t == r) | (torch.isnan(t) & torch.isnan(r))
        bad = int(((finite_t != finite_r) | (~finite_t & ~same)).sum())
        if bad:
            return math.inf, math.inf, f"{bad} non-finite value(s) differ"
        t, r = torch.where(finite_t, t, 0), torch.where(finite_r, r, 0)
        note = "non-finite values match"
    diff = t - r
    max_abs = float(diff.abs().max())
    diff_norm, ref_norm = float(torch.linalg.vector_norm(diff)), float(torch.linalg.vector_norm(r))
    rel = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    return max_abs, rel, note


def _copy_to(model: torch.nn.Module, device: torch.device, dtype: torch.dtype | None) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on ``device`` (floating ones in ``dtype``).

    Tensors are copied straight to the device through deepcopy's memo, so a parameter shared by two modules (tied
    embeddings) stays one parameter; ``Module.to`` would untie them on a device whose tensors are a Python subclass.
    """
    def moved(tensor: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to(device, cast, copy=True)

    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = torch.nn.Parameter(moved(parameter), requires_grad=parameter.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = moved(buffer)
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise TypeError(
            f"compare runs a copy of the model on each device, and copy.deepcopy failed on "
            f"{type(model).__name__}: {type(exc).__name__}: {exc}"
        ) from exc


class _Run:
    """One side of the comparison: a private copy of the model on a device, in a dtype."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype | None, label: str) -> None:
        self.model = _copy_to(model, device, dtype)
        self.model.eval()  # dropout and batch-norm statistics updates off
        self.device, self.dtype, self.label = device, dtype, label
        self.recorder: Recorder | None = None

    def forward(self, inputs: Any, backward: bool, on_output: Any, seed: int) -> Any:
        torch.manual_seed(seed)  # the same RNG state on both sides (device generators follow torch.manual_seed)
        grad = torch.enable_grad() if backward else torch.no_grad()
        with Recorder(self.model, on_output) as self.recorder, grad:
            if backward:
                for parameter in self.model.parameters():
                    if parameter.is_floating_point():
                        parameter.requires_grad_(True)
            try:
                return call_model(self.model, inputs)
            except StructureError:
                raise
            except Exception as exc:
                raise self._failure(exc) from exc

    def _failure(self, exc: Exception) -> ModelError:
        running = self.recorder.running() if self.recorder else []
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        if running:
            name, module = running[-1]
            path = " > ".join(n for n, _ in running)
            return ModelError(
                f"the model failed on {self.label} in module {name!r} ({type(module).__name__}), called as {path}: "
                f"{type(exc).__name__}: {first_line}", self.label, name, type(module).__name__)
        return ModelError(f"the model failed on {self.label}: {type(exc).__name__}: {first_line}",
                          self.label, None, None)

    def backward(self, output: Any, seed: int) -> None:
        """Backpropagate sum(output * P) for a fixed random projection P per floating output tensor."""
        loss = None
        for i, (_, leaf) in enumerate(leaves(output)):
            if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad):
                continue
            projection = torch.randn(leaf.shape, generator=torch.Generator().manual_seed(seed + 1 + i),
                                     dtype=torch.float64)
            term = (leaf * projection.to(leaf.device, leaf.dtype)).sum()
            loss = term if loss is None else loss + term.to(loss.dtype)
        if loss is None:
            raise ValueError("backward=True needs a floating-point model output that depends on the parameters; "
                             "this model's output has none")
        try:
            loss.backward()
        except StructureError:
            raise
        except Exception as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            raise ModelError(f"the backward pass failed on {self.label}: {type(exc).__name__}: {first_line}",
                             self.label, None, None) from exc


def _grad_hooks(model: torch.nn.Module, on_grad: Any) -> list[Any]:
    owners = {id(p): type(m).__name__ for m in model.modules() for p in m.parameters(recurse=False)}
    handles = []
    for name, parameter in model.named_parameters():
        if parameter.is_floating_point():
            handles.append(parameter.register_post_accumulate_grad_hook(
                lambda p, name=name: on_grad(name, owners[id(p)], p.grad)))
    return handles


def compare(
    model: torch.nn.Module,
    inputs: Any,
    device: DeviceLike = None,
    reference: DeviceLike = "cpu",
    reference_dtype: torch.dtype | None = torch.float64,
    rtol: float | None = None,
    atol: float | None = None,
    backward: bool = False,
    *,
    seed: int = 0,
) -> Report:
    """Run ``model`` on a target device and on a reference, and compare every module's output.

    Both sides run a deep copy of the model (same weights; the caller's model is not touched), in ``eval()`` mode
    (dropout off), from the same seed. The target keeps the model's dtype (that of its first floating-point
    parameter); the reference casts floating-point weights to ``reference_dtype`` (None: keep the model's). Inputs
    are moved for you: floating-point inputs are rounded to the model's dtype, and the reference gets those same
    rounded values in its dtype, so the report measures the computation and not the input rounding.

    ``inputs`` is passed as the model's one argument if it is a tensor, as positional arguments if it is a tuple or
    list, as keyword arguments if it is a mapping (a dict, a tokenizer's ``BatchEncoding``). Module outputs may be
    tensors or tuples, lists, dicts and Hugging Face ``ModelOutput``s of them; non-tensor entries are skipped.

    With ``backward=True``, both sides also backpropagate ``sum(output * P)`` (P: a fixed random projection of
    each floating-point output tensor) and every floating-point parameter's gradient gets a row.

    Tolerances default per target dtype (:data:`torchport.verify.TOLERANCES`); a row passes when its relative
    error ‖out − ref‖ / ‖ref‖ is at most ``rtol`` or every element is within ``atol``.

    Raises:
        ModelError: the model raised on one side; the message names the device and the module that raised.
        StructureError: the two sides returned differently structured outputs or ran different modules.
        ValueError, RuntimeError: a device that is not present, a bad tolerance.

    Example:
        >>> report = torchport.verify.compare(model, (input_ids,), device="npu")
        >>> report.ok, report.first_divergence
        (True, None)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compare needs a torch.nn.Module, got {type(model).__name__}")
    if reference_dtype is not None and not (isinstance(reference_dtype, torch.dtype)
                                            and reference_dtype.is_floating_point):
        raise ValueError(f"reference_dtype={reference_dtype!r} is not a floating-point torch.dtype "
                         "(use torch.float64, torch.float32, or None to keep the model's dtype)")
    target_backend, target_index = resolve(device, source="device")
    reference_backend, reference_index = resolve(reference, source="reference")
    target_device = target_backend.device(target_index)
    reference_device = reference_backend.device(reference_index)
    dtype = _model_dtype(model, inputs)
    rtol, atol = tolerance(dtype, rtol, atol)
    ref_dtype = reference_dtype or dtype
    target_label = f"{target_device} ({_str_dtype(dtype)})"
    reference_label = f"{reference_device} ({_str_dtype(ref_dtype)})"

    def rounded(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to("cpu")
        return t.to(dtype) if t.is_floating_point() else t

    comparison = _Comparison(rtol, atol, backward, seed)
    with contextlib.ExitStack() as stack:  # the caller's RNG state is left as it was
        stack.enter_context(_kept_rng(target_backend, target_index))
        stack.enter_context(_kept_rng(reference_backend, reference_index))
        host_inputs = map_tensors(rounded, inputs)
        comparison.run_target(_Run(model, target_device, None, target_label), host_inputs)
        target_backend.synchronize(target_index)
        comparison.run_reference(_Run(model, reference_device, ref_dtype, reference_label), host_inputs)
    return Report(device=str(target_device), dtype=_str_dtype(dtype), reference=str(reference_device),
                  reference_dtype=_str_dtype(ref_dtype), rtol=rtol, atol=atol, backward=backward,
                  layers=comparison.rows)


class _Comparison:
    """The target's stored outputs, and the rows made as the reference's outputs arrive."""

    def __init__(self, rtol: float, atol: float, backward: bool, seed: int) -> None:
        self.rtol, self.atol, self.backward, self.seed = rtol, atol, backward, seed
        # call name -> (output signature, [(path, host copy)], module type)
        self.stored: dict[str, tuple[dict[str, str], list[tuple[str, torch.Tensor]], str]] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.rows: list[LayerRow] = []
        self._copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id -> (tensor, version, host copy)
        self.target_label = self.reference_label = ""

    # -- target: keep a host copy of every module output -------------------------------------------------------
    def run_target(self, run: _Run, host_inputs: Any) -> None:
        self.target_label = run.label
        inputs = map_tensors(lambda t: t.to(run.device), host_inputs)
        logger.info("verify: running the model on %s", run.label)
        output = run.forward(inputs, self.backward, self._store, self.seed)
        self._copies.clear()
        if self.backward:
            handles = _grad_hooks(run.model, lambda name, owner, grad: self.grads.__setitem__(name, _host_copy(grad)))
            try:
                run.backward(output, self.seed)
            finally:
                for handle in handles:
                    handle.remove()

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        # an output that is the very tensor an inner module returned (Sequential, wrappers) shares its host copy
        # (a weak reference: holding the device tensor would keep every activation alive on the device; a dead
        # reference means the id now belongs to another tensor)
        seen = self._copies.get(id(tensor))
        if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
            return seen[2]
        copied = _host_copy(tensor)
        self._copies[id(tensor)] = (weakref.ref(tensor), tensor._version, copied)
        return copied

    def _store(self, call: str, module: torch.nn.Module, output: Any) -> None:
        tensors = [(path, self._keep(leaf)) for path, leaf in leaves(output) if isinstance(leaf, torch.Tensor)]
        self.stored[call] = (signature(output), tensors, type(module).__name__)

    # -- reference: compare each module's output as it returns, then drop the stored copy ----------------------
    def run_reference(self, run: _Run, host_inputs: Any) -> None:
        self.reference_label = run.label
        inputs = map_tensors(lambda t: t.to(run.device, run.dtype) if t.is_floating_point() else t.to(run.device),
                             host_inputs)
        logger.info("verify: running the model on %s", run.label)
        output = run.forward(inputs, self.backward, self._check, self.seed)
        if self.stored:
            missing = ", ".join(list(self.stored)[:5]) + (" ..." if len(self.stored) > 5 else "")
            raise StructureError(f"module call(s) {missing} ran on {self.target_label} but not on "
                                 f"{self.reference_label}: the model takes different paths on the two devices")
        if self.backward:
            handles = _grad_hooks(run.model, self._check_grad)
            try:
                run.backward(output, self.seed)
            finally:
                for handle in handles:
                    handle.remove()
            if self.grads:
                raise StructureError(f"parameter(s) {', '.join(self.grads)} got a gradient on {self.target_label} "
                                     f"but not on {self.reference_label}")

    def _check(self, call: str, module: torch.nn.Module, output: Any) -> None:
        if call not in self.stored:
            raise StructureError(
                f"module {call!r} ({type(module).__name__}) ran on {self.reference_label} but not on "
                f"{self.target_label}: the model takes different paths on the two devices")
        target_signature, target_tensors, type_name = self.stored.pop(call)
        reference_signature = signature(output)
        if reference_signature != target_signature:
            raise StructureError(
                f"module {call!r} ({type_name}) returned differently structured outputs: "
                f"{_describe(target_signature)} on {self.target_label}, {_describe(reference_signature)} on "
                f"{self.reference_label}")
        reference_tensors = [(path, leaf.detach()) for path, leaf in leaves(output) if isinstance(leaf, torch.Tensor)]
        self._add_row(call, type_name, "output", target_tensors, reference_tensors)

    def _check_grad(self, name: str, owner: str, grad: torch.Tensor) -> None:
        if name not in self.grads:
            raise StructureError(f"parameter {name!r} got a gradient on {self.reference_label} but not on "
                                 f"{self.target_label}")
        self._add_row(f"{name}.grad", owner, "grad", [("", self.grads.pop(name))], [("", grad.detach())])

    def _add_row(self, call: str, type_name: str, kind: str, target_tensors: list[tuple[str, torch.Tensor]],
                 reference_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not target_tensors:
            return  # nothing to compare (the module returned None or non-tensors)
        max_abs = rel = 0.0
        ok = True
        worst, worst_rel, note = "", -1.0, ""
        for (path, t), (_, r) in zip(target_tensors, reference_tensors):
            if tuple(t.shape) != tuple(r.shape):
                raise StructureError(
                    f"module {call!r} ({type_name}) returned {path or 'a tensor'} of shape {tuple(t.shape)} on "
                    f"{self.target_label} but {tuple(r.shape)} on {self.reference_label}")
            leaf_abs, leaf_rel, leaf_note = _errors(t, r.to("cpu"))
            ok = ok and (leaf_rel <= self.rtol or leaf_abs <= self.atol)
            max_abs = max(max_abs, leaf_abs)
            if leaf_rel > worst_rel:
                worst, worst_rel = path, leaf_rel
            rel = max(rel, leaf_rel)
            note = note or leaf_note
        first = target_tensors[0][1]
        self.rows.append(LayerRow(
            index=len(self.rows), name=call, type=type_name, kind=kind, shape=tuple(first.shape),
            dtype=_str_dtype(first.dtype), max_abs_error=max_abs, rel_error=rel, ok=ok,
            tensors=len(target_tensors), worst=worst if len(target_tensors) > 1 else "", note=note))


def _describe(sig: dict[str, str]) -> str:
    if list(sig) == [""]:
        return sig[""]
    return "{" + ", ".join(f"{path}: {kind}" for path, kind in sig.items()) + "}"


def _kept_rng(backend: Any, index: int) -> Any:
    """fork_rng for the host and, where its module has per-device RNG state, one device."""
    try:
        has_state = hasattr(backend.module(), "get_rng_state")
    except Exception:  # a device module that cannot load has no RNG state to keep
        has_state = False
    return torch.random.fork_rng(devices=[index] if has_state else [], device_type=backend.name)
