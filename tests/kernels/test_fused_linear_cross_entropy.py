from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport.kernels import KernelError, registry
from torchport.kernels.cross_entropy import check_targets

from kernel_cases import call, check_close, forced

# the module (the package attribute of the same name is the function)
flce_module = importlib.import_module("torchport.kernels.fused_linear_cross_entropy")
IGNORE = -100
OP = "fused_linear_cross_entropy"
SHAPES = [(1, 16, 1000), (7, 32, 1003), (33, 24, 1000)]  # tokens, hidden, vocab


@pytest.fixture(params=["reference", "chunked", "triton", "npu"])
def flce_impl(request: pytest.FixtureRequest, device: torch.device) -> str:
    name = request.param
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if name == "triton" and not (device.type == "cuda" or (device.type == "cpu" and interpreted)):
        pytest.skip(f"triton runs on cuda, or on cpu under TRITON_INTERPRET=1; not on {device.type} here")
    if name == "npu" and device.type != "npu":
        pytest.skip("the npu implementation runs on npu tensors only")
    return name


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few tokens, so that several chunks (and a ragged last one) are exercised."""
    monkeypatch.setattr(flce_module, "CHUNK_BYTES", 4 * 1003 * 5)


def make(n, h, v, ignored="some", bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5 * 2
    b = torch.randn(v, generator=gen, dtype=torch.float64) * 0.1 if bias else None
    t = torch.randint(0, v, (n,), generator=gen)
    if ignored == "some":
        t[1::3] = IGNORE
    elif ignored == "all":
        t[:] = IGNORE
    return hidden, weight, b, t


def expected(hidden, weight, bias, t, smoothing, reduction, divisor=None):
    logits = F.linear(hidden, weight, bias)
    if reduction == "none":
        return F.cross_entropy(logits, t, ignore_index=IGNORE, label_smoothing=smoothing, reduction="none")
    total = F.cross_entropy(logits, t, ignore_index=IGNORE, label_smoothing=smoothing, reduction="sum")
    if divisor is not None:
        return total / divisor
    return total / (t != IGNORE).sum().clamp_min(1) if reduction == "mean" else total


def run(impl, hidden, weight, t, bias, smoothing, reduction, divisor=None):
    n_valid = check_targets("test", t, weight.shape[0], IGNORE)
    args = (hidden, weight, t, bias, IGNORE, smoothing, reduction, divisor, n_valid)
    if impl == "chunked":  # chosen by auto mode only (TORCHPORT_KERNELS names reference, triton, npu)
        with forced("auto"):
            return registry.implementation(OP, impl).fn(*args)
    return call(OP, impl, *args)


def leaves(tensors, device, dtype):
    return [None if t is None else t.to(device, dtype).requires_grad_() for t in tensors]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["plain", "smooth"])
def test_forward_backward_against_float64(shape, reduction, smoothing, device, dtype, flce_impl, small_chunks):
    hidden, weight, bias, t = make(*shape, bias=shape[0] != 7)
    hidden, weight = hidden.to(dtype).double(), weight.to(dtype).double()  # the reference sees rounded inputs
    bias = None if bias is None else bias.to(dtype).double()
    ref_in = [None if x is None else x.clone().requires_grad_() for x in (hidden, weight, bias)]
    ref = expected(*ref_in, t, smoothing, reduction)
    up = torch.randn(ref.shape, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7)
    ref.backward(up)
    h, w, b = leaves((hidden, weight, bias), device, dtype)
    loss = run(flce_impl, h, w, t.to(device), b, smoothing, reduction)
    assert loss.dtype == dtype and loss.shape == ref.shape
    loss.backward(up.to(device, dtype))
    check_close("loss", loss, ref, dtype)
    for name, got, want in zip(("dhidden", "dweight", "dbias"), (h, w, b), ref_in):
        if want is not None:
            check_close(name, got.grad, want.grad, dtype)


def test_all_tokens_ignored(device, flce_impl):
    hidden, weight, bias, t = make(5, 16, 1000, ignored="all")
    h, w, b = leaves((hidden, weight, bias), device, torch.float32)
    loss = run(flce_impl, h, w, t.to(device), b, 0.0, "mean")
    loss.backward()
    assert loss.item() == 0.0
    for x in (h, w, b):
        assert torch.equal(x.grad.cpu(), torch.zeros(x.shape))


def test_gradient_accumulation_with_num_items_in_batch(device, flce_impl, small_chunks):
    """Two micro-batches, each divided by the valid tokens of both: losses and accumulated gradients equal one
    mean over the whole batch (Hugging Face Trainer's convention)."""
    hidden, weight, bias, t = make(14, 16, 1003)
    t[8] = IGNORE  # micro-batches with different valid counts
    total_items = int((t != IGNORE).sum())
    ref_in = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    ref = expected(*ref_in, t, 0.0, "mean")
    ref.backward()
    h_full, w, b = leaves((hidden, weight, bias), device, torch.float32)
    losses = []
    for part in (slice(0, 7), slice(7, 14)):
        h = h_full.detach()[part].clone().requires_grad_()
        loss = run(flce_impl, h, w, t[part].to(device), b, 0.0, "sum", float(total_items))
        check_close("micro-batch loss", loss, expected(hidden[part], weight, bias, t[part], 0.0, "sum", total_items),
                    torch.float32)
        loss.backward()
        losses.append(loss.detach())
    check_close("accumulated loss", sum(losses), ref, torch.float32)
    check_close("dweight", w.grad, ref_in[1].grad, torch.float32)
    check_close("dbias", b.grad, ref_in[2].grad, torch.float32)


def test_public_function_three_dims_module_and_frozen_head(device):
    hidden, weight, bias, t = make(2 * 6, 16, 1000)
    ref_h = hidden.clone().requires_grad_()
    expected(ref_h, weight, None, t, 0.0, "mean", divisor=5).backward()
    h = hidden.float().view(2, 6, 16).to(device).requires_grad_()
    w = weight.float().to(device)  # frozen: no weight gradient wanted
    loss = torchport.kernels.fused_linear_cross_entropy(h, w, t.view(2, 6).to(device), num_items_in_batch=5)
    loss.backward()
    check_close("dhidden", h.grad.view(12, 16), ref_h.grad, torch.float32)
    rows = torchport.kernels.FusedLinearCrossEntropyLoss(reduction="none")(h.detach(), w, t.view(2, 6).to(device))
    assert rows.shape == (2, 6)
    check_close("rows", rows.view(-1), expected(hidden, weight, None, t, 0.0, "none"), torch.float32)


def test_auto_and_forced_selection(device):
    hidden, weight, bias, t = make(4, 8, 100)
    args = [x.float().to(device) for x in (hidden, weight)] + [t.to(device)]
    auto = registry.select(OP, device).name
    assert auto == {"cpu": "chunked", "npu": "npu", "cuda": "triton"}.get(device.type, "chunked")
    want = expected(hidden, weight, None, t, 0.0, "mean")
    for mode in ("auto", "reference", f"{OP}=reference", f"rms_norm=reference,{OP}=auto"):
        with forced(mode):
            check_close(mode, torchport.kernels.fused_linear_cross_entropy(*args), want, torch.float32)
    if device.type != "cuda":
        with forced("triton"), pytest.raises(KernelError, match="does not run on"):
            torchport.kernels.fused_linear_cross_entropy(*args)


def test_chunk_size_bounds_memory():
    assert flce_module.chunk_tokens(8192, 128256) == 512  # 512 x 128256 bf16 logits: 125 MiB
    assert flce_module.chunk_tokens(10, 128256) == 10
    assert flce_module.chunk_tokens(100, 2**40) == 1


def test_bad_input_is_a_clear_error(device):
    h = torch.randn(4, 8, device=device)
    w = torch.randn(10, 8, device=device)
    t = torch.tensor([1, 2, IGNORE, 3], device=device)
    fl = torchport.kernels.fused_linear_cross_entropy
    with pytest.raises(ValueError, match=r"weight must have shape \[vocab, hidden\] = \[V, 8\].*got weight of shape \[10, 7\]"):
        fl(h, torch.randn(10, 7, device=device), t)
    with pytest.raises(ValueError, match=r"bias must have shape \[vocab\] = \[10\], got \[9\]"):
        fl(h, w, t, torch.zeros(9, device=device))
    with pytest.raises(ValueError, match=r"1 target\(s\) outside \[0, 10\).*e.g. 12"):
        fl(h, w, torch.tensor([1, 12, IGNORE, 3], device=device))
    with pytest.raises(ValueError, match=r"target must have shape \[4\]"):
        fl(h, w, t[:3])
    with pytest.raises(TypeError, match="hidden has dtype torch.int64"):
        fl(h.long(), w, t)
    with pytest.raises(TypeError, match="one dtype, got hidden torch.float32, weight torch.float16"):
        fl(h, w.half(), t)
    with pytest.raises(ValueError, match="cannot be used with reduction='none'"):
        fl(h, w, t, reduction="none", num_items_in_batch=3)
    with pytest.raises(ValueError, match="num_items_in_batch must be > 0"):
        fl(h, w, t, num_items_in_batch=0)


def test_tensors_on_different_devices(npu):
    with pytest.raises(ValueError, match=r"one device, got hidden on npu:0, weight on cpu"):
        torchport.kernels.fused_linear_cross_entropy(torch.randn(2, 8, device=npu), torch.randn(10, 8),
                                                     torch.tensor([1, 2], device=npu))
