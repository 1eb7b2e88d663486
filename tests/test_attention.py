"""torchport.attention: the best implementation per device, the npu_fusion_attention path against SDPA (the
simulated operator, its contract, forward and backward on irregular shapes, causal and padded), and the hook that
turns an impossible flash-attention request into the best available one.

Tolerances (relative: norm of the difference over the reference's norm): the simulated operator computes in
float32 and rounds once, SDPA's CPU kernel rounds in the input dtype. Seen over the cases below: float32 outputs
1.6e-7 and gradients 2.9e-7 apart, bfloat16 outputs 2.4e-3 and gradients 3.8e-3; asserted 1e-5 and 2e-2.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport import attention
from torchport.backends import get_backend
from torchport.kernels import registry

transformers = pytest.importorskip("transformers")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                                    num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=64,
                                    pad_token_id=0)


def _build(**kwargs: object) -> transformers.PreTrainedModel:
    """A tiny Llama (6 query heads, 2 key/value heads, head dim 8) from a fresh config, seeded weights."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(), **kwargs)


def _tiny_llama() -> transformers.PreTrainedModel:
    return _build(attn_implementation="sdpa")


def _fused_on(device: torch.device) -> bool:
    """Whether npu_fusion_attention runs on ``device`` (an NPU whose torch_npu and chip have it)."""
    return device.type == "npu" and registry.fused_op_unavailable("npu_fusion_attention", device) is None


def _needs_fused(npu: torch.device) -> None:
    reason = registry.fused_op_unavailable("npu_fusion_attention", npu)
    if reason is not None:
        pytest.skip(reason)


def _needs_dtype(device: torch.device, dtype: torch.dtype) -> None:
    if not get_backend(device.type).dtype_works(dtype, device.index or 0):
        pytest.skip(f"{dtype} does not work on {device} (dtype probe)")


@pytest.fixture
def fused_calls():
    from torchport.testing import npu_fused_ops

    before = npu_fused_ops.calls["npu_fusion_attention"]
    return lambda: npu_fused_ops.calls["npu_fusion_attention"] - before


# -- best ------------------------------------------------------------------------------------------------------------
def test_best_is_the_backends_choice(device: torch.device) -> None:
    chosen = attention.best(device)
    assert chosen == get_backend(device.type).attention_implementation(device.index or 0)
    expected = {"cpu": {"sdpa"}, "npu": {"npu_fusion_attention" if _fused_on(device) else "sdpa"},
                "cuda": {"flash_attention_3", "flash_attention_2", "sdpa"}}.get(device.type, {"sdpa"})
    assert chosen in expected


def test_best_on_npu_without_the_fused_operator_is_sdpa(npu: torch.device) -> None:
    from torchport.testing import npu_fused_ops

    with npu_fused_ops.only([]):
        assert attention.best(npu) == "sdpa"


def test_best_rejects_an_unknown_device() -> None:
    with pytest.raises(ValueError, match="registered: .*cpu"):
        attention.best("gpu")


