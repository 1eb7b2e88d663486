"""torch_npu's fused operators for the simulated NPU, with torch_npu's names, signatures and results.

Each follows its entry in torchport's snapshot of torch_npu's contract (``torchport/backends/data/
torch_npu_contract.json``: the op-plugin schema, the backward, the chips and the documented limits), and
``tests/backends/test_npu_contract.py`` holds them to it:

* the signature is the schema's (names, order, defaults, keyword-only arguments), and so is the number of results;
* a chip that torch_npu does not document the operator for fails when it is called, with RuntimeError (a real
  torch_npu has every operator as an attribute on every chip; :func:`only` simulates an older torch_npu *release*
  without some, whose attribute is then absent);
* arguments outside the documented limits fail with RuntimeError, as the real operator refuses them (where the
  documentation leaves the behaviour open, such as ``npu_rotary_mul``'s r1/r2 outside [-1, 1], the simulation
  refuses too, so that a caller relying on it is caught);
* operators with a backward (derivatives.yaml) are differentiable; the outputs it lists as non-differentiable are
  detached; an operator without one fails in the backward, as autograd does for a derivative that is not
  implemented.

They compute with ordinary PyTorch ops on the simulated device, and count their calls, so tests can check that a
kernel took the fused path.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..backends.npu import operator_limits

__all__ = ["OPS", "calls", "enabled", "lookup", "only"]

calls: collections.Counter[str] = collections.Counter()


def _start(name: str) -> dict[str, Any]:
    """Count the call, fail as torch_npu does on a chip without the operator; returns the operator's limits."""
    from .simulated_npu import state

    calls[name] += 1
    chip = state().chip
    reason = chip.lacks(name)
    if reason is not None:
        raise RuntimeError(f"{name}: NPU function error: the operator has no kernel for {chip.soc_version}: {reason} "
                           "(simulated chip, torchport.testing)")
    return operator_limits(name)


