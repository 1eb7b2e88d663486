"""``y = x @ dequantise(W).T + bias`` for weights stored in a low-bit format (:mod:`torchport.quant`).

Implementations:

* ``triton`` (CUDA/ROCm): up to 16 rows (decode) one fused kernel reads each weight byte once and decodes it in
  registers; more rows (prefill) take a tensor-core GEMM that decodes the weight tiles as it loads them, or
  dequantise the weight in one Triton pass and use the vendor matmul, whichever the autotuner timed faster.
* ``npu``: torch_npu's ``npu_weight_quant_batchmatmul`` for ``int8`` (per channel) and ``int4`` (per group, the
  codes repacked once by ``npu_convert_weight_to_int4pack``), fp16/bf16 activations. Its formula,
  ``x @ ((w + offset) * scale)`` with a ``(K, N)`` weight, is the int4 format's own, so the scales are passed as they
  are (transposed views). Other formats on Ascend take the reference, and so does a layer outside the operator's
  documented limits: in or out features beyond 65535 (a 128256-word LM head), int4 groups that are not a multiple
  of 32, or what the chip lacks (the 310P: fp16 and int8 only).
* ``reference``: dequantise with plain PyTorch, then ``F.linear``; every device.

The backward gives ``x`` (and ``bias``) their gradients through the dequantised weight, so adapters trained on top
of a quantised model (QLoRA-style) work; the codes themselves get no gradient.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..backends.npu import device_chip, operator_limits
from . import _autograd, registry
from .spec import CustomOp, OpSpec, randn

__all__ = ["fused_refusal", "lowbit_linear", "tensor_version"]

Dequantize = Callable[[Mapping[str, torch.Tensor], torch.dtype], torch.Tensor]


@registry.register_kernel("lowbit_matmul", "reference")
def _reference(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int, bias: torch.Tensor | None,
               dequantize: Dequantize, cache: dict[str, Any]) -> torch.Tensor:
    return F.linear(x, dequantize(t, x.dtype), bias)


def _triton_check(x: torch.Tensor, fmt: str, group: int) -> None:
    from .triton import lowbit

    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise registry.Unsupported(f"the Triton low-bit kernels take fp16, bf16 or fp32 activations, not {x.dtype}")
    reason = lowbit.supports(fmt, group, x.shape[-1])
    if reason is not None:
        raise registry.Unsupported(reason)


@registry.register_kernel("lowbit_matmul", "triton", devices=["cuda"], priority=20)
def _triton(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int, bias: torch.Tensor | None,
            dequantize: Dequantize, cache: dict[str, Any]) -> torch.Tensor:
    from .triton import lowbit

    _triton_check(x, fmt, group)
    return lowbit.matmul(x, dict(t), fmt, group, bias)


def tensor_version(t: torch.Tensor) -> object:
    """What a cache derived from ``t`` is keyed on: ``t._version``, which counts in-place writes; for an inference
    tensor (made under ``torch.inference_mode``), which keeps no count, a new object each time, so that nothing is
    reused that an unseen in-place write could have made stale."""
    return object() if t.is_inference() else t._version


def _npu_tensors(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int,
                 cache: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(weight (K, N), antiquant_scale, antiquant_offset, antiquant_group_size) for torch_npu, made once per
    weight storage, version and activation dtype and kept in the layer's cache (an in-place update of the codes or
    scales, such as ``load_state_dict``, bumps a version and so makes it again)."""
    q, scale = t["qweight"], t["scale"]
    key = (q.data_ptr(), x.dtype, *(tensor_version(v) for v in t.values()))
    kept = cache.get("npu")
    if kept is not None and kept[0] == key:
        return kept[1]
    if fmt == "int8":
        value = (q.t(), scale[:, 0].to(x.dtype), None, 0)
    else:
        codes = torch.stack((q & 0xF, q >> 4), dim=-1).reshape(q.shape[0], -1).to(torch.int32) - 8
        pack = registry.fused_op("npu_convert_weight_to_int4pack", x.device)
        weight = pack(codes.t().contiguous())  # (K, N / 8): eight codes per int32, in torch_npu's own order
        value = (weight, scale.t().to(x.dtype), t["offset"].t().to(x.dtype), group)
    cache["npu"] = (key, value)  # the cache may hold other entries (the layer's plans): replace only this one
    return value


@registry.register_kernel("lowbit_matmul", "npu", devices=["npu"], priority=10,
                          requires=registry.fused_op_reason("npu_weight_quant_batchmatmul"))
