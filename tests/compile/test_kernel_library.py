"""torchport kernels as ``torch.library`` custom ops: results and gradients against the plain-PyTorch references in
float64, the per-device choice at run time (the simulated NPU's fused operators), fake implementations and
autograd registrations (``opcheck``), and ``torch.compile(fullgraph=True)`` with AOTAutograd and Inductor."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport.kernels import library, registry
from torchport.kernels.glu import geglu_reference, swiglu_reference
from torchport.kernels.rms_norm import rms_norm_reference
from torchport.kernels.rope import rope_reference

ops = torch.ops.torchport
# ||out - ref|| / ||ref|| against float64: one rounding of the output in the tensor's dtype, with room for
# the 16-bit gradients (rounded inputs, then rounded results).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _check(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    err = (out - ref).norm().item() / max(ref.norm().item(), 1e-2 * ref.numel() ** 0.5)
    assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.3g} > {TOLERANCE[dtype]} ({dtype})"


def _leaves(*shapes, device, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen, dtype=torch.float64) * scale for s in shapes]
    return [b.requires_grad_() for b in base], [b.detach().to(device, dtype).requires_grad_() for b in base]


def _grads(outputs, inputs, seed=1):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    gen = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outputs]
    grads = torch.autograd.grad(outputs, inputs, [u.to(o.device, o.dtype) for o, u in zip(outputs, ups)])
    return outputs, grads


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_rms_norm(device, dtype, offset):
    ref_in, inputs = _leaves((3, 5, 40), (40,), device=device, dtype=dtype)
    (y,), grads = _grads(ops.rms_norm(*inputs, 1e-6, offset), inputs)
    (ref,), ref_grads = _grads(rms_norm_reference(*ref_in, 1e-6, offset), ref_in)
    assert y.dtype == dtype and y.device == inputs[0].device
    for name, out, expected in zip(("y", "dx", "dw"), (y, *grads), (ref, *ref_grads)):
        _check(name, out, expected, dtype)


@pytest.mark.parametrize("op,reference", [("swiglu", swiglu_reference), ("geglu", geglu_reference)])
def test_gated(device, dtype, op, reference):
    ref_in, inputs = _leaves((4, 7, 33), (4, 7, 33), device=device, dtype=dtype, scale=2.0)
    (y,), grads = _grads(getattr(ops, op)(*inputs), inputs)
    (ref,), ref_grads = _grads(reference(*ref_in), ref_in)
    for name, out, expected in zip(("y", "dgate", "dup"), (y, *grads), (ref, *ref_grads)):
        _check(name, out, expected, dtype)


@pytest.mark.parametrize("table", [(1, 6, 16), (2, 6, 16), (6, 16)], ids=["shared", "per_batch", "2d"])
def test_rope_gradients_of_q_k_cos_and_sin(device, dtype, table):
    ref_in, inputs = _leaves((2, 4, 6, 16), (2, 2, 6, 16), table, table, device=device, dtype=dtype)
    outs, grads = _grads(ops.rope(*inputs), inputs)
    c, s = (t.unsqueeze(0) if t.dim() == 2 else t for t in ref_in[2:])
    ref_outs, ref_grads = _grads(rope_reference(ref_in[0], ref_in[1], c, s), ref_in)
    for name, out, expected in zip(("q", "k", "dq", "dk", "dcos", "dsin"), (*outs, *grads), (*ref_outs, *ref_grads)):
        _check(name, out, expected, dtype)


def test_rope_gradient_of_q_alone_when_k_is_unused(device):
    ref_in, inputs = _leaves((1, 2, 5, 8), (1, 1, 5, 8), (1, 5, 8), (1, 5, 8), device=device, dtype=torch.float32)
    q_out, _ = ops.rope(*inputs[:2], inputs[2].detach(), inputs[3].detach())
    dq, dk = torch.autograd.grad(q_out.sum(), inputs[:2], allow_unused=True)
    ref_q, _ = rope_reference(*ref_in[:2], ref_in[2].detach(), ref_in[3].detach())
    (ref_dq,) = torch.autograd.grad(ref_q.sum(), ref_in[:1])
    _check("dq", dq, ref_dq, torch.float32)
    assert dk is None or torch.count_nonzero(dk.cpu()) == 0


def _ce_case(device, dtype, n=9, vocab=37):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[[1, 4]] = -100
    return logits, logits.to(device, dtype).requires_grad_(), target, target.to(device)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_in_float32_against_pytorch(device, dtype, reduction, smoothing):
    ref_logits, logits, ref_target, target = _ce_case(device, dtype)
    loss = ops.cross_entropy(logits, target, -100, smoothing, reduction)
    assert loss.dtype == torch.float32  # the loss is summed in float32 whatever the logits' dtype
    ref_logits.requires_grad_()
    ref = F.cross_entropy(ref_logits, ref_target, ignore_index=-100, label_smoothing=smoothing, reduction=reduction)
    (loss,), (grad,) = _grads(loss, [logits])
    (ref,), (ref_grad,) = _grads(ref, [ref_logits])
    _check("loss", loss, ref, dtype)
    _check("dlogits", grad, ref_grad, dtype)


def test_cross_entropy_mean_over_no_kept_row_is_zero(device):
    logits = torch.randn(3, 5, device=device, requires_grad=True)
    loss = ops.cross_entropy(logits, torch.full((3,), -100, device=device), -100, 0.0, "mean")
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad.cpu()) == 0


def test_cross_entropy_rejects_an_unknown_reduction():
    with pytest.raises(ValueError, match=r"^torchport::cross_entropy: reduction='avg'; allowed: 'mean', 'sum', 'none'"):
        ops.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), -100, 0.0, "avg")
    with pytest.raises(ValueError, match=r"^torchport::fused_linear_cross_entropy: reduction='avg'; allowed: 'mean'"):
        ops.fused_linear_cross_entropy(torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1]), None, -100, 0.0,
                                       "avg", None, 0.0, None, [True, False, False, False])


def test_bad_arguments_get_the_kernels_errors():
    with pytest.raises(ValueError, match="rms_norm: weight must have shape"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6, 0.0)
    with pytest.raises(ValueError, match="rope: head_dim must be even"):
        ops.rope(torch.randn(1, 2, 3, 5), torch.randn(1, 2, 3, 5), torch.randn(1, 3, 5), torch.randn(1, 3, 5))
    with pytest.raises(ValueError, match=r"a target is below 0 or at least the vocabulary size 3.*\[0, 3\)"):
        ops.cross_entropy(torch.randn(2, 3), torch.tensor([0, 7]), -100, 0.0, "mean")


def test_output_layout_is_what_the_fake_promises():
    x = torch.randn(6, 4, 16).transpose(0, 1)  # dense, not contiguous
    y = ops.rms_norm(x, torch.ones(16), 1e-6, 0.0)
    assert y.stride() == torch.empty_like(x).stride()
    gate = torch.randn(8, 5).t()
    assert ops.swiglu(gate, gate.clone()).stride() == torch.empty_like(gate).stride()


def test_forward_and_backward_choose_the_kernel_at_run_time(monkeypatch):
    """Each op, forward and backward, asks the kernel registry for the implementation at the time it runs."""
    asked = []
    call = registry.call
    monkeypatch.setattr(registry, "call", lambda op, device, *args: asked.append((op, device.type)) or call(
        op, device, *args))
    x, w = torch.randn(3, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    q, k = torch.randn(1, 2, 4, 8, requires_grad=True), torch.randn(1, 1, 4, 8, requires_grad=True)
    cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    logits = torch.randn(4, 10, requires_grad=True)
    outputs = [ops.rms_norm(x, w, 1e-6, 0.0), ops.swiglu(x, x), ops.geglu(x, x), *ops.rope(q, k, cos, sin),
               ops.cross_entropy(logits, torch.tensor([1, 2, 3, -100]), -100, 0.0, "mean")]
    forward = ["rms_norm", "swiglu", "geglu", "rope", "cross_entropy"]
    assert asked == [(op, "cpu") for op in forward]
    sum(o.sum() for o in outputs).backward()
    assert sorted(asked[len(forward):]) == sorted((op, "cpu") for op in forward)


def test_autograd_is_off_inside_an_op_and_on_in_the_block():
    seen = []

    @torch.library.custom_op("torchport_test::probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        t = x.detach().requires_grad_()
        seen.append((t * 2).requires_grad)
        with library.autograd_enabled():
            seen.append((t * 2).requires_grad)
        seen.append((t * 2).requires_grad)
        return x.clone()

    probe(torch.ones(2, requires_grad=True))
    assert seen == [False, True, False]


def _opcheck_cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape, grad=True):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    target = torch.tensor([1, -100, 3, 0])
    return {
        "rms_norm": (ops.rms_norm.default, (r(3, 8), r(8), 1e-6, 1.0)),
        "layer_norm": (ops.layer_norm.default, (r(3, 8), r(8), r(8), 1e-5)),
        "layer_norm_no_bias": (ops.layer_norm.default, (r(3, 8), r(8), None, 1e-5)),
        "layer_norm_no_affine": (ops.layer_norm.default, (r(3, 8), None, None, 1e-5)),
        "swiglu": (ops.swiglu.default, (r(3, 8), r(3, 8))),
        "geglu": (ops.geglu.default, (r(3, 8), r(3, 8))),
        "rope": (ops.rope.default, (r(2, 2, 3, 8), r(2, 1, 3, 8), r(1, 3, 8), r(1, 3, 8))),
        "cross_entropy_mean": (ops.cross_entropy.default, (r(4, 6), target, -100, 0.1, "mean")),
        "cross_entropy_none": (ops.cross_entropy.default, (r(4, 6), target, -100, 0.0, "none")),
        "cross_entropy_z_loss": (ops.cross_entropy.default, (r(4, 6), target, -100, 0.0, "sum", 1e-2)),
        "fused_linear_cross_entropy_mean": (
            ops.fused_linear_cross_entropy.default,
            (r(4, 5), r(6, 5), target, None, -100, 0.1, "mean", None, 0.0, None, [True, True, False, False])),
        "fused_linear_cross_entropy_bias_none": (
            ops.fused_linear_cross_entropy.default,
            (r(4, 5), r(6, 5), target, r(6), -100, 0.0, "none", None, 1e-3, 5.0, [True, True, False, True])),
        "fused_linear_cross_entropy_divisor": (
            ops.fused_linear_cross_entropy.default,
            (r(4, 5), r(6, 5), target, None, -100, 0.0, "sum", 7.0, 0.0, None, [True, True, False, False])),
        "fused_linear_cross_entropy_frozen_head": (
            ops.fused_linear_cross_entropy.default,
            (r(4, 5), r(6, 5, grad=False), target, r(6), -100, 0.0, "mean", None, 0.0, 3.0,
             [True, False, False, True])),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


def test_every_op_is_registered():
    for name in library.OPS:
        assert hasattr(ops, name), name


def _all_ops(x, w, g1, u1, g2, u2, q, k, cos, sin, logits, target):
    return (ops.rms_norm(x, w, 1e-6, 1.0), ops.swiglu(g1, u1), ops.geglu(g2, u2), *ops.rope(q, k, cos, sin),
            ops.cross_entropy(logits, target, -100, 0.0, "sum"))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_and_backward_equal_eager(backend):
    if backend == "inductor":
        pytest.importorskip("torch._inductor")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 8), (8,), (3, 6), (3, 6), (3, 6), (3, 6), (1, 2, 5, 8), (1, 1, 5, 8), (1, 5, 8), (1, 5, 8), (4, 10)]
    inputs = [torch.randn(s, generator=g).requires_grad_() for s in shapes] + [torch.tensor([1, -100, 3, 9])]
    differentiable = inputs[:-1]
    eager = _all_ops(*inputs)
    ups = [torch.randn(o.shape, generator=g) for o in eager]
    eager_grads = torch.autograd.grad(eager, differentiable, ups)
    # only the ops' own outputs (the gradients of distinct inputs): Inductor then generates no C++ kernel
    compiled = torch.compile(_all_ops, backend=backend, fullgraph=True)(*inputs)
    grads = torch.autograd.grad(compiled, differentiable, ups)
    for out, ref in zip((*compiled, *grads), (*eager, *eager_grads)):
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


def test_only_compiling_imports_the_library():
    """``import torchport`` (and ``torchport.kernels``) stays as fast as it was: only the compile passes, imported
    when a graph is compiled, and ``registry.custom_op``, which the public functions call under ``torch.compile``,
    import this module; an eager kernel call does not."""
    src = pathlib.Path(torchport.__file__).parent
    importers = {path.relative_to(src).as_posix() for path in src.rglob("*.py")
                 for node in ast.walk(ast.parse(path.read_text())) if _imports_library(node, path)}
    assert {path.rsplit("/", 1)[0] for path in importers} - {"kernels"} == {"compile/passes"}
    assert {path for path in importers if path.startswith("kernels/")} == {"kernels/registry.py"}
    code = ("import sys, torch, torchport\n"
            "torchport.kernels.rms_norm(torch.randn(2, 8, requires_grad=True), torch.ones(8)).sum().backward()\n"
            "assert 'torchport.kernels.library' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _imports_library(node: ast.AST, path: pathlib.Path) -> bool:
    """``import torchport.kernels.library``, ``from ...kernels import library``, ``from .library import x``..."""
    in_kernels = path.parent.name == "kernels"
    if isinstance(node, ast.Import):
        return any(a.name.endswith("kernels.library") for a in node.names)
    if not isinstance(node, ast.ImportFrom):
        return False
    module = node.module or ""
    if module.endswith("kernels.library") or (module == "library" and in_kernels):
        return True
    return any(a.name == "library" for a in node.names) and (module.endswith("kernels") or (not module and in_kernels))


def test_backward_works_when_the_library_is_first_imported_below_autograd() -> None:
    """The library may be imported first inside a compiler call or a custom op, where the dispatcher already
    excludes autograd: the backward's recompute must still record a graph."""
    code = (
        "import torch\n"
        "with torch._C._AutoDispatchBelowAutograd():\n"
        "    from torchport.kernels import library\n"
        "x = torch.randn(3, 8, requires_grad=True)\n"
        "w = torch.randn(8, requires_grad=True)\n"
        "torch.ops.torchport.rms_norm(x, w, 1e-6, 0.0).sum().backward()\n"
        "assert x.grad is not None and w.grad is not None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("name", [name for name, spec in registry.list_specs().items() if spec.custom_op])
def test_public_functions_compile_to_their_custom_op_with_no_graph_break(name):
    """Under torch.compile each op's public function calls its custom op (fullgraph: no graph break, no host
    synchronisation); values and gradients equal the eager call's."""
    spec = registry.list_specs()[name]
    torch._dynamo.reset()
    args = [a.requires_grad_() if i < spec.differentiable else a
            for i, a in enumerate(spec.inputs("test", torch.Generator().manual_seed(0)))]
    leaves = args[:spec.differentiable]

    def outputs(fn):
        out = fn(*args)
        out = out if isinstance(out, tuple) else (out,)
        return out, torch.autograd.grad(sum(o.float().square().sum() for o in out), leaves)

    explained = torch._dynamo.explain(spec.call)(*args)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    called = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
    assert f"torchport.{name}" in called, called
    eager, eager_grads = outputs(spec.call)
    compiled, grads = outputs(torch.compile(spec.call, backend="aot_eager", fullgraph=True))
    for got, want in zip((*compiled, *grads), (*eager, *eager_grads)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def _triton_on_the_host(monkeypatch, op, fn=None, backward=None):
    """``op``'s triton implementation serving the CPU (Triton's interpreter runs it), with its functions or
    replacements; the registry's choices are forgotten before and after."""
    import dataclasses
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" or not registry.implementation(op, "triton").backward:
        pytest.skip("needs Triton's interpreter on the host (TRITON_INTERPRET=1) and the triton package")
    impls = registry._implementations(op)
    real = impls["triton"]
    monkeypatch.setitem(impls, "triton", dataclasses.replace(
        real, devices=frozenset({"cpu"}), fn=fn or real.fn, backward=backward or real.backward))
    registry.refresh()
    monkeypatch.setattr(registry, "_broken", {})


@pytest.mark.parametrize("op", ["rms_norm", "swiglu"])
def test_compiled_backward_runs_the_implementations_backward_not_the_forward_again(monkeypatch, op):
    counts = {"forward": 0, "backward": 0}
    real = registry.implementation(op, "triton")

    def forward(*args):
        counts["forward"] += 1
        return real.fn(*args)

    def backward(*args):
        counts["backward"] += 1
        return real.backward(*args)

    _triton_on_the_host(monkeypatch, op, forward, backward)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 40, generator=g, dtype=torch.float64), torch.randn(40 if op == "rms_norm" else (3, 40),
                                                                             generator=g, dtype=torch.float64)
    call = (lambda x, y: ops.rms_norm(x, y, 1e-6, 0.0)) if op == "rms_norm" else ops.swiglu
    reference = (lambda x, y: rms_norm_reference(x, y, 1e-6, 0.0)) if op == "rms_norm" else swiglu_reference
    leaves = [a.float().requires_grad_(), b.float().requires_grad_()]
    torch._dynamo.reset()
    out = torch.compile(call, backend="aot_eager", fullgraph=True)(*leaves)
    out.backward(torch.ones_like(out))
    assert counts == {"forward": 1, "backward": 1}
    ref_leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    reference(*ref_leaves).sum().backward()
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_a_refused_or_failing_implementation_backward_falls_back_to_the_recompute(monkeypatch):
    calls = []

    def refuses(grads, needs, *args):
        calls.append("refused")
        raise registry.Unsupported("not these arguments")

    _triton_on_the_host(monkeypatch, "rms_norm", backward=refuses)
    x, w = torch.randn(3, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    ops.rms_norm(x, w, 1e-6, 0.0).sum().backward()
    assert calls == ["refused"]
    expected = [t.grad.clone() for t in (x, w)]

    def fails(grads, needs, *args):
        calls.append("failed")
        raise RuntimeError("an illegal memory access (forced failure)")

    _triton_on_the_host(monkeypatch, "rms_norm", backward=fails)
    x.grad = w.grad = None
    with pytest.warns(RuntimeWarning, match="rms_norm: triton cannot run on cpu .*forced failure"):
        ops.rms_norm(x, w, 1e-6, 0.0).sum().backward()
    torch.testing.assert_close([x.grad, w.grad], expected)
    with torchport.settings.override(kernels="rms_norm=triton"):
        registry.refresh()
        monkeypatch.setattr(registry, "_broken", {})
        with pytest.raises(registry.KernelError, match="the backward of the forced implementation 'triton' failed"):
            ops.rms_norm(x, w, 1e-6, 0.0).sum().backward()
    registry.refresh()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_loss_compiled_computes_its_gradients_once_in_the_forward(monkeypatch, reduction):
    """The fused loss's forward hands its gradients to the backward (which multiplies them by the upstream
    gradient), so a compiled step runs the token pass once, as the eager path does; ``"none"`` weights rows in its
    backward, which runs the op again."""
    from torchport.kernels import linear_ce_passes

    calls = []
    for name in ("_pass_tokens", "_pass_rows"):  # the forward runs one of them (a strategy of its own choice)
        original = getattr(linear_ce_passes, name)
        monkeypatch.setattr(linear_ce_passes, name, lambda *a, _f=original: calls.append(1) or _f(*a))
    g = torch.Generator().manual_seed(3)
    h64, w64, b64 = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((6, 8), (13, 8), (13,)))
    target = torch.tensor([1, 2, -100, 3, 12, 0])
    up = torch.randn(6, generator=g, dtype=torch.float64) if reduction == "none" else torch.tensor(0.37).double()

    def loss(h, w, b):
        return torchport.kernels.fused_linear_cross_entropy(h, w, target, b, reduction=reduction, softcap=4.0,
                                                            label_smoothing=0.1, loss_dtype=torch.float32)

    leaves = [t.float().requires_grad_() for t in (h64, w64, b64)]
    torch._dynamo.reset()
    out = torch.compile(loss, backend="aot_eager", fullgraph=True)(*leaves)
    out.backward(up.float())
    assert len(calls) == (2 if reduction == "none" else 1)
    ref_leaves = [t.clone().requires_grad_() for t in (h64, w64, b64)]
    from torchport.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_reference

    ref = fused_linear_cross_entropy_reference(*ref_leaves[:2], target, ref_leaves[2], reduction=reduction,
                                               label_smoothing=0.1, softcap=4.0, loss_dtype=torch.float64)
    ref.backward(up)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # no gradient wanted: the loss alone
        calls.clear()
        torch.compile(loss, backend="aot_eager", fullgraph=True)(*leaves)
        assert len(calls) == 1
    torch._dynamo.reset()


def test_fused_loss_op_refuses_a_gradient_it_was_not_asked_for():
    h, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    with pytest.raises(ValueError, match="a gradient is needed for weight, which the forward was not asked"):
        ops.fused_linear_cross_entropy(h, w, torch.tensor([0, 1, 2]), None, -100, 0.0, "mean", None, 0.0, None,
                                       [True, False, False, False])


def test_fused_loss_divides_by_a_tensor_count_on_the_device_when_compiled():
    """HF Trainer's ``num_items_in_batch`` tensor is not read on the host in a compiled graph: no graph break, the
    same loss and gradients as the eager path (which reads it), NaN for a count of 0 (never a finite loss)."""
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(6, 8, generator=g), torch.randn(13, 8, generator=g)
    target = torch.tensor([1, 2, -100, 3, 12, 0])

    def loss(h, w, count):
        return torchport.kernels.fused_linear_cross_entropy(h, w, target, num_items_in_batch=count,
                                                            loss_dtype=torch.float32)

    eager_leaves = [t.clone().requires_grad_() for t in (h, w)]
    expected = loss(*eager_leaves, torch.tensor(7))
    expected.backward()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(h, w, torch.tensor(7))
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = compiled(*leaves, torch.tensor(7))
    got.backward()
    torch.testing.assert_close(got, expected)
    for a, b in zip(leaves, eager_leaves):
        torch.testing.assert_close(a.grad, b.grad)
    assert torch.isnan(compiled(h, w, torch.tensor(0)))
    with pytest.raises(ValueError, match="num_items_in_batch must be > 0, got 0"):
        loss(h, w, 0)
    torch._dynamo.reset()
