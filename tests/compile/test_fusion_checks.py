"""The numerical check behind every fusion pass (``compile/passes/_replace.py``).

A fused op replaces a matched subgraph only when both compute the same values and the same gradients on sample
inputs: a replacement that differs (a kernel computing something else, forward or backward) leaves the subgraph as
it was, with a note and one warning. The check runs on shrunk sizes, falls back to the graph's own sizes when a size
is written into the graph, and is remembered per pattern.
"""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport.compile import passes
from torchport.compile.passes import _replace
from torchport.kernels import library

TRAINING = passes.PassContext(torch.device("cpu"), training=True)


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    _replace.forget()
    yield
    torch._dynamo.reset()
    _replace.forget()


def capture(fn, *inputs) -> tuple[torch.fx.GraphModule, list]:
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=record, fullgraph=True)(*inputs)
    (found,) = graphs
    return found


def rewrite(gm: torch.fx.GraphModule, name: str) -> tuple[torch.fx.GraphModule, passes.PassRecord]:
    enabled = {p.name: p.name == name for p in passes.list_passes()}
    with torchport.settings.override(strict=True):
        after, records = passes.run_passes(copy.deepcopy(gm), TRAINING, enabled)
    (record,) = [r for r in records if r.name == name]
    return after, record


def fused_ops(gm: torch.fx.GraphModule) -> collections.Counter[str]:
    return collections.Counter(n.target.overloadpacket.__name__ for n in gm.graph.nodes if n.op == "call_function"
                               and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "torchport")


def llama_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_matching_replacement_is_checked_and_applied():
    gm, _ = capture(llama_norm, _randn(3, 16), _randn(16, seed=1))
    after, record = rewrite(gm, "rms_norm")
    assert fused_ops(after) == {"rms_norm": 1}
    assert record.notes == ["replaced 1 RMSNorm subgraph with torchport::rms_norm"]


def test_replacement_with_other_values_is_refused(monkeypatch):
    """A kernel whose forward computes another function (here: the norm without its weight) is not put in place."""
    gm, _ = capture(llama_norm, _randn(3, 16), _randn(16, seed=1))
    monkeypatch.setitem(library.IMPLEMENTATIONS, "rms_norm",
                        lambda x, w, eps, offset: torchport.kernels.rms_norm(x, torch.ones_like(w), eps, offset))
    with pytest.warns(RuntimeWarning, match="RMSNorm subgraph was left unfused, because result 0 differs"):
        after, record = rewrite(gm, "rms_norm")
    assert not fused_ops(after)
    assert after.code == gm.code
    assert len(record.notes) == 1 and record.notes[0].startswith("left a RMSNorm subgraph unfused: result 0 differs")


def test_replacement_with_other_gradients_is_refused(monkeypatch):
    """Right values, wrong gradients: refused too (the backward is part of the function a training graph needs)."""
    gm, _ = capture(lambda g, u: F.silu(g) * u, _randn(3, 8), _randn(3, 8, seed=1))
    vjp = library._vjp
    monkeypatch.setattr(library, "_vjp", lambda *args: [None if g is None else 2 * g for g in vjp(*args)])
    with pytest.warns(RuntimeWarning, match="the gradient of input 0 differs"):
        after, record = rewrite(gm, "swiglu")
    assert not fused_ops(after)
    assert "unfused: the gradient of input 0 differs" in record.notes[0]


def test_refusal_leaves_other_matches_alone(monkeypatch):
    """Only the pattern whose replacement differs stays: the others in the graph are still fused."""
    def block(x, w, g, u):
        return llama_norm(x, w), F.silu(g) * u

    gm, _ = capture(block, _randn(3, 16), _randn(16, seed=1), _randn(3, 8, seed=2), _randn(3, 8, seed=3))
    monkeypatch.setitem(library.IMPLEMENTATIONS, "rms_norm", lambda x, w, eps, offset: x.clone())
    enabled = {p.name: p.name in ("rms_norm", "swiglu") for p in passes.list_passes()}
    with pytest.warns(RuntimeWarning, match="RMSNorm"):
        after, _ = passes.run_passes(copy.deepcopy(gm), TRAINING, enabled)
    assert fused_ops(after) == {"swiglu": 1}


def test_check_runs_on_shrunk_sizes_once_per_pattern(monkeypatch):
    """Batch and sequence sizes shrink to 4, the hidden size stays; two layers of one pattern are checked once."""
    seen = []
    evaluate = _replace._evaluate
    monkeypatch.setattr(_replace, "_evaluate", lambda module, samples: seen.append(
        [tuple(s.shape) for s in samples]) or evaluate(module, samples))

    def two_norms(x1, x2, w1, w2):
        return llama_norm(x1, w1), llama_norm(x2, w2)

    gm, _ = capture(two_norms, _randn(6, 9, 16), _randn(6, 9, 16, seed=3), _randn(16, seed=1), _randn(16, seed=2))
    after, _ = rewrite(gm, "rms_norm")
    assert fused_ops(after) == {"rms_norm": 2}
    assert seen == [[(4, 4, 16), (16,)]] * 2  # the subgraph, then the fused op; once for both norms


def test_size_written_into_graph_is_checked_at_full_size(monkeypatch):
    """``view(14, 64)`` cannot run on shrunk logits: the check runs again at the graph's own sizes and passes."""
    seen = []
    evaluate = _replace._evaluate
    monkeypatch.setattr(_replace, "_evaluate", lambda module, samples: seen.append(
        tuple(samples[0].shape)) or evaluate(module, samples))

    def loss(logits, labels):
        return F.cross_entropy(logits.float().view(14, 64), labels.view(14), ignore_index=-100)

    gm, _ = capture(loss, _randn(2, 7, 64), torch.randint(0, 64, (2, 7)))
    after, record = rewrite(gm, "cross_entropy")
    assert fused_ops(after) == {"cross_entropy": 1}, record.notes
    assert seen == [(2, 4, 64), (2, 7, 64), (2, 7, 64)]


def test_too_large_to_check_at_full_size_is_refused(monkeypatch):
    monkeypatch.setattr(_replace, "FULL_SIZE_LIMIT", 100)

    def loss(logits, labels):
        return F.cross_entropy(logits.float().view(14, 64), labels.view(14))

    gm, _ = capture(loss, _randn(2, 7, 64), torch.randint(0, 64, (2, 7)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after, record = rewrite(gm, "cross_entropy")
    assert not fused_ops(after)
    assert "runs only at its own sizes, 910 elements, too many to check" in record.notes[0]
    assert any("left unfused" in str(w.message) for w in caught)


def test_warning_once_per_cause(monkeypatch):
    monkeypatch.setitem(library.IMPLEMENTATIONS, "rms_norm", lambda x, w, eps, offset: x.clone())
    gm, _ = capture(llama_norm, _randn(3, 16), _randn(16, seed=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rewrite(gm, "rms_norm")
        rewrite(gm, "rms_norm")
    assert sum("left unfused" in str(w.message) for w in caught) == 1
