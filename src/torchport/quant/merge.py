"""Sibling low-bit layers that read the same input (q/k/v, gate/up) held as one weight and run as one kernel.

At batch-1 decode a layer's kernel is too short to reach the memory bandwidth: on an H100 an int4 4096 x 4096
layer moves its 8.9 MB at 0.77-1.07 TB/s, because a launch's ramp-up and tail are a large part of 8-12 µs. The three
attention projections of a Llama layer read the same hidden state, and so do the MLP's gate and up projections; as
one weight of 6144 (or 28672) output features their kernel reads two to three times the bytes per launch
(``benchmarks/RESULTS.md``, issue 24: int4 q + k + v 18.3 µs against 10.8 µs merged).

The layers stay separate modules with their own names and state-dict entries: their codes and scales become row
slices of one tensor per kind (so memory is unchanged), and a :class:`SiblingGroup` joins them. When one of them is
called on a single row, the group computes every sibling's output in one call and keeps it; each sibling then
called with the same tensor (same object, not modified since: ``_version``) gets its slice of that output. A
sibling called with another tensor (cross-attention: the keys and values read the encoder's states), or a merged
call whose other outputs were never taken, shows that the siblings do not share their input: the group then stops
merging and every layer runs on its own. Several rows (prefill, batched decode) run each layer on its own: merged
outputs would be column slices of a wider matrix, not contiguous tensors, and at those sizes the kernels are long
enough. Inside ``torch.compile`` the layers run on their own too, each one ``torch.ops.torchport.lowbit_matmul``
call in the graph (the group's bookkeeping is Python state). So do calls where autograd records (the input or a
bias requires a gradient): outputs that are views of one tensor share one version counter, and an in-place write
to one would fail the backward of another. A layer whose bias or codes are not on the input's device for the
moment (an offloading hook) and a shallow copy of a layer (``nn.DataParallel``'s replicas) run on their own as
well. The group holds its layers by weak reference, so a deleted model is freed at once.

Under ``torch.inference_mode`` tensors keep no version count, so an in-place write to the shared input between two
sibling calls cannot be seen: the second sibling would get its slice of the output computed before the write. Model
code does not write into the input that its projections share; code that does should quantise with
``merge=False``.

Example:
    >>> torchport.quantize(model, "int4")                     # merges q/k/v and gate/up by default
    >>> torchport.quant.merged_groups(model)
    [('layers.0.self_attn.q_proj', 'layers.0.self_attn.k_proj', 'layers.0.self_attn.v_proj'), ...]
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..kernels.lowbit_matmul import fused_refusal, lowbit_linear, tensor_version
from .formats import QuantizationError, get_format
from .linear import QuantizedLinear

__all__ = ["SIBLINGS", "SiblingGroup", "merge_layers", "merge_siblings", "merged_groups", "quantize_together",
           "sibling_problem", "sibling_sets"]

logger = logging.getLogger("torchport")

#: Child names of one module whose linear layers read the same input in the common model families: HF Llama,
#: Mistral, Qwen, Gemma, Phi-3-style (``q_proj``...), BERT/ViT (``query``...), Meta's reference Llama and Mixtral's
#: experts (``wq``..., ``w1``/``w3``).
SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                                         ("query", "key", "value"), ("wq", "wk", "wv"), ("w1", "w3"))
_ROWS = ("qweight", "scale", "offset")  # tensors with one row per output feature
_PER_LAYER = ("global_scale",)  # one value per layer (nvfp4), which merged layers must share


def _as_sets(siblings: bool | Iterable[Sequence[str]] | None) -> tuple[tuple[str, ...], ...]:
    if siblings is None or siblings is False:
        return ()
    if siblings is True:
        return SIBLINGS
    if isinstance(siblings, str):
        raise QuantizationError(f"merge must be True, False or a list of child-name tuples such as "
                                f"[('q_proj', 'k_proj', 'v_proj')]; got the string {siblings!r}")
    sets = tuple(tuple(s) for s in siblings)
    for s in sets:
        if len(s) < 2 or not all(isinstance(n, str) and n and "." not in n for n in s):
            raise QuantizationError(f"merge: each entry is a tuple of two or more child names (no dots) of one "
                                    f"module, e.g. ('gate_proj', 'up_proj'); got {s!r}")
    return sets


def sibling_sets(names: Iterable[str], siblings: bool | Iterable[Sequence[str]] | None = True,
                 ) -> list[tuple[str, ...]]:
    """Which of the qualified layer ``names`` form merge groups: per parent module and entry of ``siblings``, the
    entry's children present among ``names`` (two or more), in the entry's order.

    Example:
        >>> sibling_sets(["a.q_proj", "a.k_proj", "a.v_proj", "a.o_proj"])
        [('a.q_proj', 'a.k_proj', 'a.v_proj')]
    """
    present = set(names)
    parents = sorted({n.rpartition(".")[0] for n in present})
    out = []
    for parent in parents:
        prefix = f"{parent}." if parent else ""
        for entry in _as_sets(siblings):
            found = tuple(prefix + child for child in entry if prefix + child in present)
            if len(found) >= 2:
                out.append(found)
    taken: set[str] = set()
    for group in out:
        if taken & set(group):
            raise QuantizationError(f"merge: layer(s) {sorted(taken & set(group))} appear in two sibling sets; a "
                                    f"layer can be merged with one set only")
        taken.update(group)
    return out


def mergeable(layers: Sequence[nn.Module]) -> str | None:
    """Why ``layers`` cannot share one weight, or None when they can."""
    first = layers[0]
    if not all(isinstance(m, QuantizedLinear) for m in layers):
        return "not all of them are QuantizedLinear layers"
    keys = {(m.in_features, m.format, m.group_size, m.dtype, m.qweight.device, m.bias is not None) for m in layers}
    if len(keys) > 1:
        return (f"they differ in input features, format, group size, dtype, device or bias "
                f"({sorted(str(k) for k in keys)})")
    for name in _PER_LAYER:  # one value for the whole layer: the merged weight has one for all
        if hasattr(first, name) and len({float(getattr(m, name)) for m in layers}) > 1:
            return f"their {name} values differ (quantise them together: torchport.quantize(..., merge=True))"
    return None


class SiblingGroup:
    """Layers whose codes and scales are row slices of one tensor per kind; see the module's docstring.

    ``shared`` turns False (for good) once the layers are seen to read different inputs.
    """

    def __init__(self, members: Sequence[QuantizedLinear], names: Sequence[str] = ()) -> None:
        # weak references: the layers hold the group, and a cycle back to them would keep a deleted model's memory
        # until Python's cycle collector runs
        self._members = [weakref.ref(m) for m in members]
        self.names = tuple(names)
        self.shared = True
        self._reset()
        self.tensors()  # joins the layers' storage (a copy only where it is not one tensor already)
        for m in members:
            m._group = self

    @property
    def members(self) -> list[QuantizedLinear]:
        """The layers, in output order (a layer that no longer exists leaves the group unusable: ``shared`` off)."""
        layers = [ref() for ref in self._members]
        if any(m is None for m in layers):
            self.shared = False
            return [m for m in layers if m is not None]
        return layers  # type: ignore[return-value]

    def _reset(self) -> None:
        self._key: tuple = ()
        self._merged: dict[str, torch.Tensor] = {}
        self._cache: dict[str, Any] = {}  # lowbit_linear's layouts derived once per weight (torch_npu)
        self._pending: tuple | None = None  # (x, its version, merged output, indices still to take their slice)
        self._fit: dict[tuple, bool] = {}  # (device, dtype) -> whether the fused kernel takes the merged weight

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles carry the layers, not a call in flight
        return {"members": self.members, "names": self.names, "shared": self.shared}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._members = [weakref.ref(m) for m in state["members"]]
        self.names, self.shared = state["names"], state["shared"]
        self._reset()

    def tensors(self) -> dict[str, torch.Tensor] | None:
        """The merged codes and scales; the layers' buffers are made views of them again if they were moved or
        replaced (``.to(device)`` moves each layer's slice on its own). None while the layers' codes are not all on
        one device (a device map that split them) or some have no data (on the meta device, as offloading hooks
        leave them between calls)."""
        key = tuple((t.data_ptr(), tensor_version(t)) for m in self.members for t in m.tensors().values())
        if key == self._key:
            return self._merged
        devices = {t.device for m in self.members for t in m.tensors().values()}
        if len(devices) > 1 or any(d.type == "meta" for d in devices):
            return None
        first = self.members[0]
        merged = {}
        for name in _ROWS:
            if not hasattr(first, name):
                continue
            parts = [getattr(m, name) for m in self.members]
            base = _joined(parts)
            if base is None:
                # normal tensors even inside torch.inference_mode (where cat, and a view of another dtype, make
                # inference tensors): in-place writes to them are then counted, which the key above relies on
                with torch.inference_mode(False):
                    base = torch.cat([p.view(torch.uint8) if p.element_size() == 1 else p for p in parts])
                    base = base.view(parts[0].dtype)
                    start = 0
                    for m, p in zip(self.members, parts):
                        m._buffers[name] = base[start:start + p.shape[0]]
                        start += p.shape[0]
            merged[name] = base
        if any(hasattr(first, name) for name in _PER_LAYER):
            reason = mergeable(self.members)
            if reason is not None:
                logger.warning("torchport: layers %s no longer merge (%s); each runs on its own", self.names, reason)
                self.shared = False
            merged.update((name, getattr(first, name)) for name in _PER_LAYER if hasattr(first, name))
        self._merged, self._cache = merged, {}
        self._key = tuple((t.data_ptr(), tensor_version(t)) for m in self.members for t in m.tensors().values())
        return merged

    @staticmethod
    def _bias(members: Sequence[QuantizedLinear], device: torch.device) -> tuple[bool, torch.Tensor | None]:
        """``(usable, merged bias)``: the layers' biases concatenated in each call (one small kernel), so that a
        captured CUDA graph reads them as they are when it replays. Not usable while a bias is elsewhere than
        ``device`` (an offloading hook leaves it on the meta device until that layer's own call)."""
        biases = [m.bias for m in members]
        if biases[0] is None:
            return True, None
        if any(b is None or b.device != device for b in biases):
            return False, None
        return True, torch.cat(biases)

    def output(self, member: QuantizedLinear, x: torch.Tensor) -> torch.Tensor | None:
        """``member(x)`` from the merged call, or None when ``member`` should run on its own."""
        if not self.shared or torch.compiler.is_compiling():
            return None
        members = self.members
        # a shallow copy of a layer (nn.DataParallel's replicas) shares the group without being one of its members
        index = next((i for i, m in enumerate(members) if m is member), None)
        if index is None:
            return None
        if torch.is_grad_enabled() and (x.requires_grad or any(m.bias is not None and m.bias.requires_grad
                                                              for m in members)):
            # training: the siblings' outputs as views of one tensor would share one version counter, so an
            # in-place write to one would fail the backward of another
            return None
        pending = self._pending
        if pending is not None:
            px, version, out, waiting = pending
            if index in waiting and px is x and version == _input_version(x):
                waiting.discard(index)
                if not waiting:
                    self._pending = None
                return _slice(out, members, index)
            # a layer that was owed a slice of the last merged call was called with another tensor, or never
            # came: these layers do not share one input
            logger.info("torchport: layers %s do not read one input; they run on their own from now on", self.names)
            self.shared, self._pending = False, None
            return None
        merged = self.tensors()
        if merged is None or not self.shared or not self._fits(x, merged):
            return None
        usable, bias = self._bias(members, x.device)
        if not usable:
            return None
        out = lowbit_linear(x, merged, members[0].format, members[0].group_size, bias, cache=self._cache)
        self._pending = (x, _input_version(x), out, set(range(len(members))) - {index})
        return _slice(out, members, index)

    def _fits(self, x: torch.Tensor, merged: dict[str, torch.Tensor]) -> bool:
        """Whether the device's fused kernel takes the merged weight wherever it takes each layer's own (per device
        and dtype of ``x``); where it would not, the layers run on their own."""
        key = (x.device, x.dtype)
        fits = self._fit.get(key)
        if fits is None:
            first = self.members[0]
            reason = fused_refusal(x, merged, first.format, first.group_size)
            fits = reason is None or any(fused_refusal(x, m.tensors(), m.format, m.group_size) for m in self.members)
            if not fits:
                logger.info("torchport: layers %s run on their own on %s: as one weight %s", self.names, x.device,
                            reason)
            self._fit[key] = fits
        return fits


def _slice(out: torch.Tensor, members: Sequence[QuantizedLinear], index: int) -> torch.Tensor:
    """Layer ``index``'s columns of the merged output."""
    start = sum(m.out_features for m in members[:index])
    return out[..., start:start + members[index].out_features]


def _input_version(x: torch.Tensor) -> int | None:
    """The input's count of in-place writes; None for an inference tensor, which keeps none (see the module's
    docstring)."""
    return None if x.is_inference() else x._version


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor ``parts`` are consecutive row blocks of, as a view, or None."""
    first = parts[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
               and p.shape[1:] == first.shape[1:] for p in parts):
        return None
    try:
        same = len({p.untyped_storage().data_ptr() for p in parts}) == 1
    except RuntimeError:  # a tensor subclass without a plain storage (the simulated NPU's): views of one base
        same = first._base is not None and all(p._base is first._base for p in parts)
    if not same:
        return None
    offset = first.storage_offset()
    for p in parts:
        if p.storage_offset() != offset:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def quantize_together(linears: Sequence[nn.Linear], format: str, group_size: int | None,
                      names: Sequence[str] = ()) -> list[QuantizedLinear]:
    """``linears`` (same input features, dtype, device and bias presence: see :func:`sibling_problem`) quantised as
    one weight of all their rows, returned as one :class:`QuantizedLinear` each over row slices of it, joined in a
    :class:`SiblingGroup`. The codes equal those of quantising each alone, except nvfp4's: one global scale for all.
    """
    fmt = get_format(format)
    weight = torch.cat([m.weight.detach() for m in linears])
    tensors = fmt.quantize(weight, fmt.group_size(group_size, weight.shape[1]))
    del weight
    layers, start = [], 0
    for linear in linears:
        layer = QuantizedLinear(linear.in_features, linear.out_features, format, group_size, bias=False,
                                dtype=linear.weight.dtype, device="meta")
        for name, value in tensors.items():
            value = value.contiguous()
            setattr(layer, name, value[start:start + linear.out_features] if name in _ROWS else value.clone())
        layer.bias = linear.bias
        layers.append(layer)
        start += linear.out_features
    SiblingGroup(layers, names)
    return layers


def sibling_problem(linears: Sequence[nn.Linear]) -> str | None:
    """Why the dense ``linears`` cannot be quantised as one weight, or None."""
    keys = {(m.in_features, m.weight.dtype, m.weight.device, m.bias is not None) for m in linears}
    if len(keys) > 1:
        return f"they differ in input features, dtype, device or bias ({sorted(str(k) for k in keys)})"
    return None


def merged_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """The qualified names of each group of merged layers in ``model``.

    Example:
        >>> merged_groups(torchport.quantize(model, "int4"))[:1]
        [('layers.0.self_attn.q_proj', 'layers.0.self_attn.k_proj', 'layers.0.self_attn.v_proj')]
    """
    names = {id(m): name for name, m in model.named_modules()}
    seen: set[int] = set()
    out = []
    for m in model.modules():
        group = getattr(m, "_group", None) if isinstance(m, QuantizedLinear) else None
        if group is None or id(group) in seen or not all(id(x) in names for x in group.members):
            continue
        seen.add(id(group))
        out.append(tuple(names[id(x)] for x in group.members))
    return out


def merge_siblings(model: nn.Module, siblings: bool | Iterable[Sequence[str]] = True) -> list[tuple[str, ...]]:
    """Join ``model``'s quantised sibling layers (see :data:`SIBLINGS`, or your own child-name tuples) into
    :class:`SiblingGroup` objects; returns the groups made. Sets that cannot merge (different formats, dtypes, nvfp4
    global scales...) are left as they are, with the reason logged. Their codes are copied into one tensor per kind
    once (the old ones are freed).

    Example:
        >>> merge_siblings(torchport.quant.load(model, "model-int4.safetensors"), [("gate_proj", "up_proj")])
    """
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    return [names for names in sibling_sets(layers, siblings) if merge_layers(model, names)]


def merge_layers(model: nn.Module, names: Sequence[str]) -> bool:
    """Join the quantised layers ``names`` (qualified) of ``model`` into one :class:`SiblingGroup`; False (and the
    reason logged) when they cannot share one weight."""
    members = []
    for name in names:
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            raise QuantizationError(f"merge: the model has no layer {name!r}") from None
        if isinstance(layer, QuantizedLinear) and layer._group is not None:
            raise QuantizationError(f"merge: layer {name!r} is merged already, with {layer._group.names}")
        members.append(layer)
    reason = mergeable(members)
    if reason is not None:
        logger.info("torchport: layers %s are not merged: %s", tuple(names), reason)
        return False
    SiblingGroup(members, names)
    return True
