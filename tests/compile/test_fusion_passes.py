"""The fused-kernel passes: RMSNorm, SwiGLU, GeGLU, RoPE and cross-entropy subgraphs -> torchport custom ops.

Graphs are captured by dynamo from the real Hugging Face modules (tiny configs). Per pass: the pattern is found and
replaced, forward and backward give the same values before and after (float32 tightly, bfloat16 loosely), and
graphs that only look similar are left as they were. End to end, a tiny LlamaForCausalLM training graph ends up with
the expected number of each torchport op and the same loss and gradients, also through AOTAutograd.
"""

from __future__ import annotations

import collections
import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport.compile import passes

transformers = pytest.importorskip("transformers")
from transformers import GemmaConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402
from transformers.models.gemma import modeling_gemma  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

FUSION_PASSES = tuple(p.name for p in passes.list_passes() if p.fusion)  # each swaps in one op's custom op
TRAINING = passes.PassContext(torch.device("cpu"), training=True)
# ||after - before|| / ||before||: float32 differs only in the order of operations; bfloat16 in where it rounds
# (the kernels round once, from float32, where the eager graph rounds after every op).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LLAMA = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                    num_hidden_layers=2, vocab_size=64, max_position_embeddings=64)
GEMMA = GemmaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    hidden_act="gelu_pytorch_tanh")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def capture(fn: Callable[..., Any], *inputs: Any, dynamic: bool | None = None) -> tuple[torch.fx.GraphModule, list]:
    """The graph dynamo captures for ``fn(*inputs)`` (parameters lifted to placeholders) and its inputs."""
    graphs = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=record, fullgraph=True, dynamic=dynamic)(*inputs)
    assert len(graphs) == 1
    return graphs[0]


def rewrite(gm: torch.fx.GraphModule, *names: str) -> tuple[torch.fx.GraphModule, list[passes.PassRecord]]:
    """A copy of ``gm`` rewritten by the named passes, run by the pass runner in strict mode (failures raise)."""
    enabled = {p.name: p.name in names for p in passes.list_passes()}
    with torchport.settings.override(strict=True):
        return passes.run_passes(copy.deepcopy(gm), TRAINING, enabled)


def torchport_ops(gm: torch.fx.GraphModule) -> collections.Counter[str]:
    return collections.Counter(str(node.target.overloadpacket.__name__) for node in gm.graph.nodes
                               if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
                               and node.target.namespace == "torchport")


def targets(gm: torch.fx.GraphModule) -> set[Any]:
    return {node.target for node in gm.graph.nodes if node.op in ("call_function", "call_method")}


def run(gm: torch.fx.GraphModule, inputs: list, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Outputs of ``gm`` and the gradients of every floating input, for fixed random output gradients."""
    leaves = [t.detach().to(device).requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
              for t in inputs]
    outputs = [o for o in gm(*leaves) if isinstance(o, torch.Tensor)]
    gen = torch.Generator().manual_seed(7)
    differentiable = [o for o in outputs if o.requires_grad]
    ups = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in differentiable]
    wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(differentiable, wanted, ups, allow_unused=True)
    return [*outputs, *(torch.zeros_like(w) if g is None else g for g, w in zip(grads, wanted))]


def assert_same(after: list[torch.Tensor], before: list[torch.Tensor], dtype: torch.dtype) -> None:
    assert len(after) == len(before)
    for i, (a, b) in enumerate(zip(after, before)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"value {i}: {a.shape} {a.dtype} != {b.shape} {b.dtype}"
        a, b = a.detach().cpu().double(), b.detach().cpu().double()
        err = (a - b).norm().item() / max(b.norm().item(), 1e-3 * math.sqrt(b.numel()))
        assert err <= TOLERANCE[dtype], f"value {i}: relative difference {err:.3g} > {TOLERANCE[dtype]}"


def check_rewrite(name: str, fn: Callable[..., Any], inputs: list, dtype: torch.dtype,
                  expected: dict[str, int]) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Capture ``fn``, run pass ``name``: the expected torchport ops appear, a note says so, values stay."""
    gm, example = capture(fn, *inputs)
    after, records = rewrite(gm, name)
    assert torchport_ops(after) == collections.Counter(expected)
    (record,) = [r for r in records if r.name == name]
    assert record.error is None and len(record.notes) == 1 and "torchport::" in record.notes[0]
    assert_same(run(after, example), run(gm, example), dtype)
    return gm, after


def check_untouched(name: str, fn: Callable[..., Any], *inputs: Any) -> None:
    gm, _ = capture(fn, *inputs)
    after, records = rewrite(gm, name)
    assert after.code == gm.code
    assert not torchport_ops(after)
    assert not any(r.notes for r in records)


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _with_random_weights(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():  # off their initial ones/zeros, so a wrong offset would show
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    return module.to(dtype)


# --- RMSNorm --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_rms_norm_replaced(family, dtype):
    norm = (modeling_llama.LlamaRMSNorm(32, eps=1e-5) if family == "llama" else modeling_gemma.GemmaRMSNorm(32))
    _, after = check_rewrite("rms_norm", _with_random_weights(norm, dtype), [_randn(2, 5, 32, dtype=dtype)], dtype,
                             {"rms_norm": 1})
    (fused,) = [n for n in after.graph.nodes if n.target is torch.ops.torchport.rms_norm.default]
    assert fused.args[2:] == ((1e-5, 0.0) if family == "llama" else (1e-6, 1.0))
    assert torch.rsqrt not in targets(after) and "pow" not in targets(after)


def test_rms_norm_replaced_with_dynamic_shapes():
    norm = _with_random_weights(modeling_llama.LlamaRMSNorm(16), torch.float32)
    gm, example = capture(norm, _randn(3, 4, 16), dynamic=True)
    assert any(isinstance(t, torch.SymInt) for t in example)  # the batch and sequence sizes are symbolic
    after, _ = rewrite(gm, "rms_norm")
    assert torchport_ops(after) == {"rms_norm": 1}
    assert_same(run(after, example), run(gm, example), torch.float32)


def _llama_norm(x, w, dim=-1):
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(dim, keepdim=True) + 1e-6)).to(x.dtype)