# -- the simulated operator's contract -------------------------------------------------------------------------------
def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """Attention in float64 on [B, N, S, D]; ``masked`` True = masked out; GQA by repeating key/value heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_npu_fusion_attention_layouts_gqa_and_mask(npu: torch.device) -> None:
    _needs_fused(npu)
    from torchport.testing.npu_fused_ops import npu_fusion_attention

    gen = torch.Generator().manual_seed(0)
    b, n, n_kv, s_q, s_kv, d = 2, 6, 2, 5, 7, 16
    q, k, v = (torch.randn(b, heads, s, d, generator=gen) for heads, s in ((n, s_q), (n_kv, s_kv), (n_kv, s_kv)))
    masked = torch.rand(b, 1, s_q, s_kv, generator=gen) < 0.3
    masked[..., 0] = False  # no row masked everywhere
    expected = _reference(q, k, v, masked, 0.25)
    layouts = {
        "BNSD": lambda t: t,
        "BSND": lambda t: t.transpose(1, 2),
        "BSH": lambda t: t.transpose(1, 2).flatten(2),
        "SBH": lambda t: t.permute(2, 0, 1, 3).flatten(2),
    }
    back = {"BNSD": lambda t: t, "BSND": lambda t: t.transpose(1, 2),
            "BSH": lambda t: t.unflatten(2, (n, d)).transpose(1, 2),
            "SBH": lambda t: t.unflatten(2, (n, d)).permute(1, 2, 0, 3)}
    for layout, to in layouts.items():
        out, softmax_max, softmax_sum, reserved, seed, offset, numels = npu_fusion_attention(
            to(q).to(npu), to(k).to(npu), to(v).to(npu), n, layout, atten_mask=masked.to(npu), scale=0.25)
        assert out.device.type == "npu" and out.dtype == q.dtype
        assert _rel(back[layout](out.cpu()), expected) < 1e-6, layout
        assert softmax_max.shape == softmax_sum.shape == (b, n, s_q, 8) and softmax_max.dtype == torch.float32
        assert reserved.numel() == 0 and (seed, offset, numels) == (0, 0, 0)


def test_npu_fusion_attention_sparse_modes(npu: torch.device) -> None:
    _needs_fused(npu)
    from torchport.testing.npu_fused_ops import npu_fusion_attention

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 5, 16, generator=gen)
    k, v = torch.randn(1, 2, 9, 16, generator=gen), torch.randn(1, 2, 9, 16, generator=gen)
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1).to(npu)
    top_left = torch.triu(torch.ones(5, 9, dtype=torch.bool), 1)
    bottom_right = torch.triu(torch.ones(5, 9, dtype=torch.bool), 9 - 5 + 1)
    args = (q.to(npu), k.to(npu), v.to(npu), 2, "BNSD")
    out2 = npu_fusion_attention(*args, atten_mask=compressed, sparse_mode=2)[0]
    out3 = npu_fusion_attention(*args, atten_mask=compressed, sparse_mode=3)[0]
    assert _rel(out2.cpu(), _reference(q, k, v, top_left, 1.0)) < 1e-6  # scale defaults to 1, not 1/sqrt(D)
    assert _rel(out3.cpu(), _reference(q, k, v, bottom_right, 1.0)) < 1e-6
    with pytest.raises(RuntimeError, match="compressed 2048x2048"):
        npu_fusion_attention(*args, atten_mask=top_left.to(npu), sparse_mode=3)
    with pytest.raises(RuntimeError, match="not simulated"):
        npu_fusion_attention(*args, atten_mask=compressed, sparse_mode=4)
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        npu_fusion_attention(q.repeat(1, 2, 1, 1)[:, :3].to(npu), k.to(npu), v.to(npu), 3, "BNSD")
    with pytest.raises(RuntimeError, match="head_num=4"):
        npu_fusion_attention(*args[:3], 4, "BNSD")
    # no mask: sparse_mode is ignored (full attention)
    none = npu_fusion_attention(*args, sparse_mode=3)[0]
    assert _rel(none.cpu(), _reference(q, k, v, None, 1.0)) < 1e-6


# -- the registered attention function against SDPA --------------------------------------------------------------------
class _Attention(torch.nn.Module):
    """What transformers passes to an attention function: the module (is_causal, num_key_value_groups)."""

    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _padding_mask(batch: int, q_len: int, kv_len: int, pads: list[int], device: torch.device) -> torch.Tensor:
    """transformers' SDPA mask (True = attend) for a causal batch left-padded by ``pads`` tokens per row."""
    from transformers.masking_utils import sdpa_mask

    keep = torch.ones(batch, kv_len, dtype=torch.bool)
    for row, pad in enumerate(pads):
        keep[row, :pad] = False
    mask = sdpa_mask(batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=kv_len - q_len,
                     attention_mask=keep.to(device), device=device, allow_is_causal_skip=False)
    assert mask.dtype == torch.bool and mask.shape == (batch, 1, q_len, kv_len)
    return mask