def _npu(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int, bias: torch.Tensor | None,
         dequantize: Dequantize, cache: dict[str, Any]) -> torch.Tensor:
    reason = _npu_refuses(x, t, fmt, group)
    if reason is not None:  # this layer takes the reference; the others keep the fused path
        raise registry.Unsupported(reason)
    if x.shape[0] == 0:  # torch_npu takes no empty input, and there is nothing to compute
        y = x.new_empty(0, t["qweight"].shape[0])
        return y if bias is None else y + bias.to(y.dtype)
    weight, scale, offset, group_size = _npu_tensors(x, t, fmt, group, cache)
    matmul = registry.fused_op("npu_weight_quant_batchmatmul", x.device)
    y = matmul(x, weight, scale, offset, None, None, None, group_size if group_size != x.shape[-1] else 0)
    return y if bias is None else y + bias.to(y.dtype)


def _npu_refuses(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int) -> str | None:
    """Why npu_weight_quant_batchmatmul cannot run this layer (its documented limits, torch_npu_contract.json), or
    None. The operator raises RuntimeError outside them, which would read as a broken kernel."""
    limits = operator_limits("npu_weight_quant_batchmatmul")
    if fmt not in ("int8", "int4"):
        return f"npu_weight_quant_batchmatmul takes int8 and int4 weights, not {fmt}"
    chip = device_chip(x.device)
    family = chip.family if chip is not None and chip.family in limits["x_dtypes"] else "A2"
    x_dtypes = [getattr(torch, name) for name in limits["x_dtypes"][family]]
    if x.dtype not in x_dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in x_dtypes)
        return f"npu_weight_quant_batchmatmul takes {names} activations{_on(chip)}, not {x.dtype}"
    if fmt == "int4":
        if "int32" not in limits["weight_dtypes"][family]:
            return f"npu_weight_quant_batchmatmul takes no int4 weights{_on(chip)}"
        unavailable = registry.fused_op_unavailable("npu_convert_weight_to_int4pack", x.device)
        if unavailable is not None:
            return unavailable
        if t["qweight"].shape[0] % 8:
            return "npu_convert_weight_to_int4pack needs out_features to be a multiple of 8"
    k, n = x.shape[-1], t["qweight"].shape[0]
    low, high = limits["k_n_range"]
    if not (low <= k <= high and low <= n <= high):
        return f"npu_weight_quant_batchmatmul takes in and out features within [{low}, {high}], not {k} and {n}"
    if fmt == "int4" and group != k and not (limits["group_size_min"] <= group <= k - 1
                                             and group % limits["group_size_multiple"] == 0):
        return (f"npu_weight_quant_batchmatmul takes groups of a multiple of {limits['group_size_multiple']} "
                f"inputs (at least {limits['group_size_min']}), not {group}")
    return None


def _on(chip: Any) -> str:
    return "" if chip is None else f" on {chip.soc_version}"


class _LowbitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, t: Mapping[str, torch.Tensor], fmt: str,
                group: int, dequantize: Dequantize, cache: dict[str, Any]) -> torch.Tensor:
        ctx.args = (t, dequantize, bias is not None)
        return registry.call("lowbit_matmul", x.device, x, t, fmt, group, bias, dequantize, cache)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        t, dequantize, has_bias = ctx.args
        dx = dy @ dequantize(t, dy.dtype) if ctx.needs_input_grad[0] else None
        dbias = dy.sum(0) if has_bias and ctx.needs_input_grad[1] else None
        return dx, dbias, None, None, None, None, None


def _triton_refuses(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int) -> str | None:
    try:
        _triton_check(x, fmt, group)
    except registry.Unsupported as exc:
        return str(exc)
    return None


_REFUSALS = {"npu": _npu_refuses, "triton": _triton_refuses}


def fused_refusal(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int) -> str | None:
    """Why the implementation chosen for ``x``'s device would hand ``x @ W.T`` to the reference (a shape or dtype
    outside its limits), or None. :mod:`torchport.quant.merge` asks before it runs sibling layers as one weight,
    whose output features may pass a limit that each layer keeps (torch_npu: 65535).

    Example:
        >>> fused_refusal(x, merged_tensors, "int4", 128)   # None where the fused path takes the merged weight
    """
    impl = registry.select("lowbit_matmul", x.device, quiet=True)
    refuses = _REFUSALS.get(impl.name)
    return None if refuses is None else refuses(x, t, fmt, group)


