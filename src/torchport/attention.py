"""Which attention to run on a device, and getting Hugging Face models to run it.

:func:`best` names the Hugging Face ``attn_implementation`` that computes attention best on a device; each backend
declares its own choice (``Backend.attention_implementation``): FlashAttention-3 / -2 on NVIDIA GPUs where the
flash-attn package is installed and built for the GPU, else ``"sdpa"``; ``"npu_fusion_attention"`` on Ascend NPUs
(torch_npu's fused ``npu_fusion_attention`` operator); ``"sdpa"`` on CPUs and other devices.

``"npu_fusion_attention"`` is not a transformers name: :func:`register` adds it to transformers'
``AttentionInterface`` (with SDPA's boolean masks, ``AttentionMaskInterface``). The function behind it calls the
fused operator where the tensors' device and chip have it and SDPA elsewhere (a model built on the CPU and moved
later, or moved back), so a model set to it runs on any device. It also takes SDPA for what the operator's
documentation excludes (torch_npu_contract.json): key and value of different shapes (an MLA model's), head dims
above 768 or more than 256 query heads (one warning per reason), and graphs being compiled (the operator is
documented for eager execution only, not graph mode).

:func:`apply` sets a loaded model's implementation; :func:`install_hook` makes ``from_pretrained(...,
attn_implementation="flash_attention_2")`` on a machine without flash-attn load with the best available
implementation and one warning instead of transformers' ImportError (and, with ``default=True``, gives models built
without an ``attn_implementation`` the best one). transformers is imported only by these functions.

Example:
    >>> torchport.attention.best("npu")
    'npu_fusion_attention'
    >>> torchport.attention.apply(model)          # the best for the device the model is on
    'npu_fusion_attention'
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import _settings
from .backends import get_backend
from .backends.npu import operator_limits
from .device import DeviceLike, resolve
from .kernels.registry import Unsupported, fused_op_unavailable

__all__ = ["FUSED", "apply", "best", "hook_installed", "install_hook", "register", "remove_hook"]

logger = logging.getLogger("torchport")

_FLASH = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
_lock = threading.RLock()
_warned: set[tuple[str, ...]] = set()
_broken: dict[tuple[str, str, torch.dtype], str] = {}  # (operator, device type, dtype) -> why it failed
# (operator, device type) -> the operator or None; a plain dict, so that torch.compile traces the look-up
_operators: dict[tuple[str, str], Callable[..., Any] | None] = {}
_masks: dict[torch.device, torch.Tensor] = {}


def best(device: DeviceLike = None) -> str:
    """The Hugging Face ``attn_implementation`` that computes attention best on ``device`` (default:
    :func:`torchport.device`).

    ``"flash_attention_3"`` on Hopper GPUs and ``"flash_attention_2"`` on Ampere and later (and ROCm) where the
    flash-attn package imports; ``"npu_fusion_attention"`` on Ascend NPUs whose torch_npu has that operator;
    ``"sdpa"`` everywhere else.

    Example:
        >>> torchport.attention.best("cpu")
        'sdpa'
    """
    backend, index = resolve(device)
    return backend.attention_implementation(index)


# -- the fused attention functions registered with transformers ------------------------------------------------------
def _npu_fusion_attention(op: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          keep: torch.Tensor | None, causal: bool, scale: float, keep_prob: float) -> torch.Tensor:
    """torch_npu.npu_fusion_attention on [B, N, S, D] tensors (query N a multiple of key/value N) -> [B, N, Sq, Dv].

    Its mask marks what is masked *out* (True), the reverse of SDPA's. Causal attention goes through the
    compressed 2048x2048 mask with sparse_mode 2 (top-left aligned, as SDPA's is_causal; the caller made Sq == Skv),
    which lets the operator skip the masked blocks instead of reading a full [Sq, Skv] mask.

    Raises:
        Unsupported: tensors outside the operator's documented limits (the caller takes SDPA for them).
    """
    limits = operator_limits("npu_fusion_attention")
    if k.shape != v.shape:
        raise Unsupported(f"npu_fusion_attention takes key and value of one shape, not {list(k.shape)} and "
                          f"{list(v.shape)}")
    (low_d, high_d), (low_n, high_n) = limits["head_dim"], limits["query_heads"]
    if not (low_d <= q.shape[-1] <= high_d and low_n <= q.shape[1] <= high_n):
        raise Unsupported(f"npu_fusion_attention takes head dims of {low_d} to {high_d} and {low_n} to {high_n} "
                          f"query heads, not {q.shape[-1]} and {q.shape[1]}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    heads = q.shape[1]
    if causal:
        mask = _masks.get(q.device)
        if mask is None:
            mask = _masks[q.device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=q.device), 1)
        return op(q, k, v, heads, "BNSD", atten_mask=mask, scale=scale, keep_prob=keep_prob, sparse_mode=2)[0]
    return op(q, k, v, heads, "BNSD", atten_mask=None if keep is None else ~keep, scale=scale,
              keep_prob=keep_prob)[0]


#: The fused attention operators torchport can run for transformers, by the vendor's name (which is also the
#: ``attn_implementation`` name it registers): ``(operator, q, k, v, keep mask, causal, scale, keep_prob) -> out``.
FUSED: dict[str, Callable[..., torch.Tensor]] = {"npu_fusion_attention": _npu_fusion_attention}


def _warn_once(key: tuple[str, ...], message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.info("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _fused_operator(name: str, device: torch.device, dtype: torch.dtype) -> Callable[..., Any] | None:
    if (name, device.type, dtype) in _broken:
        return None
    key = (name, device.type)
    if key not in _operators:  # None where the software stack or the chip lacks it
        _operators[key] = None if fused_op_unavailable(name, device) else get_backend(device.type).fused_op(name)
    return _operators[key]


def _sdpa(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def _make_forward(name: str) -> Callable[..., tuple[torch.Tensor, None]]:
    glue = FUSED[name]

    def forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        # What SDPA's path handles and this one does not (soft-capping, position biases, paged caches, float masks,
        # attention weights) goes to SDPA, which supports or refuses it with transformers' own message.
        unsupported = (kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
                       or kwargs.get("cache") is not None or kwargs.get("output_attentions")
                       or (attention_mask is not None and attention_mask.dtype != torch.bool))
        op = None if unsupported else _fused_operator(name, query.device, query.dtype)
        if op is None or torch.compiler.is_compiling():  # documented for eager execution, not graph mode
            return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
        q_len, kv_len = query.shape[2], key.shape[2]
        # the same causal rule as transformers' SDPA path: a causal model's prefill without a mask
        causal = q_len > 1 and attention_mask is None and (
            is_causal if is_causal is not None else getattr(module, "is_causal", True))
        k, v, keep = key, value, attention_mask
        if causal and kv_len > q_len:  # prefill into an empty static cache: the keys past q_len are all masked
            k, v = key[:, :, :q_len], value[:, :, :q_len]
        valid = None
        if keep is not None:
            # A query row that may attend to nothing (left padding) gives 0 in SDPA; a fused kernel's answer there is
            # unspecified. Let such rows attend everywhere (finite values) and zero them afterwards, without asking the
            # device whether any exists (that would synchronise on every layer).
            valid = keep.any(dim=-1, keepdim=True)
            keep = keep | ~valid
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        try:
            out = glue(op, query, k, v, keep, causal, float(scale), 1.0 - float(dropout))
        except torch.OutOfMemoryError:
            raise
        except Unsupported as exc:  # these tensors only: the operator stays in use for the others
            _warn_once(("unsupported", name, str(exc)), f"torchport.attention: {exc}; using sdpa for these")
            return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if _settings.value("strict"):
                raise
            _broken[(name, query.device.type, query.dtype)] = reason
            _warn_once(("broken", name, query.device.type, str(query.dtype)),
                       f"torchport.attention: {name} failed on {query.device} for {query.dtype} ({reason}); "
                       "using sdpa instead")
            return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
        if valid is not None:
            out = out.masked_fill(~valid, 0.0)
        return out.transpose(1, 2).contiguous(), None

    forward.__name__ = forward.__qualname__ = f"{name}_forward"
    forward.__doc__ = f"transformers attention function running {name} where the device has it, else SDPA."
    return forward


@functools.lru_cache(maxsize=None)
def register() -> tuple[str, ...]:
    """Register torchport's fused attention functions with transformers (``AttentionInterface`` and, with SDPA's
    boolean masks, ``AttentionMaskInterface``), so that ``attn_implementation="npu_fusion_attention"`` is valid.
    Once per process; the other functions of this module call it.

    Returns:
        The names registered.

    Example:
        >>> torchport.attention.register()
        ('npu_fusion_attention',)
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name in FUSED:
        AttentionInterface.register(name, _make_forward(name))
        AttentionMaskInterface.register(name, sdpa_mask)
    return tuple(FUSED)