CASES = {  # name: (batch, heads, kv heads, q_len, kv_len, head dim, left padding per row or None)
    "causal-prefill": (2, 6, 2, 13, 13, 24, None),
    "padded-prefill": (3, 6, 3, 11, 11, 16, [0, 4, 10]),
    "padded-decode": (2, 4, 2, 1, 9, 16, [3, 0]),
    "decode": (2, 4, 1, 1, 17, 32, None),
    "chunk-after-cache": (1, 4, 2, 5, 12, 16, [0]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_attention_matches_sdpa(device: torch.device, case: str, dtype: torch.dtype, fused_calls) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _needs_dtype(device, dtype)
    attention.register()
    forward = transformers.AttentionInterface._global_mapping["npu_fusion_attention"]
    b, n, n_kv, s_q, s_kv, d, pads = CASES[case]
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, heads, s, d, generator=gen).to(dtype)
               for heads, s in ((n, s_q), (n_kv, s_kv), (n_kv, s_kv)))
    grad = torch.randn(b, s_q, n, d, generator=gen).to(dtype)
    module = _Attention(n // n_kv)

    def run(fn, dev):
        inputs = [t.to(dev).detach().requires_grad_() for t in (q, k, v)]
        mask = None if pads is None else _padding_mask(b, s_q, s_kv, pads, dev)
        out, weights = fn(module, *inputs, mask, dropout=0.0, scaling=d ** -0.5)
        assert weights is None and out.shape == (b, s_q, n, d)
        out.backward(grad.to(dev))
        return [out.detach().cpu()] + [t.grad.cpu() for t in inputs]

    # SDPA on the same device is the reference: SDPA's kernels disagree across devices on rows with nothing to
    # attend to (CUDA's bf16 kernels do not give the zeros the CPU gives; seen on an H100, torch 2.11)
    expected = run(sdpa_attention_forward, device)
    got = run(forward, device)
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected):
        assert torch.isfinite(a).all(), name
        assert _rel(a, e) < TOLERANCE[dtype], (name, _rel(a, e))
    assert fused_calls() == (1 if _fused_on(device) else 0)


def test_fused_attention_zeroes_rows_with_nothing_to_attend(npu: torch.device) -> None:
    attention.register()
    forward = transformers.AttentionInterface._global_mapping["npu_fusion_attention"]
    q, k, v = torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    mask = _padding_mask(2, 6, 6, [0, 4], torch.device("cpu"))
    out, _ = forward(_Attention(1), q.to(npu), k.to(npu), v.to(npu), mask.to(npu))
    assert torch.equal(out[1, :4].cpu(), torch.zeros(4, 2, 16))  # the padding rows of the second sequence
    assert out[1, 4:].abs().sum() > 0 and out[0].abs().sum() > 0


def test_fused_attention_float_masks_and_cpu_tensors_take_sdpa(npu: torch.device, fused_calls) -> None:
    attention.register()
    forward = transformers.AttentionInterface._global_mapping["npu_fusion_attention"]
    q, k, v = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    additive = torch.zeros(1, 1, 4, 4)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=additive).transpose(1, 2)
    out, _ = forward(_Attention(1), q.to(npu), k.to(npu), v.to(npu), additive.to(npu))
    assert fused_calls() == 0 and _rel(out.cpu(), expected) < 1e-6
    out, _ = forward(_Attention(1), q, k, v, None)  # a model still on the host
    assert fused_calls() == 0 and out.device.type == "cpu"


def test_fused_attention_falls_back_once_when_the_operator_fails(npu: torch.device, monkeypatch) -> None:
    from torchport.testing import npu_fused_ops

    _needs_fused(npu)

    def broken(*args, **kwargs):
        raise RuntimeError("EZ9999: simulated operator failure")

    attention.register()
    forward = transformers.AttentionInterface._global_mapping["npu_fusion_attention"]
    monkeypatch.setitem(npu_fused_ops.OPS, "npu_fusion_attention", broken)
    monkeypatch.setattr(attention, "_operators", {})
    q = torch.randn(1, 2, 3, 16, dtype=torch.float16)
    with torchport.settings.override(strict=True), pytest.raises(RuntimeError, match="EZ9999"):
        forward(_Attention(1), q.to(npu), q.to(npu), q.to(npu), None)
    monkeypatch.setattr(attention, "_broken", {})
    monkeypatch.setattr(attention, "_warned", set())
    with pytest.warns(RuntimeWarning, match="npu_fusion_attention failed .*EZ9999.*using sdpa"):
        out, _ = forward(_Attention(1), q.to(npu), q.to(npu), q.to(npu), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call neither warns nor tries the operator again
        forward(_Attention(1), q.to(npu), q.to(npu), q.to(npu), None)
    expected = F.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True).transpose(1, 2)
    assert _rel(out.cpu(), expected) < 1e-2


