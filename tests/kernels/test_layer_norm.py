from __future__ import annotations

import pytest
import torch

import torchport
from torchport.kernels.layer_norm import layer_norm_reference

from kernel_cases import call, call_backward, check_close, gradients, leaf, relative_error

SHAPES = [(1, 1), (3, 5, 123), (2, 7, 4097), (3, 9001), (2, 65537)]  # 9001: the fused forward, the wide backward


def _case(shape, device, dtype, affine=True):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 3  # a large mean: tests the centring
    w = torch.randn(shape[-1], generator=gen, dtype=torch.float64) if affine else None
    b = torch.randn(shape[-1], generator=gen, dtype=torch.float64) if affine else None
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    params = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    ref, ref_grads = gradients(lambda *t: layer_norm_reference(t[0], *(t[1:] or (None, None)), 1e-5), params, [dy])
    inputs = [leaf(t, device, dtype) for t in (x, w, b) if t is not None]
    return inputs, dy.to(device, dtype), ref, ref_grads


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("needs", [(True, True, True), (True, False, True), (True, True, False)],
                         ids=["all", "no_dw", "no_db"])
def test_compiled_graph_backward_from_inputs(shape, needs, device, dtype, impl):
    """The implementation's backward for ``torch.ops.torchport.layer_norm`` (no statistics saved by the forward)."""
    inputs, dy, _, ref_grads = _case(shape, device, dtype)
    grads = call_backward("layer_norm", impl, (dy,), needs, *(t.detach() for t in inputs), 1e-5)
    for name, got, want, need in zip(("dx", "dw", "db"), grads, ref_grads, needs):
        if not need:
            assert got is None, name
        elif name in ("dx", "dw") and shape[-1] == 1:
            assert got.abs().max().item() < 1e-2  # zero exactly (see the test below)
        else:
            check_close(name, got, want, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_backward_against_float64(shape, device, dtype, impl):
    if impl == "npu":
        pytest.skip("layer_norm has no npu implementation (torch's layer_norm is torch_npu's fused one)")
    inputs, dy, ref, ref_grads = _case(shape, device, dtype)
    y, grads = gradients(lambda x, w, b: call("layer_norm", impl, x, w, b, 1e-5), inputs, [dy])
    check_close("y", y, ref, dtype)
    for name, got, want in zip(("dx", "dw", "db"), grads, ref_grads):
        if name in ("dx", "dw") and shape[-1] == 1:
            # one column: y = bias and dx = dw = 0 exactly; computed as rstd * (rounding noise), rstd = eps^-1/2 = 316
            assert got.abs().max().item() < 1e-2
            continue
        check_close(name, got, want, dtype)


def test_without_affine_parameters(device, dtype, impl):
    if impl == "npu":
        pytest.skip("layer_norm has no npu implementation")
    inputs, dy, ref, ref_grads = _case((4, 3, 77), device, dtype, affine=False)
    y, (dx,) = gradients(lambda x: call("layer_norm", impl, x, None, None, 1e-5), inputs, [dy])
    check_close("y", y, ref, dtype)
    check_close("dx", dx, ref_grads[0], dtype)


def test_rows_with_a_large_mean_keep_their_variance(device, impl):
    """Rows of mean 4096 and variance 1, wider than the fused kernels take: a variance taken as E[x²] − E[x]² in
    float32 would lose it entirely (E[x²] ≈ 1.7e7, whose float32 spacing is 2). A mean rounded to float32 is off by
    up to 1.2e-4 of the spread (torch's own float32 layer_norm: 1.2e-4 relative error in y here), hence 1e-3."""
    if impl == "npu":
        pytest.skip("layer_norm has no npu implementation")
    gen = torch.Generator().manual_seed(3)
    x = (4096 + torch.randn(3, 20000, generator=gen, dtype=torch.float64)).float().double()  # float32 values
    w, b, dy = torch.randn(20000, generator=gen, dtype=torch.float64), torch.randn(20000, generator=gen,
                                                                                  dtype=torch.float64), \
        torch.randn(3, 20000, generator=gen, dtype=torch.float64)
    ref, ref_grads = gradients(lambda *t: layer_norm_reference(*t, 1e-5), [t.clone().requires_grad_() for t in
                                                                           (x, w, b)], [dy])
    inputs = [leaf(t, device, torch.float32) for t in (x, w, b)]
    y, grads = gradients(lambda *t: call("layer_norm", impl, *t, 1e-5), inputs, [dy.to(device, torch.float32)])
    assert relative_error(y, ref) < 1e-3
    assert all(relative_error(got, want) < 1e-3 for got, want in zip(grads, ref_grads))
    again = call_backward("layer_norm", impl, (dy.to(device, torch.float32),), (True, True, True),
                          *(t.detach() for t in inputs), 1e-5)  # the statistics recomputed, as in a compiled graph
    assert all(relative_error(got, want) < 1e-3 for got, want in zip(again, ref_grads))


def test_non_contiguous_and_zero_rows(device, impl):
    if impl == "npu":
        pytest.skip("layer_norm has no npu implementation")
    base = torch.randn(5, 40, device=device)
    x = base[:, ::2]  # stride 2 along the normalised dim
    w, b = torch.randn(20, device=device), torch.randn(20, device=device)
    check_close("y", call("layer_norm", impl, x, w, b, 1e-5), layer_norm_reference(x.cpu().double(), w.cpu().double(),
                                                                                 b.cpu().double(), 1e-5), torch.float32)
    empty = torch.empty(0, 20, device=device, requires_grad=True)
    wg = w.clone().requires_grad_()
    call("layer_norm", impl, empty, wg, b, 1e-5).sum().backward()
    assert empty.grad.shape == (0, 20) and torch.equal(wg.grad.cpu(), torch.zeros(20))


def test_module_and_bad_input(device):
    norm = torchport.kernels.LayerNorm(16, device=device)
    x = torch.randn(3, 16, device=device)
    check_close("module", norm(x), torch.nn.functional.layer_norm(x.cpu().double(), (16,)), torch.float32)
    with pytest.raises(ValueError, match=r"bias must have shape \[hidden\] = \[16\].*\[3, 16\].*\[15\]"):
        torchport.kernels.layer_norm(x, torch.ones(16, device=device), torch.zeros(15, device=device))
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        torchport.kernels.layer_norm(x.int(), None, None)
    with pytest.raises(ValueError, match="at least one dimension"):
        torchport.kernels.layer_norm(torch.tensor(1.0, device=device), None, None)


@pytest.mark.parametrize("programs,n", [(1, 300), (7, 1), (528, 256), (1500, 37), (132, 4097)])
def test_weight_gradient_partial_sums_in_one_launch(programs, n, device):
    """The backward's per-program partial sums of the weight and bias gradients, summed by one Triton launch into
    the parameters' dtypes: against a float64 sum, for one program, more programs than one step takes (1500), and
    widths that are not multiples of a block."""
    import os

    if not (device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
        pytest.skip(f"the Triton kernels run on cuda, or on cpu under TRITON_INTERPRET=1; not on {device.type}")
    from torchport.kernels.triton import norm

    gen = torch.Generator().manual_seed(programs)
    dw, db = (torch.randn(programs, n, generator=gen) for _ in range(2))
    for dtypes in ((torch.float32, torch.float32), (torch.bfloat16, torch.float16)):
        got_w, got_b = norm._totals(dw.to(device), db.to(device), dtypes)
        for got, parts, dtype in ((got_w, dw, dtypes[0]), (got_b, db, dtypes[1])):
            assert got.shape == (n,) and got.dtype == dtype
            tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
            torch.testing.assert_close(got.double().cpu(), parts.double().sum(0), rtol=tol, atol=1e-4)
    only_db = norm._totals(None, db.to(device), (torch.float32, torch.bfloat16))
    assert only_db[0] is None and only_db[1].dtype == torch.bfloat16
    torch.testing.assert_close(only_db[1].double().cpu(), db.double().sum(0), rtol=8e-3, atol=1e-4)
    assert norm._totals(None, None, (torch.float32, torch.float32)) == (None, None)


@pytest.mark.parametrize(("rows", "affine_dtype", "fused"),
                         [(16, torch.bfloat16, True), (16, None, True), (17, torch.bfloat16, False),
                          (2, torch.float32, False)], ids=["decode", "no affine", "17 rows", "mixed dtypes"])
def test_host_bound_calls_take_torchs_fused_operator(monkeypatch, rows, affine_dtype, fused):
    """On an accelerator in auto mode, inputs of at most 2^17 elements go to PyTorch's fused LayerNorm (the
    reference), whose C++ autograd node costs the host less than the Triton path."""
    pytest.importorskip("triton")
    import importlib

    from torchport.kernels import registry
    from torchport.kernels.triton import norm

    module = importlib.import_module("torchport.kernels.layer_norm")  # the package's name is the function
    ran = []
    monkeypatch.setattr(module, "layer_norm_reference", lambda x, w, b, eps: ran.append(("fused", eps)) or x)
    monkeypatch.setattr(norm, "layer_norm", lambda x, *rest: ran.append(("triton",)) or x)
    x = torch.empty(rows, 8192, device="meta", dtype=torch.bfloat16)  # an accelerator's tensor, never computed
    w = b = None if affine_dtype is None else torch.empty(8192, device="meta", dtype=affine_dtype)
    registry.implementation("layer_norm", "triton").fn(x, w, b, 1e-5)
    assert ran == ([("fused", 1e-5)] if fused else [("triton",)])
    ran.clear()
    monkeypatch.setenv("TORCHPORT_KERNELS", "layer_norm=triton")  # forced: runs as forced
    registry.implementation("layer_norm", "triton").fn(x, w, b, 1e-5)
    assert ran == [("triton",)]