# -- choosing for a model ----------------------------------------------------------------------------------------------
def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _supports(model: nn.Module, name: str) -> bool:
    """Whether a transformers model class can run ``name`` (its own declarations; no device check)."""
    if name in _FLASH:
        return bool(getattr(model, "_supports_flash_attn", False))
    if name == "sdpa" or name in FUSED:  # the fused functions keep SDPA's contract, masks included
        return bool(getattr(model, "_supports_sdpa", False))
    return True


def _choice_for(model: nn.Module, device: DeviceLike, dtype: torch.dtype | None = None,
                avoid: str | None = None) -> str:
    """The best implementation for ``model`` on ``device`` that its class supports (flash only in fp16/bf16)."""
    chosen = best(device)
    if chosen == avoid or not _supports(model, chosen) or (
            chosen in _FLASH and dtype is not None and dtype not in (torch.float16, torch.bfloat16)):
        chosen = "sdpa"
    if not _supports(model, chosen):
        chosen = "eager"
    if chosen in FUSED:
        register()
    return chosen


def apply(model: nn.Module, implementation: str | None = None, *, device: DeviceLike = None) -> str:
    """Set a loaded transformers model's attention implementation (and its sub-models'): ``implementation``, or
    by default the best one that the model class supports for ``device`` (default: the device its parameters are
    on; FlashAttention only for fp16/bf16 weights).

    Raises:
        TypeError: not a transformers model.
        ValueError: the model does not dispatch attention through transformers' ``AttentionInterface`` (its
            implementation is fixed when it is built: pass ``attn_implementation=`` to ``from_pretrained``), or
            transformers refuses the implementation (its message says why).

    Returns:
        The implementation the model now uses.

    Example:
        >>> torchport.attention.apply(model.to("npu"))
        'npu_fusion_attention'
    """
    if not callable(getattr(model, "set_attn_implementation", None)) or not hasattr(model, "config"):
        raise TypeError(f"torchport.attention.apply takes a transformers model, got {type(model).__name__}")
    if implementation is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        implementation = _choice_for(model, _model_device(model) if device is None else device, dtype)
    elif implementation in FUSED:
        register()
    current = model.config._attn_implementation
    if implementation != current:
        can_set = getattr(model, "_can_set_attn_implementation", None)
        if can_set is not None and not can_set():
            raise ValueError(
                f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, so "
                f"its implementation ({current!r}) cannot change after it is built; pass "
                f"attn_implementation={implementation!r} to from_pretrained instead")
        model.set_attn_implementation(implementation)
    return model.config._attn_implementation