# -- models ------------------------------------------------------------------------------------------------------------
def test_apply_to_a_model_matches_sdpa_forward_backward_and_generate(device: torch.device, fused_calls) -> None:
    reference = _tiny_llama().to(device)
    model = _tiny_llama().to(device)
    chosen = attention.apply(model)
    assert chosen == attention.best(device) == model.config._attn_implementation
    assert model.model.config._attn_implementation == chosen
    ids = torch.tensor([[0, 0, 0, 5, 9, 14, 3], [7, 8, 9, 10, 11, 12, 13]], device=device)  # left padded
    mask = (ids != 0).long()
    outputs = []
    for m in (reference, model):
        out = m(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        outputs.append((out.logits.detach(), [p.grad.detach() for p in m.parameters()]))
    (ref_logits, ref_grads), (logits, grads) = outputs
    keep = mask.bool().cpu()
    assert _rel(logits.cpu()[keep], ref_logits.cpu()[keep]) < 1e-5
    assert max(_rel(g, r) for g, r in zip(grads, ref_grads)) < 1e-4
    with torch.no_grad():
        generated = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                pad_token_id=0) for m in (reference, model)]
    assert torch.equal(generated[0], generated[1])
    if _fused_on(device):
        assert fused_calls() > 0


def test_apply_explicit_and_errors() -> None:
    model = _tiny_llama()
    assert attention.apply(model, "eager") == "eager"
    assert attention.apply(model) == "sdpa"  # the CPU's best
    with pytest.raises(TypeError, match="transformers model"):
        attention.apply(torch.nn.Linear(2, 2))


# -- the hook ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def hook():
    assert attention.hook_installed() is None
    attention._warned.clear()
    yield attention
    attention.remove_hook()
    assert attention.hook_installed() is None


def _flash_missing() -> None:
    from transformers.utils import is_flash_attn_2_available

    if is_flash_attn_2_available():
        pytest.skip("flash-attn is installed here")


