from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport.kernels import Unsupported, registry
from torchport.kernels.loss_checks import check_targets

from kernel_cases import call, check_close, forced, needs_fused

IGNORE = -100
SHAPES = [(1, 1000), (7, 32003), (33, 1000)]  # vocabularies that are not powers of two, one wider than a chunk
OPTIONS = {"plain": (0.0, 0.0), "smooth+z": (0.1, 1e-3)}


def expected(x: torch.Tensor, t: torch.Tensor, smoothing: float, z: float, reduction: str) -> torch.Tensor:
    """F.cross_entropy in float64, plus z · lse² per non-ignored row; a mean over no rows is 0 (PyTorch: NaN)."""
    valid = t != IGNORE
    rows = F.cross_entropy(x, t, ignore_index=IGNORE, label_smoothing=smoothing, reduction="none")
    rows = rows + torch.where(valid, z * torch.logsumexp(x, -1) ** 2, torch.zeros_like(rows))
    if reduction == "none":
        return rows
    total = rows.sum()
    return total / valid.sum().clamp_min(1) if reduction == "mean" else total


def make(n: int, v: int, ignored: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=gen, dtype=torch.float64) * 2
    t = torch.randint(0, v, (n,), generator=gen)
    if ignored == "some":
        t[::3] = IGNORE
    elif ignored == "all":
        t[:] = IGNORE
    return x, t