# -- the hook on transformers' attention check -------------------------------------------------------------------------
# "original": transformers' check; "default": whether unset requests get the best; "device": the device chosen for
# (None: torchport.device() when each model is built)
_hook: dict[str, Any] = {}


def _device_for_new_models() -> torch.device:
    if _hook.get("device") is not None:
        return _hook["device"]
    from .device import device

    return device()


def _hooked_check(original: Callable[..., str]) -> Callable[..., str]:
    @functools.wraps(original)
    def check(self: Any, attn_implementation: Any = None, *args: Any, **kwargs: Any) -> str:
        dtype = getattr(self.config, "dtype", None)
        if attn_implementation is None and _hook.get("default"):
            chosen = _choice_for(self, _device_for_new_models(), dtype if isinstance(dtype, torch.dtype) else None)
            if chosen not in ("sdpa", "eager"):  # transformers' own default is SDPA (eager where unsupported)
                try:
                    return original(self, chosen, *args, **kwargs)
                except (ImportError, ValueError) as exc:
                    logger.info("torchport.attention: %s for %s: %s; using transformers' default", chosen,
                                type(self).__name__, exc)
            return original(self, attn_implementation, *args, **kwargs)
        try:
            return original(self, attn_implementation, *args, **kwargs)
        except (ImportError, ValueError) as exc:
            if not isinstance(attn_implementation, str) or attn_implementation.removeprefix("paged|") not in _FLASH:
                raise
            device = _device_for_new_models()
            chosen = _choice_for(self, device, avoid=attn_implementation.removeprefix("paged|"))
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _warn_once(("flash", attn_implementation, chosen),
                       f"torchport: attn_implementation={attn_implementation!r} cannot run here ({first}); using "
                       f"{chosen!r}, the best available on {device.type}")
            return original(self, chosen, *args, **kwargs)

    return check