def test_hook_turns_a_flash_request_into_the_best_with_one_warning(hook) -> None:
    _flash_missing()
    with pytest.raises(ImportError, match="[Ff]lash"):
        _build(attn_implementation="flash_attention_2")
    hook.install_hook()
    assert hook.hook_installed() == {"default": False, "device": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _build(attn_implementation="flash_attention_2")
        again = _build(attn_implementation="flash_attention_2")
    ours = [w for w in caught if "torchport" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    best = attention.best()  # for torchport.device(): the simulated npu in a pass that tests it, else the cpu
    assert "'flash_attention_2' cannot run here" in str(ours[0].message)
    assert f"using {best!r}, the best available on {torchport.device().type}" in str(ours[0].message)
    assert model.config._attn_implementation == again.config._attn_implementation == best
    model.set_attn_implementation("eager")
    model.set_attn_implementation("flash_attention_2")  # the same check: no error
    assert model.config._attn_implementation == best
    # without a request nothing changes (default=False), and other errors still raise
    assert _build().config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="not supported"):
        _build(attn_implementation="no_such_attention")
    hook.remove_hook()
    with pytest.raises(ImportError):
        model.set_attn_implementation("flash_attention_2")


def test_hook_default_gives_new_models_the_best_for_the_device(hook, npu: torch.device) -> None:
    _flash_missing()
    hook.install_hook(default=True)
    best = "npu_fusion_attention" if _fused_on(npu) else "sdpa"
    with torchport.settings.override(device="npu"):
        model = _build()
        assert model.config._attn_implementation == best
        with pytest.warns(RuntimeWarning, match=f"using '{best}', the best available on npu"):
            flash = _build(attn_implementation="flash_attention_2")
        assert flash.config._attn_implementation == best
        assert _build(attn_implementation="eager").config._attn_implementation == "eager"
    with torchport.settings.override(device="cpu"):
        assert _build().config._attn_implementation == "sdpa"
    # built on the host with npu_fusion_attention, the model runs there through SDPA and on the npu fused
    ids = torch.tensor([[3, 4, 5, 6]])
    reference = _tiny_llama()
    with torch.no_grad():
        assert _rel(model(ids).logits, reference(ids).logits) < 1e-6
        assert _rel(model.to(npu)(ids.to(npu)).logits.cpu(), reference(ids).logits) < 1e-5


def test_fused_attention_takes_sdpa_where_the_operator_refuses(npu: torch.device, fused_calls,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_npu documents npu_fusion_attention for key and value of one shape, head dims up to 768 and up to 256
    query heads: other tensors go to SDPA (one warning each), and the simulated operator refuses them too."""
    from torchport.testing.npu_fused_ops import npu_fusion_attention

    _needs_fused(npu)
    attention.register()
    monkeypatch.setattr(attention, "_warned", set())
    forward = transformers.AttentionInterface._global_mapping["npu_fusion_attention"]
    gen = torch.Generator().manual_seed(3)
    cases = {  # (q heads, kv heads, Dqk, Dv) -> the reason
        (2, 2, 16, 8): "takes key and value of one shape",  # an MLA model's value head
        (257, 1, 8, 8): "and 1 to 256 query heads, not 8 and 257",
        (1, 1, 769, 769): "takes head dims of 1 to 768",
    }
    for (n, n_kv, d, d_v), reason in cases.items():
        q, k = torch.randn(1, n, 3, d, generator=gen), torch.randn(1, n_kv, 3, d, generator=gen)
        v = torch.randn(1, n_kv, 3, d_v, generator=gen)
        with pytest.warns(RuntimeWarning, match=reason):
            out, _ = forward(_Attention(n // n_kv), q.to(npu), k.to(npu), v.to(npu), None, scaling=0.3)
        group = n // n_kv
        expected = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                  is_causal=True, scale=0.3).transpose(1, 2)
        assert _rel(out.cpu(), expected) < 1e-5
    assert fused_calls() == 0
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="must have the same shape"):
        npu_fusion_attention(q.to(npu), k.to(npu), v.to(npu), 2, "BNSD")


def test_fused_attention_is_left_out_of_compiled_graphs(npu: torch.device, fused_calls,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """npu_fusion_attention is documented for eager execution, not graph mode: while a graph is being compiled the
    function takes SDPA."""
    _needs_fused(npu)
    attention.register()
    forward = transformers.AttentionInterface._global_mapping["npu_fusion_attention"]
    q = torch.randn(1, 2, 3, 16).to(npu)
    forward(_Attention(1), q, q, q, None)
    assert fused_calls() == 1
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    forward(_Attention(1), q, q, q, None)
    assert fused_calls() == 1


def test_fused_attention_on_a_chip_without_it_is_sdpa(npu: torch.device, fused_calls) -> None:
    from torchport.testing import is_simulating, simulated_chip

    if not is_simulating():
        pytest.skip("simulates an Ascend910_9392; this NPU is a real one")
    attention.register()
    forward = transformers.AttentionInterface._global_mapping["npu_fusion_attention"]
    q = torch.randn(1, 2, 3, 16)
    with simulated_chip("Ascend910_9392"):  # A3: torch_npu documents the operator for A2 and 950
        assert attention.best(npu) == "sdpa"
        out, _ = forward(_Attention(1), q.to(npu), q.to(npu), q.to(npu), None)
    assert fused_calls() == 0
    expected = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2)
    assert _rel(out.cpu(), expected) < 1e-5
