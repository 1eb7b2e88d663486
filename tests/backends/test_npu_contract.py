"""torchport against its snapshot of torch_npu's operator contract (``backends/data/torch_npu_contract.json``).

Three parties must agree on each torch_npu operator torchport uses: the snapshot (op-plugin's schema, whether
derivatives.yaml gives it a backward), every call site in ``src/torchport`` (read with ``ast``: argument count and
names, keyword-only arguments, how many results it takes), and the simulated operator of ``torchport.testing``
(its signature with ``inspect``, its results and backward when run).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

import torchport
from torchport.backends.npu import chip_profile, npu_chip_profiles, torch_npu_contract

SRC = Path(torchport.__file__).parent
DATA = SRC / "backends" / "data"
FUSED_OP_FUNCTIONS = {"fused_op", "fused_op_reason", "fused_op_unavailable", "chip_lacks", "operator_limits"}


# -- schemas -------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    type: str
    default: object
    has_default: bool
    keyword_only: bool


@dataclasses.dataclass(frozen=True)
class Schema:
    name: str
    args: tuple[Arg, ...]
    returns: int

    @property
    def positional(self) -> list[Arg]:
        return [a for a in self.args if not a.keyword_only]


def _split(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "(["
        depth -= char in ")]"
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return parts + ([current.strip()] if current.strip() else [])


def parse_schema(text: str) -> Schema:
    """``name(Type arg, Type arg=default, *, Type kw=default) -> Ret`` or ``-> (Ret, Ret)``."""
    match = re.fullmatch(r"(\w+)\((.*)\) -> (.+)", text)
    assert match, f"not a schema: {text}"
    name, arguments, returns = match.groups()
    args, keyword_only = [], False
    for part in _split(arguments):
        if part == "*":
            keyword_only = True
            continue
        declared, _, default = part.partition("=")
        kind, arg_name = declared.rsplit(" ", 1)
        value = ast.literal_eval(default) if default else None
        args.append(Arg(arg_name, kind, value, bool(default), keyword_only))
    count = len(_split(returns[1:-1])) if returns.startswith("(") else 1
    return Schema(name, tuple(args), count)


def test_the_schema_parser_reads_what_the_snapshot_holds() -> None:
    parsed = parse_schema("npu_gelu(Tensor self, *, str approximate='none') -> Tensor")
    assert [(a.name, a.default, a.keyword_only) for a in parsed.args] == [("self", None, False),
                                                                         ("approximate", "none", True)]
    assert parse_schema("f(Tensor x, int[]? p=None, float s=1.) -> (Tensor, Tensor, int)").returns == 3
    with pytest.raises(AssertionError, match="not a schema"):
        parse_schema("npu_gelu(Tensor self)")


def _contract() -> dict[str, dict]:
    return torch_npu_contract()


def _schemas() -> dict[str, tuple[Schema, Schema]]:
    """name -> (newest schema, oldest schema)."""
    out = {}
    for name, entry in _contract().items():
        newest = parse_schema(entry["schema"])
        oldest = parse_schema(entry["oldest_schema"]) if entry["oldest_schema"] else newest
        assert newest.name == oldest.name == name
        out[name] = (newest, oldest)
    return out


def test_the_snapshot_names_its_sources() -> None:
    for file in ("torch_npu_contract.json", "ascend_chips.json"):
        sources = json.loads((DATA / file).read_text())["sources"]
        assert sources, file
        for source in sources.values():
            assert "/" in source["repository"] and source["path"], (file, source)
            commits = [source["commit"]] if "commit" in source else list(source["commits"].values())
            assert all(re.fullmatch(r"[0-9a-f]{40}", c) for c in commits), (file, source)


def test_each_operator_entry_is_complete() -> None:
    families = set(json.loads((DATA / "torch_npu_contract.json").read_text())["families"])
    for name, entry in _contract().items():
        newest, oldest = _schemas()[name]
        assert set(entry["families"]) <= families, name
        assert len(entry["differentiable_outputs"]) == newest.returns, name
        assert entry["backward"] == any(entry["differentiable_outputs"]), name
        # an older release may lack trailing optional arguments, never have others
        assert newest.args[:len(oldest.args)] == oldest.args, name
        assert all(a.has_default for a in newest.args[len(oldest.args):]), name


# -- call sites in src/ ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class CallSite:
    op: str
    where: str
    call: ast.Call
    parent: ast.AST


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _callee(node: ast.Call) -> str | None:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _npu_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"npu_\w+", node.value):
        return node.value
    return None


def _enclosing_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.AST | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return None


def _calls_of(name: str, scope: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(scope)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def scan(source: str, where: str) -> tuple[list[CallSite], set[str]]:
    """The calls of torch_npu operators in ``source`` and every operator name it asks the backend about.

    Operators are reached through ``fused_op("npu_x", ...)`` (called at once, or through the variable it is assigned
    to), or handed as the first argument of the functions a ``FUSED = {"npu_x": function}`` table maps them to.
    """
    tree = ast.parse(source)
    parents = _parents(tree)
    sites, named = [], set()
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _callee(node) in FUSED_OP_FUNCTIONS and node.args:
            op = _npu_name(node.args[0])
            if op is None:
                continue
            named.add(op)
            if _callee(node) != "fused_op":
                continue
            parent = parents[node]
            if isinstance(parent, ast.Call) and parent.func is node:
                sites.append(CallSite(op, where, parent, parents[parent]))
            elif (isinstance(parent, ast.Assign) and len(parent.targets) == 1
                  and isinstance(parent.targets[0], ast.Name)):
                scope = _enclosing_function(parent, parents) or tree
                sites += [CallSite(op, where, c, parents[c]) for c in _calls_of(parent.targets[0].id, scope)]
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if isinstance(getattr(node, "value", None), ast.Dict) and any(
                isinstance(t, ast.Name) and t.id == "FUSED" for t in targets):
            for key, value in zip(node.value.keys, node.value.values):
                op = _npu_name(key)
                if op is None or not isinstance(value, ast.Name):
                    continue
                named.add(op)
                function = functions[value.id]
                first = function.args.args[0].arg
                sites += [CallSite(op, where, c, parents[c]) for c in _calls_of(first, function)]
    return sites, named


def _src_files() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if "testing" not in p.relative_to(SRC).parts]


def check_call(site: CallSite, newest: Schema, oldest: Schema) -> list[str]:
    """What is wrong with one call site against the schemas (it must suit the oldest release too)."""
    call, problems = site.call, []
    label = f"{site.where}:{call.lineno} {site.op}"
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return [f"{label}: *args/**kwargs cannot be checked against the schema"]
    for schema in (newest, oldest):
        positional = schema.positional
        if len(call.args) > len(positional):
            problems.append(f"{label}: {len(call.args)} positional arguments, the schema takes {len(positional)}")
        given = {a.name for a in positional[:len(call.args)]}
        names = {a.name for a in schema.args}
        for keyword in call.keywords:
            if keyword.arg not in names:
                release = "" if schema is newest else " (oldest release)"
                problems.append(f"{label}: no argument {keyword.arg!r} in {schema.name}{release}")
            elif keyword.arg in given:
                problems.append(f"{label}: {keyword.arg!r} given twice")
        given |= {k.arg for k in call.keywords}
        missing = [a.name for a in schema.args if not a.has_default and a.name not in given]
        if missing:
            problems.append(f"{label}: required argument(s) {missing} not given")
    parent, returns = site.parent, newest.returns
    if isinstance(parent, ast.Subscript) and parent.value is call:
        index = parent.slice
        if not (isinstance(index, ast.Constant) and isinstance(index.value, int)):
            problems.append(f"{label}: results indexed by a non-constant")
        elif returns == 1 or index.value >= returns:
            problems.append(f"{label}: takes result [{index.value}] of {returns} result(s)")
    elif isinstance(parent, ast.Assign) and isinstance(parent.targets[0], ast.Tuple):
        if len(parent.targets[0].elts) != returns:
            problems.append(f"{label}: unpacks {len(parent.targets[0].elts)} results of {returns}")
    elif returns != 1:
        problems.append(f"{label}: uses the {returns}-tuple of results as one tensor")
    return problems


def test_every_call_site_in_src_matches_the_snapshot() -> None:
    schemas = _schemas()
    sites, named = [], set()
    for path in _src_files():
        found, names = scan(path.read_text(), str(path.relative_to(SRC)))
        sites += found
        named |= names
    assert named <= set(schemas), f"operators torchport uses but the snapshot lacks: {sorted(named - set(schemas))}"
    called = {site.op for site in sites}
    # the operators torchport calls today, each found at its call site(s)
    assert called == {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention",
                      "npu_cross_entropy_loss", "npu_weight_quant_batchmatmul", "npu_convert_weight_to_int4pack"}
    problems = [p for site in sites for p in check_call(site, *schemas[site.op])]
    assert not problems, "\n".join(problems)


def test_the_call_site_check_catches_mismatches() -> None:
    """The same scan and check on wrong calls: each kind of mismatch is reported."""
    source = '''
def norm(x, w):
    return registry.fused_op("npu_rms_norm", x.device)(x, w, eps=1e-6)        # no argument eps

def rot(q, c, s):
    mul = registry.fused_op("npu_rotary_mul", q.device)
    return mul(q, c, s)[0]                                                 # a single result indexed

def glu(x):
    y, z = registry.fused_op("npu_swiglu", x.device)(x)                    # one result unpacked in two
    return y

def quant(x, w, s):
    return registry.fused_op("npu_weight_quant_batchmatmul", x.device)(x, w, s, weight_dtype=1)   # newer only

def gelu(x):
    return registry.fused_op("npu_gelu", x.device)(x, "tanh")             # keyword-only given by position

def attn(op, q, k, v):
    return op(q, k, v, 2)                                                  # input_layout missing

FUSED: dict = {"npu_fusion_attention": attn}
'''
    schemas = _schemas()
    sites, named = scan(source, "example.py")
    assert named == {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_weight_quant_batchmatmul", "npu_gelu",
                     "npu_fusion_attention"}
    problems = {site.op: check_call(site, *schemas[site.op]) for site in sites}
    assert "no argument 'eps'" in problems["npu_rms_norm"][0]
    assert "takes result [0] of 1" in problems["npu_rotary_mul"][0]
    assert "unpacks 2 results of 1" in problems["npu_swiglu"][0]
    assert "no argument 'weight_dtype' in npu_weight_quant_batchmatmul (oldest release)" in \
        problems["npu_weight_quant_batchmatmul"][0]
    assert "2 positional arguments, the schema takes 1" in problems["npu_gelu"][0]
    assert "required argument(s) ['input_layout'] not given" in problems["npu_fusion_attention"][0]


# -- the simulated operators -----------------------------------------------------------------------------------------
@pytest.fixture
def sim(npu: torch.device) -> torch.device:
    """The simulated NPU (the simulated operators are what these tests check)."""
    from torchport.testing import is_simulating

    if not is_simulating():
        pytest.skip("checks the simulated NPU; this NPU is a real one")
    return npu


def test_every_simulated_operator_has_the_schemas_signature() -> None:
    from torchport.testing import npu_fused_ops

    schemas = _schemas()
    assert set(npu_fused_ops.OPS) == set(schemas), "the simulation and the snapshot hold different operators"
    for name, fn in npu_fused_ops.OPS.items():
        schema, _ = schemas[name]
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params] == [a.name for a in schema.args], name
        for param, arg in zip(params, schema.args):
            kind = inspect.Parameter.KEYWORD_ONLY if arg.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
            assert param.kind == kind, (name, arg.name)
            if arg.has_default:
                same = param.default == arg.default and isinstance(param.default, bool) == isinstance(arg.default, bool)
                assert same, (name, arg.name, param.default, arg.default)
            else:
                assert param.default is inspect.Parameter.empty, (name, arg.name)


def _samples(npu: torch.device) -> dict[str, tuple[tuple, dict]]:
    """Valid arguments for each simulated operator; floating inputs require grad."""
    gen = torch.Generator().manual_seed(0)

    def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(npu, dtype).requires_grad_()

    angles = torch.randn(1, 1, 3, 8, generator=gen)
    return {
        "npu_rms_norm": ((t(2, 3, 16), t(16)), {}),
        "npu_rotary_mul": ((t(1, 2, 3, 8), angles.cos().to(npu).requires_grad_(),
                            angles.sin().to(npu).requires_grad_()), {}),
        "npu_swiglu": ((t(2, 8),), {}),
        "npu_fusion_attention": ((t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8), 2, "BNSD"), {"scale": 0.35}),
        "npu_cross_entropy_loss": ((t(4, 10), torch.tensor([1, 0, 9, 3]).to(npu)), {}),
        "npu_weight_quant_batchmatmul": ((t(2, 64, dtype=torch.float16),
                                          torch.randint(-8, 8, (64, 16), generator=gen, dtype=torch.int8).to(npu),
                                          t(16, dtype=torch.float16)), {}),
        "npu_convert_weight_to_int4pack": ((torch.randint(-8, 8, (16, 8), generator=gen, dtype=torch.int32).to(npu),),
                                           {}),
        "npu_gelu": ((t(3, 4),), {"approximate": "tanh"}),
    }


def test_simulated_results_and_backward_follow_the_snapshot(sim: torch.device) -> None:
    from torchport.testing import npu_fused_ops, simulated_chip

    schemas = _schemas()
    with simulated_chip("Ascend910B3"):  # an A2 chip, which runs every operator of the snapshot
        for name, (args, kwargs) in _samples(sim).items():
            entry = _contract()[name]
            out = npu_fused_ops.OPS[name](*args, **kwargs)
            results = out if isinstance(out, tuple) else (out,)
            assert (len(results) > 1) == isinstance(out, tuple), name
            assert len(results) == schemas[name][0].returns, name
            tensors = [(r, d) for r, d in zip(results, entry["differentiable_outputs"]) if isinstance(r, torch.Tensor)]
            needs_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            for result, differentiable in tensors:  # outputs derivatives.yaml declares non-differentiable
                if entry["backward"] and not differentiable and result.numel():
                    assert result.grad_fn is None, f"{name}: a non-differentiable output carries a gradient"
            first = results[0]
            if not needs_grad:
                continue
            if entry["backward"]:
                first.float().sum().backward()
                assert any(a.grad is not None for a in args if isinstance(a, torch.Tensor) and a.requires_grad), name
            else:
                with pytest.raises(RuntimeError, match=f"derivative for '{name}' is not implemented"):
                    first.float().sum().backward()


def test_torchport_differentiates_only_operators_with_a_backward(sim: torch.device) -> None:
    """torchport's kernels run forward and backward on the simulated NPU through the fused operators; a simulated
    operator without a backward fails in it, so passing means no call site relies on a backward torch_npu lacks."""
    from torchport.quant.formats import get_format
    from torchport.kernels.lowbit_matmul import lowbit_linear
    from torchport.testing import npu_fused_ops, simulated_chip

    with simulated_chip("Ascend910B3"):
        before = dict(npu_fused_ops.calls)
        x = torch.randn(3, 32).to(sim).requires_grad_()
        torchport.kernels.rms_norm(x, torch.ones(32).to(sim)).sum().backward()
        torchport.kernels.swiglu(x, x * 2).sum().backward()
        q = torch.randn(1, 2, 5, 8).to(sim).requires_grad_()
        angles = torch.randn(1, 5, 8)
        qr, kr = torchport.kernels.rope(q, q, angles.cos().to(sim), angles.sin().to(sim))
        (qr + kr).sum().backward()
        logits = torch.randn(6, 50).to(sim).requires_grad_()
        torchport.kernels.cross_entropy(logits, torch.randint(0, 50, (6,)).to(sim)).backward()
        for fmt, group in (("int8", None), ("int4", 64)):
            spec = get_format(fmt)
            group = spec.group_size(group, 128)
            t = {n: v.to(sim) for n, v in spec.quantize(torch.randn(16, 128), group).items()}
            a = torch.randn(2, 128, dtype=torch.float16).to(sim).requires_grad_()
            lowbit_linear(a, t, fmt, group, None, dequantize=spec.dequantize).float().sum().backward()
            assert a.grad is not None
        used = {name: npu_fused_ops.calls[name] - before.get(name, 0) for name in npu_fused_ops.OPS}
    assert all(used[name] > 0 for name in ("npu_rms_norm", "npu_swiglu", "npu_rotary_mul", "npu_cross_entropy_loss",
                                           "npu_weight_quant_batchmatmul", "npu_convert_weight_to_int4pack")), used


# -- chips -------------------------------------------------------------------------------------------------------------
def test_chip_profiles_use_the_snapshots_families() -> None:
    families = set(json.loads((DATA / "torch_npu_contract.json").read_text())["families"])
    profiles = npu_chip_profiles()
    assert {p.family for p in profiles.values()} <= families
    for profile in profiles.values():
        assert profile.ops == {op for op, e in _contract().items() if profile.family in e["families"]}
    assert chip_profile("Ascend910_93").family == "A3"