def lowbit_linear(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int, bias: torch.Tensor | None,
                  *, dequantize: Dequantize | None = None, cache: dict[str, Any] | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` where ``W`` is held as the low-bit tensors ``t`` of format ``fmt`` (see
    :mod:`torchport.quant.formats`); ``dequantize(t, dtype)`` is the format's plain-PyTorch decoder (the reference,
    and the backward; default: the format's own, looked up by name). ``cache`` keeps layouts an implementation
    derives once per weight (torch_npu's int4 pack). Under ``torch.compile`` the graph calls
    ``torch.ops.torchport.lowbit_matmul`` (no graph break).

    Example:
        >>> y = lowbit_linear(x, layer.tensors(), "int4", 128, None)
    """
    if x.shape[-1] != _in_features(t, fmt):
        raise ValueError(f"lowbit_linear: x has {x.shape[-1]} features, the weight takes {_in_features(t, fmt)}")
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.shape[-1] > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    if torch.compiler.is_dynamo_compiling():  # a constant to dynamo: its graph calls the custom op
        y = registry.custom_op("lowbit_matmul")(rows, t["qweight"], t["scale"], t.get("offset"), t.get("global_scale"),
                                                bias, fmt, int(group))
    else:
        if dequantize is None:
            from ..quant.formats import get_format  # the decoder belongs to the quantisation layer

            dequantize = get_format(fmt).dequantize
        y = None
        if cache is not None and not (torch.is_grad_enabled()
                                      and (rows.requires_grad or (bias is not None and bias.requires_grad))):
            y = _planned(rows, t, fmt, group, bias, dequantize, cache)
        if y is None:
            y = _autograd.apply(_LowbitLinear, rows, bias, t, fmt, group, dequantize, {} if cache is None else cache)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


# -- planned calls: inference through a caller's cache, decided once per input signature ------------------------------
# A quantised model's prefill is host-bound where each of its ~225 layer calls goes through the registry, the
# implementation's checks, the tuner's lookup and the route's dispatch (RESULTS.md, issue 24: 84-124 us of host time
# per call at 2048 rows against 35-43 us for the two launches). A call that needs no gradient and brings a cache (a
# QuantizedLinear's) keeps, per row count, dtype and device, what the chosen implementation decided: the next such
# call launches it directly. A plan is used while the registry chooses the same implementation, for the same tensor
# objects and decoder; it keeps the launch configuration chosen when it was made.
_PLANS = 8  # plans kept per cache (distinct row counts, dtypes, devices) before they start over


class _Plan(NamedTuple):
    """A signature's plan and what it is valid for; ``run`` None: planning failed, take the registry's path."""

    impl: registry.Implementation
    tensors: tuple[torch.Tensor, ...]
    dequantize: Dequantize
    storage: tuple[int, ...]
    run: Callable[..., torch.Tensor] | None


def _triton_plan(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int, bias: torch.Tensor | None,
                 dequantize: Dequantize) -> Callable[..., torch.Tensor] | None:
    if _triton_refuses(x, t, fmt, group) is not None:
        return None
    from .triton import lowbit

    return lowbit.plan(x, dict(t), fmt, group, bias)


def _reference_plan(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int,
                    bias: torch.Tensor | None, dequantize: Dequantize) -> Callable[..., torch.Tensor] | None:
    return lambda x, t, bias: F.linear(x, dequantize(t, x.dtype), bias)


_PLANNERS = {"triton": _triton_plan, "reference": _reference_plan}


def _planned(x: torch.Tensor, t: Mapping[str, torch.Tensor], fmt: str, group: int, bias: torch.Tensor | None,
             dequantize: Dequantize, cache: dict[str, Any]) -> torch.Tensor | None:
    """``x @ W.T + bias`` through the plan kept in ``cache`` for ``x``'s signature, made now if the implementation
    can plan it; None where the call must take the registry's path: an implementation without a planner, a shape
    not tuned yet, or a plan that failed to be made or to run (then none is made again for that signature until the
    tensors or the implementation change, and the registry's path handles the failure as for any implementation)."""
    impl = registry.select("lowbit_matmul", x.device)
    planner = _PLANNERS.get(impl.name)
    if planner is None:
        return None
    plans = cache.get("plans")
    if plans is None:
        plans = cache["plans"] = {}
    key = (x.shape[0], x.dtype, x.device)
    tensors = tuple(t.values())
    # the same tensor objects on the same storage: a plan holds views of them (a new storage behind one, as
    # ``t.data = other`` or ``set_`` make, would leave it reading the old)
    storage = tuple(v.data_ptr() for v in tensors)
    kept = plans.get(key)
    if kept is not None and (kept.storage != storage or len(kept.tensors) != len(tensors)
                             or not all(map(operator.is_, kept.tensors, tensors))):
        plans.clear()  # every signature's plan holds the old tensors: let them go
        kept = None
    if kept is None or kept.impl is not impl or kept.dequantize != dequantize:
        if key not in plans and len(plans) >= _PLANS:
            plans.clear()
        kept = _Plan(impl, tensors, dequantize, storage, None)
        try:
            run = planner(x, t, fmt, group, bias, dequantize)
        except registry.PASS_THROUGH:
            raise
        except Exception as exc:
            _plan_failed(plans, key, kept, exc)
            return None
        if run is None:  # nothing to plan yet (a shape not tuned): asked again at the next call
            return None
        kept = plans[key] = kept._replace(run=run)
    if kept.run is None:  # this signature's plan failed before
        return None
    try:
        return kept.run(x, t, bias)
    except registry.PASS_THROUGH:
        raise
    except Exception as exc:
        _plan_failed(plans, key, kept._replace(run=None), exc)
        return None


def _plan_failed(plans: dict[Any, Any], key: tuple[Any, ...], entry: _Plan, exc: Exception) -> None:
    """No plan for ``key`` from now on (until its tensors or implementation change), said once in the log."""
    plans[key] = entry
    registry.logger.info("torchport.kernels.lowbit_matmul: the planned call for %s failed (%s: %s); such calls "
                         "take the registry's path", key, type(exc).__name__, exc)


# -- torch.ops.torchport.lowbit_matmul: the op a compiled graph calls --------------------------------------------------
# Its arguments are the format's tensors one by one (a schema takes no mapping) and the format's name; the format's
# decoder is looked up by name when the op runs. torch_npu's repacked int4 weight is kept per qweight tensor for as
# long as that tensor lives, as the layer's cache keeps it in eager mode.
_op_caches: dict[int, dict[str, Any]] = {}


def _op_tensors(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    t = {"qweight": qweight, "scale": scale}
    if offset is not None:
        t["offset"] = offset
    if global_scale is not None:
        t["global_scale"] = global_scale
    return t


def _op_cache(qweight: torch.Tensor) -> dict[str, Any]:
    key = id(qweight)
    cache = _op_caches.get(key)
    if cache is None:
        cache = _op_caches[key] = {}
        weakref.finalize(qweight, _op_caches.pop, key, None)
    return cache


def _op_forward(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                global_scale: torch.Tensor | None, bias: torch.Tensor | None, fmt: str, group: int) -> torch.Tensor:
    from ..quant.formats import get_format  # the decoder belongs to the quantisation layer

    t = _op_tensors(qweight, scale, offset, global_scale)
    return registry.call("lowbit_matmul", x.device, x, t, fmt, group, bias, get_format(fmt).dequantize,
                         _op_cache(qweight))


def _op_fake(x: torch.Tensor, qweight: torch.Tensor, *rest: Any) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


def _op_backward(grads: Sequence[torch.Tensor], needs: Sequence[bool], x: torch.Tensor | None,
                 qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 global_scale: torch.Tensor | None, bias: torch.Tensor | None, fmt: str,
                 group: int) -> tuple[torch.Tensor | None, ...]:
    from ..quant.formats import get_format

    dy = grads[0]
    t = _op_tensors(qweight, scale, offset, global_scale)
    dx = dy @ get_format(fmt).dequantize(t, dy.dtype) if needs[0] else None
    return dx, None, None, None, None, dy.sum(0) if needs[5] else None


def _in_features(t: Mapping[str, torch.Tensor], fmt: str) -> int:
    return t["qweight"].shape[1] * (1 if fmt in ("int8", "fp8") else 2)


# -- spec: int4 weights in groups of 128 (the format ``torchport.quantize`` picks for GPUs) --------------------------
_GROUP = 128


def _inputs(gen: torch.Generator | None, rows: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8,
                          device=None if gen is None else gen.device)
    return randn(gen, (rows, k)), codes, randn(gen, (n, k // _GROUP), 0.01).abs(), randn(gen, (n, k // _GROUP))


def _int4(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    tensors = {"qweight": codes, "scale": scale, "offset": offset}
    return lowbit_linear(x, tensors, "int4", _GROUP, None)


def _bytes(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> int:
    # fwd: read x and the codes, write y; bwd: read dy and the codes, write dx; scales and offsets read twice
    activations = 2 * (x.numel() + x.shape[0] * codes.shape[0]) * x.element_size()
    return activations + 2 * (codes.numel() + scale.numel() * scale.element_size() + offset.numel() * offset.element_size())


SPEC = registry.register_op(OpSpec(
    "lowbit_matmul", "low-bit matmul", "``x @ dequantise(W).T`` for low-bit weights", ("lowbit_linear",),
    "rows × out features × in features (int4 weights, groups of 128)",
    sizes={"test": (3, 24, 256), "smoke": (16, 512, 512), "small": (1, 4096, 4096), "medium": (16, 14336, 4096),
           "large": (2048, 14336, 4096), "benchmark": (16, 14336, 4096)},
    make=_inputs, call=_int4, differentiable=1, bytes_moved=_bytes,
    flops=lambda x, codes, scale, offset: 4 * x.shape[0] * codes.shape[0] * x.shape[1],  # y and dx: 2 matmuls
    custom_op=CustomOp("(Tensor x, Tensor qweight, Tensor scale, Tensor? offset, Tensor? global_scale, Tensor? bias, "
                       "str fmt, int group) -> Tensor", like=None, fake=_op_fake, forward=_op_forward,
                       backward=_op_backward),
))