def run(impl: str, x: torch.Tensor, t: torch.Tensor, smoothing: float, z: float, reduction: str,
        in_place: bool = False) -> torch.Tensor:
    n_valid = None
    check_targets("test", t, x.shape[-1], IGNORE)
    return call("cross_entropy", impl, x, t, IGNORE, smoothing, reduction, z, in_place, n_valid)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_forward_backward_against_float64(shape, reduction, option, device, dtype, impl):
    smoothing, z = OPTIONS[option]
    x64, t = make(*shape, ignored="some" if shape[0] > 1 else "none")
    x64 = x64.to(dtype).double()  # the reference sees the same rounded logits
    ref_x = x64.clone().requires_grad_()
    ref = expected(ref_x, t, smoothing, z, reduction)
    gen = torch.Generator().manual_seed(1)
    up = torch.randn(ref.shape, generator=gen, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7)
    ref.backward(up)
    x = x64.to(device, dtype).requires_grad_()
    td = t.to(device)
    if impl == "npu" and z:
        n_valid = None
        check_targets("test", td, x.shape[-1], IGNORE)
        with pytest.raises(Unsupported, match="z-loss"):
            registry.implementation("cross_entropy", "npu").fn(x, td, IGNORE, smoothing, reduction, z, False, n_valid)
        return
    loss = run(impl, x, td, smoothing, z, reduction)
    assert loss.dtype == dtype and loss.device == x.device and loss.shape == ref.shape
    loss.backward(up.to(device, dtype))
    check_close("loss", loss, ref, dtype)
    check_close("dlogits", x.grad, ref_x.grad, dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored_give_zero_loss_and_gradient(reduction, device, impl):
    x, t = make(5, 1000, ignored="all")
    x = x.float().to(device).requires_grad_()
    smoothing = 0.0 if impl == "npu" else 0.1  # torch_npu takes no smoothing for logits that require grad
    loss = run(impl, x, t.to(device), smoothing, 0.0, reduction)
    loss.sum().backward()
    assert torch.equal(loss.detach().cpu(), torch.zeros(loss.shape))  # F.cross_entropy's mean would be NaN
    assert torch.equal(x.grad.cpu(), torch.zeros(5, 1000))


def test_upstream_gradient_of_one(device, dtype, impl):
    """``loss.backward()``: the gradient computed in the forward is handed over as it is."""
    x64, t = make(9, 1000, ignored="some")
    x64 = x64.to(dtype).double()
    ref_x = x64.clone().requires_grad_()
    expected(ref_x, t, 0.0, 0.0, "mean").backward()
    x = x64.to(device, dtype).requires_grad_()
    run(impl, x, t.to(device), 0.0, 0.0, "mean").backward()
    check_close("dlogits", x.grad, ref_x.grad, dtype)


def test_logits_kept_unless_in_place(device, impl):
    x64, t = make(6, 1000, ignored="some")
    ref_x = x64.clone().requires_grad_()
    expected(ref_x, t, 0.0, 0.0, "sum").backward()
    x = x64.float().to(device).requires_grad_()
    kept = x.detach().clone()
    run(impl, x, t.to(device), 0.0, 0.0, "sum").backward()
    assert torch.equal(x.detach(), kept)  # the safe default never writes over the logits
    if impl != "triton":
        return
    # in_place: the gradient goes over the logits (a non-leaf here, as an LM head's output would be)
    leaf = x64.float().to(device).requires_grad_()
    logits = leaf * 1.0
    run(impl, logits, t.to(device), 0.0, 0.0, "sum", in_place=True).backward()
    check_close("dlogits", leaf.grad, ref_x.grad, torch.float32)
    check_close("logits hold the gradient", logits.detach(), ref_x.grad, torch.float32)


def test_in_place_over_saved_logits_fails_loudly(device):
    if not _triton_runs(device):
        pytest.skip("needs the Triton implementation")
    x = torch.randn(4, 100, device=device, requires_grad=True)
    logits = torch.tanh(x)  # tanh saves its output for the backward
    loss = run("triton", logits, torch.randint(0, 100, (4,), device=device), 0.0, 0.0, "mean", in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_second_backward_is_refused(device):
    if not _triton_runs(device):
        pytest.skip("needs the Triton implementation")
    x = torch.randn(4, 100, device=device, requires_grad=True)
    loss = run("triton", x, torch.randint(0, 100, (4,), device=device), 0.0, 0.0, "mean")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def _triton_runs(device: torch.device) -> bool:
    import os

    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def test_public_function_three_dims_and_module(device):
    x64, t = make(2 * 5, 1000, ignored="some")
    ref_x = x64.clone().requires_grad_()
    ref = expected(ref_x, t, 0.05, 1e-4, "mean")
    ref.backward()
    x = x64.float().view(2, 5, 1000).to(device).requires_grad_()
    loss = torchport.kernels.cross_entropy(x, t.view(2, 5).to(device), label_smoothing=0.05, z_loss=1e-4)
    loss.backward()
    check_close("loss", loss, ref, torch.float32)
    check_close("dlogits", x.grad.view(10, 1000), ref_x.grad, torch.float32)
    rows = torchport.kernels.CrossEntropyLoss(reduction="none")(x.detach(), t.view(2, 5).to(device))
    assert rows.shape == (2, 5)
    check_close("rows", rows, expected(x64, t, 0.0, 0.0, "none").view(2, 5), torch.float32)


def test_npu_uses_the_fused_operator(npu):
    from torchport.testing import npu_fused_ops

    needs_fused(npu, "npu_cross_entropy_loss")
    x64, t = make(7, 1000, ignored="some")
    before = npu_fused_ops.calls["npu_cross_entropy_loss"]
    loss = torchport.kernels.cross_entropy(x64.float().to(npu), t.to(npu), label_smoothing=0.1)
    assert npu_fused_ops.calls["npu_cross_entropy_loss"] == before + 1
    check_close("loss", loss, expected(x64, t, 0.1, 0.0, "mean"), torch.float32)
    with npu_fused_ops.only(()):
        registry.refresh()
        with forced("auto"):
            loss = torchport.kernels.cross_entropy(x64.float().to(npu), t.to(npu), label_smoothing=0.1)
    registry.refresh()
    check_close("reference", loss, expected(x64, t, 0.1, 0.0, "mean"), torch.float32)


def test_bad_input_is_a_clear_error(device):
    x = torch.randn(4, 10, device=device)
    t = torch.tensor([1, 2, IGNORE, 3], device=device)
    ce = torchport.kernels.cross_entropy
    # called eagerly, a bad target is an error at once on every device (the kernels never see it)
    bad_range = (r"cross_entropy: a target is below 0 or at least the vocabulary size 10, and is not "
                 r"ignore_index=-100; targets must be class indices in \[0, 10\) or ignore_index")
    with pytest.raises(ValueError, match=bad_range):
        ce(x, torch.tensor([1, 10, IGNORE, 3], device=device))
    with pytest.raises(ValueError, match=bad_range):
        ce(x, torch.tensor([1, -1, IGNORE, 3], device=device))
    with pytest.raises(ValueError, match=r"target must have shape \[4\].*got \[5\]"):
        ce(x, torch.zeros(5, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match=r"target must have shape \[2, 3\].*got \[6\]"):
        ce(torch.randn(2, 3, 10, device=device), torch.zeros(6, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="logits has dtype torch.int64; allowed: float32, bfloat16, float16"):
        ce(torch.ones(4, 10, dtype=torch.long, device=device), t)
    with pytest.raises(TypeError, match="target has dtype torch.float32; allowed: integer"):
        ce(x, t.float())
    with pytest.raises(ValueError, match=r"logits must be \[N, V\] or \[B, T, V\]"):
        ce(torch.randn(10, device=device), torch.tensor(1, device=device))
    with pytest.raises(ValueError, match="reduction='avg'; allowed: 'mean', 'sum', 'none'"):
        ce(x, t, reduction="avg")
    with pytest.raises(ValueError, match=r"label_smoothing=1.5 must be in \[0, 1\]"):
        ce(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="z_loss=-1.0 must be >= 0"):
        ce(x, t, z_loss=-1.0)


HOST_BOUND_CASES = {  # rows of 8192 logits, z-loss, in_place, forced, checked -> which path runs
    "16 rows, checked": (16, 0.0, False, False, True, "torch"),
    "17 rows": (17, 0.0, False, False, True, "triton"),
    "z-loss": (2, 1e-4, False, False, True, "triton"),
    "in place": (2, 0.0, True, False, True, "triton"),
    "forced": (2, 0.0, False, True, True, "triton"),
    "unchecked (a compiled graph's call)": (2, 0.0, False, False, False, "triton"),
}


@pytest.mark.parametrize("case", list(HOST_BOUND_CASES))
def test_host_bound_checked_calls_take_torchs_operators(monkeypatch, case):
    """On an accelerator in auto mode, a call of at most 2^17 logits whose targets the eager check has just read
    goes to F.cross_entropy (two C++ autograd nodes); z-loss, in_place, a forced implementation and unchecked
    targets (which F.cross_entropy would meet with a device-side assert) stay on the Triton kernel."""
    pytest.importorskip("triton")
    from torchport.kernels.triton import cross_entropy as kernel
    from torchport.kernels.triton import loss_reduce

    rows, z, in_place, forced_triton, check, path = HOST_BOUND_CASES[case]
    module = importlib.import_module("torchport.kernels.cross_entropy")  # the package's name is the function
    ran = []
    monkeypatch.setattr(loss_reduce, "target_counts", lambda t, ignore, vocab: ran.append(("check",)) or (0, rows))
    monkeypatch.setattr(module.F, "cross_entropy",
                        lambda x, t, **kw: ran.append(("torch", x.dtype, kw["reduction"])) or x.sum())
    monkeypatch.setattr(kernel, "cross_entropy", lambda x, *rest: ran.append(("triton",)) or x.sum())
    x = torch.empty(rows, 8192, device="meta", dtype=torch.bfloat16)  # an accelerator's tensor, never computed
    t = torch.empty(rows, device="meta", dtype=torch.long)
    if forced_triton:
        monkeypatch.setenv("TORCHPORT_KERNELS", "cross_entropy=triton")
    fn = registry.implementation("cross_entropy", "triton").fn
    fn(x, t, IGNORE, 0.1, "mean", z, in_place, None, None, check)
    # 16-bit logits are taken in float32 (one rounding of the loss and the gradient, as the kernel's)
    want = [("torch", torch.float32, "mean")] if path == "torch" else [("triton",)]
    assert ran == ([("check",)] if check else []) + want
    if path != "torch":
        return
    # a float64 loss dtype computes in float64; a mean over no class target is a sum (0, gradients 0), not NaN
    ran.clear()
    fn(x, t, IGNORE, 0.0, "mean", 0.0, False, None, torch.float64, True)
    assert ran == [("check",), ("torch", torch.float64, "mean")]
    ran.clear()
    monkeypatch.setattr(loss_reduce, "target_counts", lambda t, ignore, vocab: (0, 0))
    fn(x, t, IGNORE, 0.0, "mean", 0.0, False, None, None, True)
    assert ran == [("torch", torch.float32, "sum")]


def _checked(impl: str, x: torch.Tensor, t: torch.Tensor, smoothing: float, reduction: str) -> torch.Tensor:
    """An eager, checked call of ``impl``: directly with check=True where the implementation checks itself (and the
    reference, the fallback of those), else through the public function with ``impl`` forced."""
    module = importlib.import_module("torchport.kernels.cross_entropy")
    if impl in module._CHECKS_ITSELF or impl == "reference":
        return call("cross_entropy", impl, x, t, IGNORE, smoothing, reduction, 0.0, False, None, None, True)
    reason = registry.implementation("cross_entropy", impl).unavailable_reason(x.device)
    if reason is not None:  # a chip without the vendor's operator
        pytest.skip(f"cross_entropy: {impl} cannot run on {x.device} ({reason})")
    with forced(impl):
        return torchport.kernels.cross_entropy(x, t, IGNORE, smoothing, reduction)


def test_each_implementation_checks_the_targets_when_asked(device, impl):
    """An eager call: the targets are read first (by the implementation itself, or before it) and a bad one is the
    clear error, which the registry passes on as it is (no fallback, no warning); good targets give the loss."""
    x64, t = make(6, 300, ignored="some")
    x = x64.float().to(device)
    bad = t.clone()
    bad[1] = 300
    with pytest.raises(ValueError, match=r"vocabulary size 300, and is not ignore_index=-100; targets must be class "
                                         r"indices in \[0, 300\) or ignore_index"):
        _checked(impl, x, bad.to(device), 0.0, "mean")
    smoothing = 0.0 if impl == "npu" else 0.1
    out = _checked(impl, x, t.to(device), smoothing, "mean")
    check_close("loss", out, expected(x64.float().double(), t, smoothing, 0.0, "mean"), torch.float32)


def test_an_implementation_that_does_not_check_gets_checked_targets(monkeypatch):
    """An implementation outside _CHECKS_ITSELF (another package's, say) never sees a bad target, and is called with
    check=False: the targets were read before it."""
    from torchport.kernels.cross_entropy import cross_entropy_reference

    seen = []

    def other(*args):
        seen.append(args[-1])
        return cross_entropy_reference(*args[:-1])

    impls = registry._implementations("cross_entropy")
    monkeypatch.setitem(impls, "other", dataclasses.replace(impls["reference"], name="other", fn=other,
                                                            devices=frozenset({"cpu"}), priority=99))
    registry.refresh()
    try:
        x = torch.randn(3, 10)
        with pytest.raises(ValueError, match="vocabulary size 10"):
            torchport.kernels.cross_entropy(x, torch.tensor([1, 10, 2]))
        assert seen == []
        loss = torchport.kernels.cross_entropy(x, torch.tensor([1, IGNORE, 2]))
        assert seen == [False]
        torch.testing.assert_close(loss, F.cross_entropy(x, torch.tensor([1, IGNORE, 2]), ignore_index=IGNORE))
    finally:
        registry.refresh()


def test_strided_targets_are_checked_where_they_are(device, impl):
    """Targets that are every other element of a tensor: the check reads those, not the elements between them."""
    x64, _ = make(3, 10, ignored="none")
    x = x64.float().to(device)
    good = torch.tensor([1, 50, 2, IGNORE, 3, 60], device=device)[::2]  # [1, 2, 3]; 50 and 60 lie between
    bad = torch.tensor([1, 0, 2, 0, 50, 0], device=device)[::2]  # [1, 2, 50]
    out = _checked(impl, x, good, 0.0, "none")
    check_close("rows", out, expected(x64.float().double(), good.cpu(), 0.0, 0.0, "none"), torch.float32)
    with pytest.raises(ValueError, match="vocabulary size 10"):
        _checked(impl, x, bad, 0.0, "mean")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host-bound route runs on an accelerator")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_host_bound_call_on_cuda_against_float64(reduction):
    device = torch.device("cuda")
    x64, t = make(5, 1003, ignored="some")
    x64 = x64.bfloat16().double()
    ref_x = x64.clone().requires_grad_()
    ref = expected(ref_x, t, 0.1, 0.0, reduction)
    up = torch.linspace(0.5, 1.5, 5, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7)
    ref.backward(up)
    x = x64.to(device, torch.bfloat16).requires_grad_()
    loss = torchport.kernels.cross_entropy(x, t.to(device), label_smoothing=0.1, reduction=reduction)
    # torch's C++ nodes (NllLoss, and Add with smoothing), not the Triton path's Python Function
    assert not isinstance(loss.grad_fn, torch.autograd.function.BackwardCFunction), type(loss.grad_fn).__name__
    loss.backward(up.to(device, loss.dtype))
    check_close("loss", loss, ref.detach(), torch.bfloat16)
    check_close("dlogits", x.grad, ref_x.grad, torch.bfloat16)
    wide = torchport.kernels.cross_entropy(x, t.to(device), label_smoothing=0.1, reduction=reduction,
                                           loss_dtype=torch.float32)
    assert wide.dtype == torch.float32
    torch.testing.assert_close(wide.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    ignored = torch.full_like(t, IGNORE).to(device)
    zero = torchport.kernels.cross_entropy(x, ignored, reduction=reduction)
    assert torch.equal(zero.detach().float().cpu(), torch.zeros(zero.shape))  # F.cross_entropy's mean: NaN
    with pytest.raises(ValueError, match="vocabulary size 1003"):
        torchport.kernels.cross_entropy(x, torch.full_like(t, 1003).to(device), reduction=reduction)


def test_bad_targets_in_a_compiled_graph_make_the_loss_nan():
    # no host read is possible while dynamo traces: the bad row is ignored by the kernel and its loss is NaN
    x = torch.randn(4, 10, requires_grad=True)
    bad = torch.tensor([1, 10, IGNORE, 3])
    good = torch.tensor([1, 2, IGNORE, 3])
    ce = torch.compile(torchport.kernels.cross_entropy, backend="aot_eager", fullgraph=True)
    assert torch.isnan(ce(x, bad))
    rows = ce(x, bad, reduction="none")
    assert torch.isnan(rows[1]) and torch.isfinite(rows[[0, 2, 3]]).all()
    loss = ce(x, good)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(x, good, ignore_index=IGNORE))
    loss.backward()
    assert torch.isfinite(x.grad).all()


def test_tensors_on_different_devices(npu):
    with pytest.raises(ValueError, match=r"one device, got logits on npu:0, target on cpu"):
        torchport.kernels.cross_entropy(torch.randn(2, 8, device=npu), torch.tensor([1, 2]))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_dtype_float32_for_16_bit_logits(reduction, device, impl):
    """loss_dtype=float32 (what Hugging Face's causal-LM loss returns): the float32 result, not rounded to bf16 on
    the way (which is off by up to 2^-9 = 2e-3); the gradient stays in the logits' dtype. torch_npu's operator
    returns its per-row losses in the logits' dtype: on the npu implementation loss_dtype widens those."""
    if not torchport.backends.get_backend(device.type).dtype_works(torch.bfloat16, device.index or 0):
        pytest.skip(f"bfloat16 does not work on {device}")
    x64, t = make(33, 1000, ignored="some")
    x = x64.to(device, torch.bfloat16).requires_grad_()
    n_valid = None
    check_targets("test", t, 1000, IGNORE)
    loss = call("cross_entropy", impl, x, t.to(device), IGNORE, 0.0, reduction, 0.0, False, n_valid, torch.float32)
    assert loss.dtype == torch.float32
    ref = expected(x64.bfloat16().double(), t, 0.0, 0.0, reduction)
    tolerance = 4e-3 if impl == "npu" else 1e-5
    torch.testing.assert_close(loss.double().cpu(), ref, rtol=tolerance, atol=tolerance)
    loss.backward(torch.ones_like(loss))
    assert x.grad.dtype == torch.bfloat16
    public = torchport.kernels.cross_entropy(x.detach(), t.to(device), reduction=reduction, loss_dtype=torch.float32)
    tolerance = 4e-3 if registry.select("cross_entropy", device).name == "npu" else 1e-5  # auto mode's choice
    torch.testing.assert_close(public.double().cpu(), ref, rtol=tolerance, atol=tolerance)
    with pytest.raises(TypeError, match="loss_dtype=torch.int32 must be a floating dtype"):
        torchport.kernels.cross_entropy(x, t.to(device), loss_dtype=torch.int32)


def test_npu_label_smoothing_in_training_takes_the_reference(npu):
    """torch_npu.npu_cross_entropy_loss takes no label_smoothing for logits that require grad (with the "none"
    reduction torchport uses; "mean" allows no option at all): the reference computes those, the operator the rest."""
    from torchport.testing import npu_fused_ops

    needs_fused(npu, "npu_cross_entropy_loss")
    registry.refresh()  # each reason is warned once per process
    x64, t = make(7, 1000, ignored="some")
    ref_x = x64.clone().requires_grad_()
    expected(ref_x, t, 0.1, 0.0, "mean").backward()
    calls = npu_fused_ops.calls["npu_cross_entropy_loss"]
    x = x64.float().to(npu).requires_grad_()
    with pytest.warns(RuntimeWarning, match="takes no label_smoothing when the logits require grad"):
        loss = torchport.kernels.cross_entropy(x, t.to(npu), label_smoothing=0.1)
    loss.backward()
    assert npu_fused_ops.calls["npu_cross_entropy_loss"] == calls
    check_close("dlogits", x.grad, ref_x.grad, torch.float32)
    with torch.no_grad():  # evaluation: the operator takes the smoothing
        torchport.kernels.cross_entropy(x, t.to(npu), label_smoothing=0.1)
    assert npu_fused_ops.calls["npu_cross_entropy_loss"] == calls + 1
    safe = torch.where(t == IGNORE, 0, t).to(npu)
    for reduction, options in (("sum", {"label_smoothing": 0.1}), ("none", {"label_smoothing": 0.1}),
                               ("mean", {"ignore_index": 3})):
        with pytest.raises(RuntimeError, match=f"reduction='{reduction}' takes only the default"):
            npu_fused_ops.npu_cross_entropy_loss(x, safe, reduction=reduction, **options)


def _launches() -> dict[str, object]:
    """Every launch kind of the Triton kernel at 5000 columns: several chunks per row, the last one partial."""
    from torchport.kernels.triton import cross_entropy as kernel

    return {"rows": kernel.Launch("rows", 1, 4), "chunked": kernel.Launch("chunked", 2048, 4, 0),
            "chunked forward, no hints": kernel.Launch("chunked", 2048, 4, 0, reverse=False, evict=False),
            "persistent": kernel.Launch("chunked", 1024, 4, 1),
            "prefetch": kernel.Launch("chunked", 2048, 4, 0, prefetch=True),
            "persistent, prefetch, forward": kernel.Launch("chunked", 1024, 4, 1, reverse=False, prefetch=True)}


@pytest.mark.parametrize("in_place", [False, True], ids=["new buffer", "in place"])
def test_every_launch_against_float64(device, in_place):
    """Each launch kind on rows with ignored targets, label smoothing and z-loss, and on rows whose first 2100 logits
    are -inf (a masked vocabulary: a chunk or part of -inf logits must not make the statistics NaN)."""
    if not _triton_runs(device):
        pytest.skip(f"the Triton kernel runs on cuda, or on cpu under TRITON_INTERPRET=1; not on {device.type}")
    from torchport.kernels.triton import cross_entropy as kernel

    x64, t = make(6, 5000, ignored="some")
    masked = x64.clone()
    masked[:, :2100] = float("-inf")
    masked_t = torch.where(t < 2100, t + 2100, t)
    masked_t[4] = IGNORE
    # label smoothing averages every logit, -inf ones included: smoothing only where the logits are finite
    cases = {"smoothing": (x64, t, 0.1), "masked": (masked, masked_t, 0.0)}
    scale = torch.full((1,), 0.5, device=device)
    for case, (logits64, target, smoothing) in cases.items():
        ref_x = logits64.clone().requires_grad_()
        ref = expected(ref_x, target, smoothing, 1e-3, "none")
        ref.sum().backward()
        for name, launch in _launches().items():
            logits = logits64.float().to(device)
            grad = logits if in_place else torch.empty_like(logits)
            out = kernel.loss_and_grad(logits, target.to(device), IGNORE, smoothing, 1e-3, scale, grad, launch)
            torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{case}, {name}: loss: {m}")
            torch.testing.assert_close(grad.double().cpu(), 0.5 * ref_x.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case}, {name}: gradient: {m}")


@pytest.mark.parametrize("in_place", [False, True], ids=["new buffer", "in place"])
def test_whole_row_kernel_on_strided_rows(device, in_place):
    """The whole-row kernel on rows that are views into wider buffers (the logits and, apart, the gradient): the
    loss, with the target's logit read at its row's stride, and the gradient match float64, and the buffers'
    other columns stay as they were."""
    if not _triton_runs(device):
        pytest.skip(f"the Triton kernel runs on cuda, or on cpu under TRITON_INTERPRET=1; not on {device.type}")
    from torchport.kernels.triton import cross_entropy as kernel

    x64, t = make(6, 300, ignored="some")
    ref_x = x64.clone().requires_grad_()
    ref = expected(ref_x, t, 0.1, 1e-3, "none")
    ref.sum().backward()
    for launch in (kernel.Launch("rows", 2, 4), kernel.Launch("rows", 1, 1)):
        wide = torch.full((6, 320), 7.0, device=device)
        logits = wide[:, :300]
        logits.copy_(x64)
        wide_grad = torch.full((6, 310), 9.0, device=device)
        grad = logits if in_place else wide_grad[:, 5:305]
        out = kernel.loss_and_grad(logits, t.to(device), IGNORE, 0.1, 1e-3, 1.0, grad, launch)
        torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{launch}: loss: {m}")
        torch.testing.assert_close(grad.double().cpu(), ref_x.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{launch}: gradient: {m}")
        assert bool((wide[:, 300:] == 7.0).all()), "columns past the logits were written"
        if not in_place:
            assert bool((wide_grad[:, :5] == 9.0).all() and (wide_grad[:, 305:] == 9.0).all())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's -inf - -inf
def test_every_launch_gives_ignored_rows_zeros_whatever_their_logits(device):
    """An ignored row's gradient is zero even where its logits would make the softmax NaN (a NaN logit, or a row all
    -inf: padding positions of a masked vocabulary), in every launch kind, and the other rows are untouched."""
    if not _triton_runs(device):
        pytest.skip(f"the Triton kernel runs on cuda, or on cpu under TRITON_INTERPRET=1; not on {device.type}")
    from torchport.kernels.triton import cross_entropy as kernel

    for v, launches in ((5000, _launches()), (300, {"rows, whole": kernel.Launch("rows", 2, 4)})):
        x64, t = make(6, v, ignored="some")
        t[[1, 4]] = IGNORE
        x64[1, 7] = float("nan")
        x64[4] = float("-inf")
        ref_x = x64.clone()
        ref_x[[1, 4]] = 0.0  # what an ignored row holds does not matter to the others
        ref_x.requires_grad_()
        ref = expected(ref_x, t, 0.0, 0.0, "none")
        ref.sum().backward()
        for name, launch in launches.items():
            logits = x64.float().to(device)
            grad = torch.full_like(logits, 5.0)
            out = kernel.loss_and_grad(logits, t.to(device), IGNORE, 0.0, 0.0, 1.0, grad, launch)
            torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{v} columns, {name}: loss: {m}")
            torch.testing.assert_close(grad.double().cpu(), ref_x.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{v} columns, {name}: gradient: {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_each_implementation_makes_a_bad_target_nan_without_reading_past_the_row(reduction, device, impl):
    """Where no host read checks the targets (a compiled or captured graph), each implementation checks them itself:
    a target below 0 or at least V (and not ignore_index) gives its row a NaN loss and no gradient; the other rows
    keep the loss and gradient they have when the bad rows are ignored. Widths on both sides of the Triton kernel's
    whole-row limit (4096 columns) and every launch kind of its chunked kernel."""
    for v in (300, 5000):
        x64, t = make(6, v, ignored="some")
        bad = t.clone()
        bad[1], bad[2], bad[4] = -1, v, v + 10**6  # rows 0 and 3 are ignored (make: every third)
        ignored = t.clone()
        ignored[[1, 2, 4]] = IGNORE
        ref_x = x64.clone().requires_grad_()
        ref = expected(ref_x, ignored, 0.0, 0.0, reduction)
        ref.sum().backward()
        x = x64.float().to(device).requires_grad_()
        out = call("cross_entropy", impl, x, bad.to(device), IGNORE, 0.0, reduction, 0.0, False, None)
        if reduction == "none":
            assert torch.isnan(out[[1, 2, 4]]).all() and torch.isfinite(out[[0, 3, 5]]).all()
            check_close("good rows", out[[0, 3, 5]], ref[[0, 3, 5]].detach(), torch.float32)
            out.nan_to_num(0.0).sum().backward()
        else:
            assert torch.isnan(out), f"{impl}, {reduction}: a bad target left the loss finite: {out}"
            torch.autograd.backward(out, torch.ones_like(out))
        assert (x.grad[[1, 2, 4]] == 0).all(), f"{impl}: a row with a bad target got a gradient"
        check_close("dlogits", x.grad, ref_x.grad, torch.float32)


def test_triton_launches_make_a_bad_target_nan(device):
    if not _triton_runs(device):
        pytest.skip(f"the Triton kernel runs on cuda, or on cpu under TRITON_INTERPRET=1; not on {device.type}")
    from torchport.kernels.triton import cross_entropy as kernel

    x64, t = make(6, 5000, ignored="some")
    t[1], t[2] = -7, 5000
    t[5] = 2**32 + 3  # column 3 once narrowed to 32 bits: the kernels compare the target column in int32
    scale = torch.full((1,), 0.5, device=device)
    for name, launch in _launches().items():
        logits = x64.float().to(device)
        grad = torch.full_like(logits, 3.0)
        out = kernel.loss_and_grad(logits, t.to(device), IGNORE, 0.0, 0.0, scale, grad, launch).cpu()
        assert torch.isnan(out[[1, 2, 5]]).all() and (out[[0, 3]] == 0).all() and torch.isfinite(out).sum() == 3, name
        assert (grad[[0, 1, 2, 3, 5]] == 0).all() and (grad[4] != 0).any(), name


def test_the_triton_counts_and_sum_match_torch(device):
    if not _triton_runs(device):
        pytest.skip(f"the Triton kernel runs on cuda, or on cpu under TRITON_INTERPRET=1; not on {device.type}")
    from torchport.kernels.triton import loss_reduce as kernel

    gen = torch.Generator().manual_seed(3)
    for n in (1, 1023, 2500, 9000):  # one step for the first three; two steps of 8192 for the last
        t = torch.randint(-3, 60, (n,), generator=gen)
        t[::7] = IGNORE
        classes = ((t >= 0) & (t < 50)).sum().clamp_min(1)
        scale = kernel.mean_scale(t.to(device), IGNORE, 50)
        assert scale.shape == (1,) and scale.dtype == torch.float32
        torch.testing.assert_close(scale.cpu(), (1.0 / classes.float()).reshape(1))
        rows = torch.randn(n, generator=gen).to(device)
        for factor, dtype in ((scale, torch.bfloat16), (0.25, torch.float32), (1.0, torch.float16)):
            got = kernel.reduce_rows(rows, factor, dtype)
            want = rows.double().sum() * (factor.double() if isinstance(factor, torch.Tensor) else factor)
            assert got.shape == () and got.dtype == dtype
            tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]  # one rounding to dtype
            torch.testing.assert_close(got.double().cpu(), want.reshape(()).cpu(), rtol=tol, atol=1e-5)
        bad = ((t != IGNORE) & ~((t >= 0) & (t < 50))).sum()
        assert kernel.target_counts(t.to(device), IGNORE, 50) == (int(bad), int(((t >= 0) & (t < 50)).sum()))
    assert kernel.mean_scale(torch.full((5,), IGNORE, device=device), IGNORE, 50).item() == 1.0  # no class: 1/1
    assert kernel.target_counts(torch.full((5,), IGNORE, device=device), IGNORE, 50) == (0, 0)
    assert kernel.target_counts(torch.tensor([3, 49, 50, -1], device=device), 3, 50) == (2, 1)  # ignore_index a class
    with_nan = torch.tensor([1.0, float("nan"), 2.0], device=device)
    assert torch.isnan(kernel.reduce_rows(with_nan, 1.0, torch.float32))


def test_the_compiled_graphs_op_reads_no_target_on_the_host(monkeypatch):
    """The graph torch.compile makes of cross_entropy calls torch.ops.torchport.cross_entropy with check=False: no
    target is read on the host (no synchronisation per step); a bad target's row is NaN and the mean counts only the
    rows with a class. Called eagerly with the default check=True, the op gives the clear error (test_kernel_library).
    """
    module = importlib.import_module("torchport.kernels.cross_entropy")  # the package exports a function of that name

    def no_host_check(*args, **kwargs):
        raise AssertionError("the custom op checked the targets on the host")

    monkeypatch.setattr(module, "check_targets", no_host_check)
    op = registry.custom_op("cross_entropy")
    x64, t = make(5, 40, ignored="none")
    t[2] = 40
    x = x64.float().requires_grad_()
    rows = op(x, t, IGNORE, 0.0, "none", 0.0, False)
    assert torch.isnan(rows[2]) and torch.isfinite(rows[[0, 1, 3, 4]]).all()
    good = torch.tensor([0, 1, 3, 4])
    loss = op(x, t, IGNORE, 0.0, "mean", 0.0, False)
    assert torch.isnan(loss)
    loss.backward()
    ref_x = x64.clone().requires_grad_()
    F.cross_entropy(ref_x[good], t[good]).backward()
    assert (x.grad[2] == 0).all()
    torch.testing.assert_close(x.grad[good].double(), ref_x.grad[good], rtol=1e-4, atol=1e-6)
    with pytest.raises(AssertionError, match="checked the targets on the host"):
        op(x, t, IGNORE, 0.0, "mean")  # the default: checked (the monkeypatched check raises)