def _family() -> str:
    from .simulated_npu import state

    return state().chip.family


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class _NoDerivative(torch.autograd.Function):
    """Forward as given; the backward fails as autograd does for an operator without a derivative formula."""

    @staticmethod
    def forward(ctx: Any, name: str, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.name = name
        return out.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(f"the derivative for '{ctx.name}' is not implemented (torch_npu's derivatives.yaml has "
                           "no entry for it; simulated by torchport.testing)")


def _without_backward(name: str, out: torch.Tensor, inputs: Iterable[Any]) -> torch.Tensor:
    grads = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not grads or not torch.is_grad_enabled():
        return out
    return _NoDerivative.apply(name, out.detach(), *grads)


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: normalised over gamma's dims, y in self's dtype, rstd float32 with those dims kept as 1."""
    limits = _start("npu_rms_norm")
    low, high = limits["input_dims"]
    if not low <= self.dim() <= high:
        raise RuntimeError(f"npu_rms_norm: self must have {low} to {high} dims, got {list(self.shape)}")
    if gamma.dim() > self.dim() or tuple(gamma.shape) != tuple(self.shape[self.dim() - gamma.dim():]):
        raise RuntimeError(f"npu_rms_norm: gamma {list(gamma.shape)} must be the trailing dims of self "
                           f"{list(self.shape)}")
    family = _family()
    pairs = [tuple(pair) for pair in limits["dtype_pairs"].get(family, [])]
    if (_dtype_name(self), _dtype_name(gamma)) not in pairs:
        raise RuntimeError(f"npu_rms_norm: (self, gamma) dtypes ({_dtype_name(self)}, {_dtype_name(gamma)}) are not "
                           f"supported on {family}; supported: {pairs}")
    least = limits["min_last_dim_bytes"].get(family)
    if least is not None and self.shape[-1] * self.element_size() < least:
        raise RuntimeError(f"npu_rms_norm: on {family} the last dim must hold at least {least} bytes, got "
                           f"{self.shape[-1]} x {self.element_size()}")
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    h = self.float()
    rstd = torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + epsilon)
    return (h * rstd * gamma.float()).to(self.dtype), rstd.detach()


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half",
                   rotate: torch.Tensor | None = None) -> torch.Tensor:
    """``self·r1 + rotate(self)·r2``, r1/r2 broadcast to self; rotate halves (``"half"``) or pairs
    (``"interleave"``)."""
    limits = _start("npu_rotary_mul")
    low, high = limits["input_dims"]
    if rotate is not None:
        raise RuntimeError("npu_rotary_mul: the rotate matrix is not simulated by torchport.testing")
    if rotary_mode not in limits["rotary_modes"]:
        raise RuntimeError(f"npu_rotary_mul: rotary_mode {rotary_mode!r} is not one of {limits['rotary_modes']}")
    if not low <= self.dim() <= high or r1.dim() != self.dim() or r2.shape != r1.shape:
        raise RuntimeError(f"npu_rotary_mul: self, r1 and r2 must have {low} or {high} dims, r1 and r2 one shape; "
                           f"got {list(self.shape)}, {list(r1.shape)}, {list(r2.shape)}")
    head_dim = self.shape[-1]
    if head_dim % limits["head_dim_multiple"] or head_dim >= limits["head_dim_below"]:
        raise RuntimeError(f"npu_rotary_mul: the last dim must be even and below {limits['head_dim_below']}, "
                           f"got {head_dim}")
    if self.dim() == 4 and (self.shape[0] >= limits["batch_below"] or self.shape[1] >= limits["heads_below"]):
        raise RuntimeError(f"npu_rotary_mul: B and N must be below {limits['batch_below']}, got {list(self.shape)}")
    if _family() in limits["compiled_kernel_families"]:
        kernel = limits["compiled_kernel"]
        if (self.dim() != kernel["input_dims"] or head_dim != kernel["head_dim"] or r1.shape[0] != kernel["r_batch"]
                or rotary_mode not in kernel["rotary_modes"] or self.shape[0] > kernel["batch_max"]
                or self.shape[1] > kernel["heads_max"]):
            raise RuntimeError(f"npu_rotary_mul: on {_family()} it takes 4-D input with D = {kernel['head_dim']}, "
                               f"r1/r2 of batch {kernel['r_batch']} and the half mode; got {list(self.shape)}, "
                               f"{list(r1.shape)}, {rotary_mode!r}")
    low_r, high_r = limits["r_range"]
    for name, r in (("r1", r1), ("r2", r2)):
        if r.numel() and not bool(((r >= low_r) & (r <= high_r)).all()):
            raise RuntimeError(f"npu_rotary_mul: {name} must lie in [{low_r}, {high_r}] (torch_npu documents that "
                               "range; outside it the result is not specified)")
    if rotary_mode == "half":
        half = head_dim // 2
        rotated = torch.cat((-self[..., half:], self[..., :half]), dim=-1)
    else:
        pairs = self.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return self * r1 + rotated * r2


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(a)·b`` where ``a, b = self.chunk(2, dim)``."""
    limits = _start("npu_swiglu")
    low, high = limits["input_dims"]
    if not low <= self.dim() <= high or self.numel() == 0 or not self.is_contiguous():
        raise RuntimeError(f"npu_swiglu: self must be a contiguous, non-empty tensor of {low} to {high} dims, got "
                           f"{list(self.shape)} (contiguous: {self.is_contiguous()})")
    if self.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu: dim {dim} of {list(self.shape)} does not split in two halves")
    a, b = self.chunk(2, dim=dim)
    return (F.silu(a.float()) * b.float()).to(self.dtype)


def npu_gelu(self: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    limits = _start("npu_gelu")
    if approximate not in limits["approximate"]:
        raise RuntimeError(f"npu_gelu: approximate {approximate!r} is not one of {limits['approximate']}")
    return F.gelu(self, approximate=approximate)


OPS: dict[str, Callable[..., Any]] = {
    fn.__name__: fn for fn in (npu_rms_norm, npu_rotary_mul, npu_swiglu, npu_gelu)
}
enabled: set[str] = set(OPS)


def lookup(name: str) -> Callable[..., Any] | None:
    """The operator ``name`` if the simulated torch_npu release has it (whatever the chip: see the module docs)."""
    return OPS.get(name) if name in enabled else None


@contextlib.contextmanager
def only(names: Iterable[str]) -> Iterator[None]:
    """Simulate a torch_npu release that has only the operators ``names`` (e.g. ``()`` for none) in a block: the
    others are absent attributes, as in a release older than them. (A chip without an operator is another matter:
    :func:`torchport.testing.simulated_chip`.)"""
    names = set(names)
    unknown = names - set(OPS)
    if unknown:
        raise ValueError(f"no simulated fused operator(s) {sorted(unknown)}; simulated: {', '.join(OPS)}")
    saved = set(enabled)
    enabled.clear()
    enabled.update(names)
    try:
        yield
    finally:
        enabled.clear()
        enabled.update(saved)


def npu_cross_entropy_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                           reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                           lse_square_scale_for_zloss: float = 0.0,
                           return_zloss: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, log_prob, zloss, lse_for_zloss)``.

    Contract (torch_npu documentation): input ``[N, C]`` fp16/bf16/fp32 with 0 < N <= 200000; target int64 in
    ``[0, C)``; ignore_index < C, a negative one ignoring nothing; loss in input's dtype (``[N]`` for "none", else
    one element); log_prob ``[N, C]``; z-loss documented as not supported yet (its outputs are empty). When input
    requires grad, "sum" and "none" take only the default label_smoothing, and "mean" only the defaults of weight,
    ignore_index and label_smoothing.
    """
    limits = _start("npu_cross_entropy_loss")
    low, high = limits["rows"]
    if input.dim() != 2 or not low <= input.shape[0] <= high:
        raise RuntimeError(f"npu_cross_entropy_loss: input must be [N, C] with {low} <= N <= {high}, got "
                           f"{list(input.shape)}")
    if target.dtype != torch.int64 or target.shape != input.shape[:1]:
        raise RuntimeError("npu_cross_entropy_loss: target must be int64 of shape [N]")
    if ((target < 0) | (target >= input.shape[1])).any():
        raise RuntimeError("npu_cross_entropy_loss: target values must lie in [0, C)")
    if reduction not in limits["reductions"]:
        raise RuntimeError(f"npu_cross_entropy_loss: reduction {reduction!r} is not one of {limits['reductions']}")
    if lse_square_scale_for_zloss or return_zloss:
        raise RuntimeError("npu_cross_entropy_loss: z-loss is not supported")
    if input.requires_grad and torch.is_grad_enabled():
        given = {"weight": weight is not None, "ignore_index": ignore_index != -100,
                 "label_smoothing": label_smoothing != 0.0}
        refused = [name for name in limits["defaults_only_when_input_requires_grad"][reduction] if given[name]]
        if refused:
            raise RuntimeError(f"npu_cross_entropy_loss: when input requires grad, reduction={reduction!r} takes only "
                               f"the default {', '.join(refused)}")
    log_prob = torch.log_softmax(input.float(), dim=-1)
    loss = F.nll_loss(log_prob, target, weight, ignore_index=ignore_index if ignore_index >= 0 else -(2**62),
                      reduction=reduction)
    if label_smoothing:
        smooth = -log_prob.mean(-1)
        if ignore_index >= 0:
            smooth = torch.where(target == ignore_index, torch.zeros_like(smooth), smooth)
        smooth = smooth if reduction == "none" else smooth.sum() if reduction == "sum" else smooth.mean()
        loss = (1 - label_smoothing) * loss + label_smoothing * smooth
    loss = loss.to(input.dtype)
    if reduction != "none":
        loss = loss.reshape(1)
    empty = input.new_empty(0)
    return loss, log_prob.detach().to(input.dtype), empty, empty


OPS[npu_cross_entropy_loss.__name__] = npu_cross_entropy_loss
enabled.add(npu_cross_entropy_loss.__name__)


_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_SIMULATED_SPARSE_MODES = (0, 1, 2, 3)
_COMPRESSED = 2048  # side of the compressed lower-triangular mask that sparse modes 2, 3 and 4 take


def _to_bnsd(t: torch.Tensor, layout: str, heads: int | None, head_dim: int | None) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    seq_first = layout == "SBH"
    b_s_h = t.transpose(0, 1) if seq_first else t  # [B, S, H]
    if heads is None:
        heads = b_s_h.shape[-1] // head_dim
    return b_s_h.reshape(b_s_h.shape[0], b_s_h.shape[1], heads, -1).transpose(1, 2)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t.contiguous()
    if layout == "BSND":
        return t.transpose(1, 2).contiguous()
    b_s_h = t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)
    return (b_s_h.transpose(0, 1) if layout == "SBH" else b_s_h).contiguous()


def npu_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                         input_layout: str, pse: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                         atten_mask: torch.Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0,
                         pre_tockens: int = 2147483647, next_tockens: int = 2147483647, inner_precise: int = 0,
                         prefix: list[int] | None = None, actual_seq_qlen: list[int] | None = None,
                         actual_seq_kvlen: list[int] | None = None, sparse_mode: int = 0,
                         gen_mask_parallel: bool = True, sync: bool = False, softmax_layout: str = "",
                         sink: torch.Tensor | None = None, dropout_mask: torch.Tensor | None = None, seed: int = 0,
                         offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int,
                                                   int]:
    """``torch_npu.npu_fusion_attention`` -> ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset,
    numels)``.

    Contract (torch_npu documentation, op-plugin ``torch_npu-npu_fusion_attention.md``, and the vendor's golden
    reference in mindstudio-probe's ``bench_functions/npu_fusion_attention.py``):

    * query, key, value in fp16, bf16 or fp32, one dtype, laid out as ``input_layout``: ``BSH``, ``SBH``, ``BSND``,
      ``BNSD`` (``TND``, the varlen layout, is not simulated). ``head_num`` is the query's head count N1; key and
      value have N2 heads with N1 % N2 == 0 (GQA), 1 <= N1 <= 256. Key and value have one shape (so Dv == Dk; the
      documentation's "Dk >= Dv" contradicts its own "key and value must have the same shape", which the
      simulation follows), and 1 <= D <= 768.
    * ``scores = (query @ keyᵀ + pse) * scale`` (``scale`` defaults to 1, not 1/sqrt(D)); ``atten_mask`` is bool or
      uint8, **True/1 = masked out**, of shape [B, N1, Sq, Skv], [B, 1, Sq, Skv], [1, 1, Sq, Skv] or [Sq, Skv]; the
      golden reference adds -40000 at masked positions (a row masked everywhere therefore attends to every key).
    * ``sparse_mode`` 0 (the mask as given; no mask = full attention), 1 (allMask: the full mask), 2 (leftUpCausal)
      and 3 (rightDownCausal) — modes 2 and 3 take the compressed 2048x2048 mask ``torch.triu(ones, diagonal=1)``
      and build the causal mask aligned top-left (key j masked for query i when j > i) or bottom-right
      (j > i + Skv - Sq). Without a mask, sparse_mode, pre_tockens and next_tockens are ignored. Band and prefix
      modes (4 to 8) are not simulated.
    * ``keep_prob`` < 1 applies dropout to the probabilities.
    * softmax_max / softmax_sum are float32 [B, N1, Sq, 8] (the row max and the sum of exp(score - max), repeated
      8 times); softmax_out is reserved (empty); seed, offset, numels are ints (0 without dropout).
    * the arguments added by later releases (softmax_layout for TND, sink, dropout_mask, seed, offset) are taken at
      their defaults only.

    torch_npu documents it for training, and not for graph mode or aclgraph capture; the simulation cannot tell a
    graph from eager execution, so callers must avoid those themselves.
    """
    limits = _start("npu_fusion_attention")
    if softmax_layout or sink is not None or dropout_mask is not None or seed or offset:
        raise RuntimeError("npu_fusion_attention: softmax_layout, sink, dropout_mask, seed and offset are simulated "
                           "at their defaults only")
    if input_layout not in limits["layouts"]:
        raise RuntimeError(f"npu_fusion_attention: input_layout {input_layout!r} is not one of {', '.join(_LAYOUTS)}")
    if input_layout == "TND":
        raise RuntimeError("npu_fusion_attention: the TND (varlen) layout is not simulated by torchport.testing")
    if sparse_mode not in _SIMULATED_SPARSE_MODES:
        raise RuntimeError(f"npu_fusion_attention: sparse_mode={sparse_mode} is not simulated (simulated: "
                           f"{', '.join(map(str, _SIMULATED_SPARSE_MODES))})")
    if padding_mask is not None:
        raise RuntimeError("npu_fusion_attention: padding_mask is not supported (torch_npu documents it as such)")
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (torch.float16, torch.bfloat16,
                                                                             torch.float32):
        raise RuntimeError(f"npu_fusion_attention: query, key and value must share one of float16, bfloat16, "
                           f"float32; got {query.dtype}, {key.dtype}, {value.dtype}")
    if not 0 < keep_prob <= 1:
        raise RuntimeError(f"npu_fusion_attention: keep_prob must lie in (0, 1], got {keep_prob}")
    if input_layout in ("BSH", "SBH"):
        if query.dim() != 3 or query.shape[-1] % head_num:
            raise RuntimeError(f"npu_fusion_attention: {input_layout} query of shape {list(query.shape)} does not "
                               f"split into head_num={head_num} heads")
        head_dim = query.shape[-1] // head_num
        q = _to_bnsd(query, input_layout, head_num, None)
        k = _to_bnsd(key, input_layout, None, head_dim)
        v = _to_bnsd(value, input_layout, k.shape[1], None)
    else:
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise RuntimeError(f"npu_fusion_attention: {input_layout} takes 4-D query, key and value")
        q, k, v = (_to_bnsd(t, input_layout, None, None) for t in (query, key, value))
    batch, heads, s_q, d_q = q.shape
    kv_heads, s_kv, d_k = k.shape[1], k.shape[2], k.shape[3]
    if heads != head_num:
        raise RuntimeError(f"npu_fusion_attention: head_num={head_num} but the query has {heads} heads")
    if key.shape != value.shape:
        raise RuntimeError(f"npu_fusion_attention: key {list(key.shape)} and value {list(value.shape)} must have the "
                           "same shape")
    if k.shape[0] != batch:
        raise RuntimeError(f"npu_fusion_attention: key {list(key.shape)} does not match the query "
                           f"{list(query.shape)} in batch")
    if heads % kv_heads:
        raise RuntimeError(f"npu_fusion_attention: query heads ({heads}) must be a multiple of key/value heads "
                           f"({kv_heads})")
    low_n, high_n = limits["query_heads"]
    low_d, high_d = limits["head_dim"]
    if not low_n <= heads <= high_n:
        raise RuntimeError(f"npu_fusion_attention: the query has {heads} heads; allowed: {low_n} to {high_n}")
    if d_q != d_k or not low_d <= d_k <= high_d:
        raise RuntimeError(f"npu_fusion_attention: query and key head dims must be equal and within {low_d} to "
                           f"{high_d}; got {d_q} and {d_k}")

    masked = None
    if atten_mask is not None:
        if atten_mask.dtype not in (torch.bool, torch.uint8):
            raise RuntimeError(f"npu_fusion_attention: atten_mask must be bool or uint8, got {atten_mask.dtype}")
        if sparse_mode in (2, 3):
            expected = torch.triu(torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool), diagonal=1)
            if tuple(atten_mask.shape) != (_COMPRESSED, _COMPRESSED) or not torch.equal(atten_mask.cpu().bool(),
                                                                                        expected):
                raise RuntimeError(f"npu_fusion_attention: sparse_mode={sparse_mode} takes the compressed "
                                   "2048x2048 mask torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1); "
                                   f"got shape {list(atten_mask.shape)}")
            offset = 1 if sparse_mode == 2 else s_kv - s_q + 1
            masked = torch.triu(torch.ones(s_q, s_kv, dtype=torch.bool, device=q.device), diagonal=offset)
        else:
            shape = tuple(atten_mask.shape)
            valid = shape == (s_q, s_kv) or (len(shape) == 4 and shape[2:] == (s_q, s_kv)
                                             and shape[0] in (1, batch) and shape[1] in (1, heads))
            if not valid:
                raise RuntimeError(f"npu_fusion_attention: atten_mask of shape {list(shape)} is none of BNSS, B1SS, "
                                   f"11SS, SS for B={batch}, N={heads}, Sq={s_q}, Skv={s_kv}")
            masked = atten_mask.bool()

    group = heads // kv_heads
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ kf.transpose(-1, -2)
    if pse is not None:
        scores = scores + pse.float()
    scores = scores * scale
    if masked is not None:
        scores = scores - masked.float() * 40000.0
    row_max = scores.amax(dim=-1, keepdim=True)
    exp = torch.exp(scores - row_max)
    row_sum = exp.sum(dim=-1, keepdim=True)
    probs = exp / row_sum
    if keep_prob < 1:
        probs = F.dropout(probs, p=1 - keep_prob)
    out = (probs @ vf).to(query.dtype)
    softmax_max = row_max.detach().expand(batch, heads, s_q, 8).contiguous()
    softmax_sum = row_sum.detach().expand(batch, heads, s_q, 8).contiguous()
    return _from_bnsd(out, input_layout), softmax_max, softmax_sum, query.new_empty(0), 0, 0, 0


OPS[npu_fusion_attention.__name__] = npu_fusion_attention
enabled.add(npu_fusion_attention.__name__)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """``torch_npu.npu_convert_weight_to_int4pack``: int32 ``(k, n)`` with values in [-8, 7] -> int32 ``(k, n / 8)``.

    Contract (torch_npu documentation): 2-D contiguous int32 input, last dimension a multiple of 8, values inside
    int4's range; eight codes per int32. torch_npu's order inside a word is its own; the simulation puts code ``i``
    of a word in bits ``4i..4i+3``, and :func:`npu_weight_quant_batchmatmul` reads it back the same way.
    """
    limits = _start("npu_convert_weight_to_int4pack")
    if weight.dtype != torch.int32 or weight.dim() != limits["dims"] or not weight.is_contiguous():
        raise RuntimeError("npu_convert_weight_to_int4pack: weight must be a contiguous 2-D int32 tensor")
    if weight.shape[-1] % limits["last_dim_multiple"]:
        raise RuntimeError(f"npu_convert_weight_to_int4pack: the last dimension ({weight.shape[-1]}) must be a "
                           f"multiple of {limits['last_dim_multiple']}")
    low, high = limits["value_range"]
    if ((weight < low) | (weight > high)).any():
        raise RuntimeError(f"npu_convert_weight_to_int4pack: values must lie in int4's range [{low}, {high}]")
    nibbles = (weight & 0xF).to(torch.int64).reshape(*weight.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, device=weight.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_int4(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).reshape(*words.shape[:-1], -1)


def npu_weight_quant_batchmatmul(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                                 antiquant_offset: torch.Tensor | None = None, quant_scale: torch.Tensor | None = None,
                                 quant_offset: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                                 antiquant_group_size: int = 0, inner_precise: int = 0,
                                 weight_dtype: int | None = None) -> torch.Tensor:
    """``torch_npu.npu_weight_quant_batchmatmul``: ``x @ ((weight + antiquant_offset) * antiquant_scale) + bias``.

    Contract (torch_npu documentation): x ``(M, K)`` fp16/bf16 (fp16 only on 310P); weight ``(K, N)`` int8, or
    int32 ``(K, N / 8)`` from :func:`npu_convert_weight_to_int4pack` (not on 310P; transposed views allowed); K and
    N within [1, 65535]; antiquant_scale in x's dtype, ``(N,)`` / ``(1, N)`` per channel or ``(ceil(K / group), N)``
    per group, with ``antiquant_group_size`` 0 (no groups) or a multiple of 32 within [32, K - 1]; antiquant_offset
    of the same shape and dtype; output in x's dtype; no backward. Output quantisation (quant_scale) and
    weight_dtype are not simulated.
    """
    limits = _start("npu_weight_quant_batchmatmul")
    family = _family()
    x_dtypes, weight_dtypes = limits["x_dtypes"][family], limits["weight_dtypes"][family]
    if _dtype_name(x) not in x_dtypes or x.dim() != limits["x_dims"]:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: x must be 2-D {'/'.join(x_dtypes)} on {family}, got "
                           f"{x.dtype} {list(x.shape)}")
    if quant_scale is not None or quant_offset is not None or weight_dtype is not None:
        raise RuntimeError("npu_weight_quant_batchmatmul: output quantisation and weight_dtype are not simulated")
    if _dtype_name(weight) not in weight_dtypes:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: weight must be {' or '.join(weight_dtypes)} on {family} "
                           f"(int32 holds packed int4), got {weight.dtype}")
    codes = weight.to(torch.int32) if weight.dtype == torch.int8 else _unpack_int4(weight.contiguous())
    k, n = codes.shape
    if x.shape[1] != k:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: x has K={x.shape[1]}, weight has K={k}")
    low, high = limits["k_n_range"]
    if not (low <= k <= high and low <= n <= high) or x.shape[0] == 0:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: K and N must lie in [{low}, {high}] and x must not be "
                           f"empty; got M={x.shape[0]}, K={k}, N={n}")
    if antiquant_group_size and not (limits["group_size_min"] <= antiquant_group_size <= k - 1
                                     and antiquant_group_size % limits["group_size_multiple"] == 0):
        raise RuntimeError(f"npu_weight_quant_batchmatmul: antiquant_group_size must be 0 or a multiple of "
                           f"{limits['group_size_multiple']} within [{limits['group_size_min']}, K - 1 = {k - 1}], "
                           f"got {antiquant_group_size}")
    for name, t in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset)):
        if t is not None and t.dtype != x.dtype:
            raise RuntimeError(f"npu_weight_quant_batchmatmul: {name} must have x's dtype {x.dtype}, got {t.dtype}")
    if antiquant_group_size:
        groups = -(-k // antiquant_group_size)
        if tuple(antiquant_scale.shape) != (groups, n):
            raise RuntimeError(f"npu_weight_quant_batchmatmul: per-group scales must be ({groups}, {n}), got "
                               f"{list(antiquant_scale.shape)}")
        expand = lambda t: t.float().repeat_interleave(antiquant_group_size, dim=0)[:k]  # noqa: E731
    else:
        if antiquant_scale.numel() not in (1, n):
            raise RuntimeError(f"npu_weight_quant_batchmatmul: per-channel scales must have {n} elements")
        expand = lambda t: t.float().reshape(1, -1)  # noqa: E731
    w = codes.float()
    if antiquant_offset is not None:
        w = w + expand(antiquant_offset)
    w = w * expand(antiquant_scale)
    out = x.float() @ w
    if bias is not None:
        wanted = limits["bias_dtype"][_dtype_name(x)]
        if _dtype_name(bias) != wanted:
            raise RuntimeError(f"npu_weight_quant_batchmatmul: bias must be {wanted} for {x.dtype} x, got {bias.dtype}")
        out = out + bias.float()
    return _without_backward("npu_weight_quant_batchmatmul", out.to(x.dtype),
                             (x, antiquant_scale, antiquant_offset, bias))


for _op in (npu_convert_weight_to_int4pack, npu_weight_quant_batchmatmul):
    OPS[_op.__name__] = _op
    enabled.add(_op.__name__)