def install_hook(default: bool = False, device: DeviceLike = None) -> None:
    """Make transformers take torchport's attention choice where it would fail or has no preference.

    A model asking for ``flash_attention_2`` / ``_3`` / ``_4`` that cannot run here (flash-attn missing, a GPU too old,
    a model class without flash support) gets the best available implementation for ``device`` (default:
    :func:`torchport.device` when the model is built) instead of transformers' ImportError or ValueError, with one
    warning per request. With ``default=True``, models built without an ``attn_implementation``
    (``from_pretrained``, ``from_config``, the constructor) also get the best one instead of transformers' default,
    SDPA. Installing again changes ``default`` and ``device``; :func:`remove_hook` undoes it. This is transformers' attention check (``PreTrainedModel._check_and_adjust_attn_implementation``,
    run when a model is built and by ``set_attn_implementation``), wrapped.

    Example:
        >>> torchport.attention.install_hook()
        >>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flash_attention_2")  # sdpa here
    """
    from transformers import PreTrainedModel

    chosen = None
    if device is not None:
        backend, index = resolve(device)
        chosen = backend.device(index)
    register()
    with _lock:
        if not _hook:
            original = PreTrainedModel.__dict__["_check_and_adjust_attn_implementation"]
            PreTrainedModel._check_and_adjust_attn_implementation = _hooked_check(original)
            _hook["original"] = original
        _hook["default"] = bool(default)
        _hook["device"] = chosen


def remove_hook() -> None:
    """Undo :func:`install_hook` (nothing happens when it is not installed).

    Example:
        >>> torchport.attention.remove_hook()
    """
    with _lock:
        if _hook:
            from transformers import PreTrainedModel

            PreTrainedModel._check_and_adjust_attn_implementation = _hook.pop("original")
            _hook.clear()


def hook_installed() -> dict[str, Any] | None:
    """``{"default": bool, "device": torch.device or None}`` (what :func:`install_hook` was given) while the hook is
    in effect, else None.

    Example:
        >>> torchport.attention.hook_installed()
        {'default': False, 'device': None}
    """
    with _lock:
        return {"default": _hook["default"], "device": _hook["device"]} if _hook else None