def test_rms_norm_replaced_with_weight_as_attribute():
    norm = _with_random_weights(modeling_llama.LlamaRMSNorm(16), torch.float32)
    gm, _ = torch._dynamo.export(norm)(_randn(3, 16))
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    after, _ = rewrite(gm, "rms_norm")
    assert torchport_ops(after) == {"rms_norm": 1}
    assert_same(run(after, [_randn(3, 16, seed=1)]), run(gm, [_randn(3, 16, seed=1)]), torch.float32)


def _norm_without_eps(x, w):
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))).to(x.dtype)


def _norm_with_shared_rsqrt(x, w):
    h = x.to(torch.float32)
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * (h * r).to(x.dtype), r


def _norm_in_low_precision(x, w):  # the mean square in bfloat16: the kernel would compute it in float32
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _norm_without_weight(x, w):
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) + w


@pytest.mark.parametrize("fn,dtype,weight_shape", [
    (lambda x, w: _llama_norm(x, w, dim=0), torch.float32, (16,)),
    (_norm_without_eps, torch.float32, (16,)),
    (_norm_with_shared_rsqrt, torch.float32, (16,)),
    (_norm_in_low_precision, torch.bfloat16, (16,)),
    (_norm_without_weight, torch.float32, (16,)),
    (modeling_llama.LlamaRMSNorm(16).forward, torch.bfloat16, None),  # float32 weight: a float32 result
    (_llama_norm, torch.float32, (4, 16)),  # a weight that is not a vector of the hidden size
], ids=["mean_over_dim0", "no_eps", "rsqrt_used_twice", "bf16_mean_square", "no_weight", "mixed_dtypes",
        "matrix_weight"])
def test_rms_norm_lookalikes_untouched(fn, dtype, weight_shape):
    x = _randn(4, 16, dtype=dtype)
    inputs = (x,) if weight_shape is None else (x, _randn(*weight_shape, dtype=dtype, seed=1))
    check_untouched("rms_norm", fn, *inputs)


# --- SwiGLU and GeGLU -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_swiglu_replaced_in_llama_mlp(dtype):
    mlp = _with_random_weights(modeling_llama.LlamaMLP(LLAMA), dtype)
    _, after = check_rewrite("swiglu", mlp, [_randn(2, 5, 32, dtype=dtype)], dtype, {"swiglu": 1})
    assert F.silu not in targets(after)


@pytest.mark.parametrize("fn", [
    lambda g, u: F.relu(g) * u,
    lambda g, u: F.silu(g) * u[..., :1],  # broadcasting product
    lambda g, u: (lambda s: (s * u, s))(F.silu(g)),  # the activation is also an output
    lambda g, u: F.silu(g, inplace=True) * u,
], ids=["relu", "broadcast", "activation_reused", "in_place"])
def test_swiglu_lookalikes_untouched(fn):
    check_untouched("swiglu", fn, _randn(3, 8), _randn(3, 8, seed=1))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_geglu_replaced_in_gemma_mlp(dtype):
    mlp = _with_random_weights(modeling_gemma.GemmaMLP(GEMMA), dtype)
    _, after = check_rewrite("geglu", mlp, [_randn(2, 5, 32, dtype=dtype)], dtype, {"geglu": 1})
    assert F.gelu not in targets(after)


