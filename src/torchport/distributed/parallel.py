"""``torchport.distributed.wrap``: DDP or FSDP2 with the device ids, precision policy and reduction dtype set."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..device import DeviceLike, resolve
from ..device import dtype as preferred_dtype

__all__ = ["wrap"]

_REDUCED = (torch.bfloat16, torch.float16)
_STRATEGIES = ("ddp", "fsdp")


def wrap(model: nn.Module, strategy: str = "ddp", *, device: DeviceLike = None,
         mixed_precision: torch.dtype | str | None = "auto", reduce_dtype: torch.dtype | str | None = "auto",
         layers: Sequence[type | str | nn.Module] | None = None, **options: Any) -> nn.Module:
    """Make ``model`` data-parallel across the process group, on this rank's device.

    Starts the process group (:func:`torchport.distributed.init`) if that has not been done, moves the model to
    this rank's device, and wraps it.

    * ``"ddp"``: ``DistributedDataParallel`` with ``device_ids`` set on accelerators and the gradients kept in
      its communication buckets (``gradient_as_bucket_view=True``, which the options can turn off).
    * ``"fsdp"``: FSDP2 (``fully_shard``) on a one-dimensional device mesh over all ranks: each repeated block
      (the members of an ``nn.ModuleList`` of modules of one class, such as a transformer's layers) is sharded
      on its own, then the whole model. Parameters, gradients and optimizer states are split across ranks.
      With float32 parameters on an accelerator, ``mixed_precision="auto"`` computes in the device's preferred
      reduced dtype (:func:`torchport.dtype`) and keeps float32 master weights.

    Gradient reduction: with more than two ranks, bfloat16 and float16 gradients are summed in float32 (then cast
    back), because a ring reduction rounds every partial sum to 8 (or 11) mantissa bits and the error grows with
    the number of ranks. With two ranks a reduced-precision sum rounds once, exactly as casting a float32 sum back
    does, so the gradients are reduced in their own dtype: half the bytes on the wire (on two H200s, DDP scaled
    1.84x this way against 1.70x with a float32 reduction; ``benchmarks/RESULTS.md``).

    torchport kernels keep working inside: with FSDP, a block's weights are gathered into ordinary tensors
    before its forward and backward run, so the kernels see the same tensors as without it.

    Args:
        model: the model (on any device; it is moved to this rank's device).
        strategy: ``"ddp"`` or ``"fsdp"``.
        device: the device type (default: the one :func:`torchport.device` picks).
        mixed_precision: FSDP's compute dtype: ``"auto"`` (above), ``None`` (the parameters' own dtype) or a
            dtype such as ``torch.bfloat16``. DDP does not cast parameters: use ``torch.autocast`` with it.
        reduce_dtype: the dtype gradients are reduced in: ``"auto"`` (float32 when computing in a reduced
            dtype on more than two ranks, as above), ``None`` (the compute dtype) or a dtype.
        layers: for FSDP, the submodules to shard one by one: module classes, class names or module instances
            (default: found as above).
        options: passed to ``DistributedDataParallel`` (``find_unused_parameters``, ``bucket_cap_mb``...) or to
            ``fully_shard`` (``reshard_after_forward``...); an unknown one is an error listing the valid ones.

    Returns:
        The wrapped model (DDP: a ``DistributedDataParallel``; FSDP: the model itself, its class extended by
        FSDP2). Free a DDP model (``del``) before ``destroy_process_group()``: its reducer, freed after the group,
        can wait forever at exit (seen with gloo, torch 2.13).

    Example:
        >>> torchport.distributed.init()
        >>> model = torchport.distributed.wrap(model, "fsdp")     # layers sharded, bf16 compute, fp32 reduce
    """
    import torch.distributed as dist

    from . import init

    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not a parallel strategy; valid: {', '.join(_STRATEGIES)}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap expects an nn.Module, got {type(model).__name__}")
    rank_device = init(device)
    backend, _ = resolve(rank_device.type)
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters: there is nothing to make data-parallel")
    param_dtype = _dtype_of(params)
    model.to(rank_device)
    if strategy == "ddp":
        if mixed_precision not in ("auto", None):
            raise ValueError(
                f"mixed_precision={mixed_precision!r} is for FSDP; DDP keeps the parameters' dtype: run the forward "
                "under torch.autocast for mixed precision, or use strategy='fsdp'"
            )
        return _wrap_ddp(model, rank_device, param_dtype, reduce_dtype, options, dist)
    compute = _compute_dtype(mixed_precision, param_dtype, rank_device, backend.name)
    return _wrap_fsdp(model, rank_device, param_dtype, compute, reduce_dtype, layers, options, dist)


def _dtype_of(params: Sequence[nn.Parameter]) -> torch.dtype:
    floating = {p.dtype for p in params if p.is_floating_point()}
    if len(floating) > 1:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in floating))
        raise ValueError(f"the model's parameters mix dtypes ({names}); cast the model to one dtype before wrap()")
    return floating.pop() if floating else torch.float32


def _as_dtype(value: torch.dtype | str | None, name: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value), None)
    if isinstance(found, torch.dtype) and found.is_floating_point:
        return found
    raise ValueError(f"{name}={value!r} is not a floating dtype; use 'auto', None or e.g. torch.bfloat16")


def _compute_dtype(mixed_precision: torch.dtype | str | None, param_dtype: torch.dtype, device: torch.device,
                   device_type: str) -> torch.dtype:
    if mixed_precision == "auto":
        if param_dtype == torch.float32 and device.index is not None:  # an accelerator (the CPU has no index)
            return preferred_dtype(device)
        return param_dtype
    chosen = _as_dtype(mixed_precision, "mixed_precision")
    return param_dtype if chosen is None else chosen


def _reduce_dtype(reduce_dtype: torch.dtype | str | None, compute: torch.dtype, world: int) -> torch.dtype | None:
    if reduce_dtype == "auto":
        # two ranks: one rounding of the sum either way; more: a rounding per partial sum of the ring
        return torch.float32 if compute in _REDUCED and world > 2 else None
    return _as_dtype(reduce_dtype, "reduce_dtype")


def _check_options(target: Any, options: dict[str, Any], excluded: Iterable[str], what: str) -> None:
    valid = [name for name in inspect.signature(target).parameters if name not in {"self", *excluded}]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"unknown {what} option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")


def _wrap_ddp(model: nn.Module, device: torch.device, param_dtype: torch.dtype, reduce_dtype: Any,
              options: dict[str, Any], dist: Any) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    _check_options(DistributedDataParallel.__init__, options, ("module", "device_ids", "output_device"),
                   "DistributedDataParallel")
    on_accelerator = device.index is not None
    # gradients live in the communication buckets: no copy into them each step, and one gradient's memory less
    options = {"gradient_as_bucket_view": True, **options}
    wrapped = DistributedDataParallel(
        model,
        device_ids=[device.index] if on_accelerator else None,
        output_device=device.index if on_accelerator else None,
        **options,
    )
    wide = _reduce_dtype(reduce_dtype, param_dtype, dist.get_world_size())
    if wide is not None and wide != param_dtype:
        wrapped.register_comm_hook(_ReduceIn(wide, options.get("process_group")), _all_reduce_widened)
    return wrapped


class _ReduceIn:
    """State of the DDP communication hook that all-reduces a gradient bucket in a wider dtype."""

    def __init__(self, dtype: torch.dtype, group: Any) -> None:
        self.dtype = dtype
        self.group = group


def _all_reduce_widened(state, bucket):  # noqa: ANN001, ANN202 - DDP checks these two parameters' annotations
    import torch.distributed as dist

    group = state.group if state.group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.to(state.dtype).div_(dist.get_world_size(group))
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def narrow(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(narrow)


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Members of every ``nn.ModuleList`` holding two or more modules of one class (a model's layers)."""
    blocks: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            blocks.extend(module)
    return blocks


def _chosen_layers(model: nn.Module, layers: Sequence[type | str | nn.Module] | None) -> list[nn.Module]:
    if layers is None:
        return _repeated_blocks(model)
    chosen: list[nn.Module] = []
    modules = list(model.modules())
    for spec in layers:
        if isinstance(spec, nn.Module):
            if not any(spec is m for m in modules):
                raise ValueError(f"layers: {type(spec).__name__} instance is not a submodule of the model")
            matched = [spec]
        elif isinstance(spec, type) or isinstance(spec, str):
            matched = [m for m in modules if (type(m) is spec if isinstance(spec, type) else type(m).__name__ == spec)]
            if not matched:
                present = sorted({type(m).__name__ for m in modules})
                name = spec if isinstance(spec, str) else spec.__name__
                raise ValueError(f"layers: no submodule of class {name!r}; the model has: {', '.join(present)}")
        else:
            raise TypeError(f"layers: {spec!r} is not a module class, class name or module")
        chosen.extend(m for m in matched if m is not model)
    return chosen


def _wrap_fsdp(model: nn.Module, device: torch.device, param_dtype: torch.dtype, compute: torch.dtype,
               reduce_dtype: Any, layers: Sequence[type | str | nn.Module] | None, options: dict[str, Any],
               dist: Any) -> nn.Module:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as exc:  # FSDP2 is public from torch 2.6
        raise RuntimeError(f"strategy='fsdp' needs FSDP2 (torch >= 2.6; this is torch {torch.__version__})") from exc
    _check_options(fully_shard, options, ("module", "mesh", "mp_policy"), "fully_shard")
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute == param_dtype else compute,
        reduce_dtype=_reduce_dtype(reduce_dtype, compute, dist.get_world_size()),
    )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in _chosen_layers(model, layers):
        fully_shard(block, mesh=mesh, mp_policy=policy, **options)
    fully_shard(model, mesh=mesh, mp_policy=policy, **options)
    return model