def test_geglu_replaced_for_gelu_new_written_out():
    act = ACT2FN["gelu_new"]  # 0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))), op by op
    _, after = check_rewrite("geglu", lambda g, u: act(g) * u, [_randn(3, 8), _randn(3, 8, seed=1)],
                             torch.float32, {"geglu": 1})
    assert torch.tanh not in targets(after)


def _gelu_new_other_constant(g, u):
    return 0.5 * g * (1.0 + torch.tanh(0.7978845608028654 * (g + 0.04 * torch.pow(g, 3.0)))) * u


@pytest.mark.parametrize("fn", [
    lambda g, u: F.gelu(g) * u,  # the exact (erf) GELU
    _gelu_new_other_constant,
    lambda g, u: F.silu(g) * u,
], ids=["erf_gelu", "other_constant", "silu"])
def test_geglu_lookalikes_untouched(fn):
    check_untouched("geglu", fn, _randn(3, 8), _randn(3, 8, seed=1))


# --- RoPE -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("table_batch", [1, 2], ids=["shared_table", "per_batch_table"])
def test_rope_replaced(dtype, table_batch):
    inputs = [_randn(2, 4, 5, 8, dtype=dtype), _randn(2, 2, 5, 8, dtype=dtype, seed=1),
              _randn(table_batch, 5, 8, dtype=dtype, seed=2), _randn(table_batch, 5, 8, dtype=dtype, seed=3)]
    _, after = check_rewrite("rope", modeling_llama.apply_rotary_pos_emb, inputs, dtype, {"rope": 1})
    assert torch.cat not in targets(after) and "unsqueeze" not in targets(after)


def _rotate_q_only(q, k, cos, sin):
    return q * cos.unsqueeze(1) + modeling_llama.rotate_half(q) * sin.unsqueeze(1), k


def _rotate_wrong_way(q, k, cos, sin):
    def turn(x):
        return torch.cat((x[..., 4:], -x[..., :4]), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + turn(q) * s, k * c + turn(k) * s


def _rotate_quarter(q, k, cos, sin):
    def turn(x):
        return torch.cat((-x[..., 2:], x[..., :2]), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + turn(q) * s, k * c + turn(k) * s


@pytest.mark.parametrize("fn,layout", [
    (_rotate_q_only, "bhsd"),
    (_rotate_wrong_way, "bhsd"),
    (_rotate_quarter, "bhsd"),
    (lambda q, k, cos, sin: modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2), "bshd"),
], ids=["lone_rotation", "opposite_rotation", "unequal_halves", "unsqueeze_dim_2"])
def test_rope_lookalikes_untouched(fn, layout):
    q, k = _randn(1, 4, 5, 8), _randn(1, 2, 5, 8, seed=1)
    if layout == "bshd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    check_untouched("rope", fn, q, k, _randn(1, 5, 8, seed=2), _randn(1, 5, 8, seed=3))


# --- cross-entropy --------------------------------------------------------------------------------------------------

def _labels(batch: int, seq: int, vocab: int) -> torch.Tensor:
    labels = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(5))
    labels[0, :2] = -100
    return labels


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_replaced_in_causal_lm_loss(dtype, reduction):
    def loss(logits, labels, num_items):
        return ForCausalLMLoss(logits, labels, 40, num_items if reduction == "sum" else None)

    inputs = [_randn(2, 6, 40, dtype=dtype) * 3, _labels(2, 6, 40), torch.tensor(9)]
    _, after = check_rewrite("cross_entropy", loss, inputs, dtype, {"cross_entropy": 1})
    (fused,) = [n for n in after.graph.nodes if n.target is torch.ops.torchport.cross_entropy.default]
    assert fused.args[2:] == (-100, 0.0, reduction, 0.0, False)  # no host check of the targets in a compiled step
    assert F.cross_entropy not in targets(after)
    assert "float" not in targets(after)  # no float32 copy of the logits: the kernel upcasts inside


def test_cross_entropy_options_kept():
    fn = lambda logits, target: F.cross_entropy(logits, target, ignore_index=3, label_smoothing=0.2,  # noqa: E731
                                                reduction="none")
    _, after = check_rewrite("cross_entropy", fn, [_randn(7, 11), torch.arange(7) % 5], torch.float32,
                             {"cross_entropy": 1})
    (fused,) = [n for n in after.graph.nodes if n.target is torch.ops.torchport.cross_entropy.default]
    assert fused.args[2:] == (3, 0.2, "none", 0.0, False)


@pytest.mark.parametrize("fn,inputs", [
    (lambda x, t: F.cross_entropy(x, t, weight=torch.linspace(0.5, 1.5, 11)), [_randn(7, 11), torch.arange(7)]),
    (lambda x, t: F.cross_entropy(x, t.softmax(-1)), [_randn(7, 11), _randn(7, 11, seed=1)]),
    (lambda x, t: F.cross_entropy(x, t), [_randn(2, 11, 3), torch.zeros(2, 3, dtype=torch.long)]),
    (lambda x, t: F.nll_loss(F.log_softmax(x, -1), t), [_randn(7, 11), torch.arange(7)]),
], ids=["class_weights", "probability_targets", "class_dim_1", "nll_of_log_softmax"])
def test_cross_entropy_lookalikes_untouched(fn, inputs):
    check_untouched("cross_entropy", fn, *inputs)


# --- plain code, written as in the lookalikes above but exactly matching ------------------------------------------

def _rotate(q, k, cos, sin):
    def turn(x):
        return torch.cat((-x[..., 4:], x[..., :4]), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return turn(q) * s + c * q, k * c + turn(k) * s


@pytest.mark.parametrize("name,fn,inputs", [
    ("rms_norm", _llama_norm, [_randn(4, 16), _randn(16, seed=1)]),
    ("swiglu", lambda g, u: u * F.silu(g), [_randn(3, 8), _randn(3, 8, seed=1)]),
    ("geglu", lambda g, u: F.gelu(g, approximate="tanh") * u, [_randn(3, 8), _randn(3, 8, seed=1)]),
    ("rope", _rotate, [_randn(1, 4, 5, 8), _randn(1, 2, 5, 8, seed=1), _randn(1, 5, 8, seed=2),
                       _randn(1, 5, 8, seed=3)]),
    ("cross_entropy", lambda x, t: F.cross_entropy(x, t), [_randn(7, 11), torch.arange(7)]),
], ids=["rms_norm", "swiglu", "geglu", "rope", "cross_entropy"])
def test_plain_code_replaced(name, fn, inputs):
    check_rewrite(name, fn, inputs, torch.float32, {name: 1})


# --- end to end -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_graph() -> tuple[torch.fx.GraphModule, list, torch.fx.GraphModule, list[passes.PassRecord]]:
    """A tiny LlamaForCausalLM's training graph (loss from labels), its inputs, and the graph rewritten."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LLAMA).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, LLAMA.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    gm, example = capture(lambda ids: model(input_ids=ids, labels=ids).loss, ids)
    return (gm, example, *rewrite(gm, *FUSION_PASSES))


def test_tiny_llama_training_graph_gets_every_kernel(llama_graph):
    gm, example, after, records = llama_graph
    layers = LLAMA.num_hidden_layers
    assert torchport_ops(after) == {"rms_norm": 2 * layers + 1, "swiglu": layers, "rope": layers, "cross_entropy": 1}
    assert not targets(after) & {torch.rsqrt, F.silu, F.cross_entropy}
    notes = {r.name: r.notes for r in records}
    assert notes["rms_norm"] == [f"replaced {2 * layers + 1} RMSNorm subgraphs with torchport::rms_norm"]
    assert notes["geglu"] == []
    assert_same(run(after, example), run(gm, example), torch.float32)


def differentiable(inputs: list) -> list:
    """``inputs`` with every floating tensor requiring grad, as :func:`run` differentiates them."""
    return [t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t for t in inputs]


def test_tiny_llama_rewritten_graph_through_aot_autograd(llama_graph):
    """AOTAutograd traces the rewritten graph with the ops' fake implementations and derives the backward from
    their autograd registrations: loss and every gradient stay those of the original graph.

    AOTAutograd derives gradients only for the inputs that require grad when it traces, so it traces with the
    inputs :func:`run` differentiates: the rotary ``inv_freq`` buffer included. (Since transformers 5.24 the rotary
    table is computed with grad enabled, so that buffer has a gradient; a graph traced with the buffer as it is in
    the model, not requiring grad, gives none.)
    """
    from torch._dynamo.backends.registry import lookup_backend

    gm, example, after, _ = llama_graph
    compiled = lookup_backend("aot_eager")(copy.deepcopy(after), differentiable(example))
    assert_same(run(compiled, example), run(gm, example), torch.float32)



def test_rewritten_graphs_run_on_every_device(device):
    norm = _with_random_weights(modeling_llama.LlamaRMSNorm(32), torch.float32)
    mlp = _with_random_weights(modeling_llama.LlamaMLP(LLAMA), torch.float32)

    def block(x, q, k, cos, sin):
        q, k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        return mlp(norm(x)), q, k

    inputs = [_randn(2, 5, 32), _randn(2, 4, 5, 8, seed=1), _randn(2, 2, 5, 8, seed=2), _randn(1, 5, 8, seed=3),
              _randn(1, 5, 8, seed=4)]
    gm, example = capture(block, *inputs)
    after, _ = rewrite(gm, *FUSION_PASSES)
    assert torchport_ops(after) == {"rms_norm": 1, "swiglu": 1, "rope": 1}
    assert_same(run(after, example, device), run(gm, example, "cpu"), torch.float32)
