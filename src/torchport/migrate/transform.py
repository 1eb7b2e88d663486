"""One pass of libcst over a module: rules rewrite nodes, the device definition goes after the imports.

The transformer marks which strings name a device (``.to("cuda")``, ``device="cuda"``, ``device = "cuda"`` ...)
while visiting, lets the rules of :mod:`.rules` rewrite nodes on the way out, records each change and each site
that cannot be rewritten, and finally inserts one definition of the device at the top of the module when a
rewritten site needs it. Source names are written relative to :data:`SOURCE`, the module being migrated away from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from . import review, unconvertible
from .registry import SOURCE, SOURCE_DEVICE, rules_for

__all__ = ["SOURCE", "TRIGGERS", "Change", "Unconverted", "Review", "Context", "MigrationTransformer"]

DEVICE_NAMES = ("DEVICE", "DEFAULT_DEVICE", "TORCH_DEVICE", "MIGRATED_DEVICE")
DEVICE_DEFINITION = '{name} = {torch}.accelerator.current_accelerator(check_available=True) or {torch}.device("cpu")'
# check_available=True: on a CUDA build with no GPU visible, current_accelerator() alone still answers "cuda".
# The bare form (written by earlier versions) is recognised too, so re-running stays idempotent.
_DEFINITION_RE = re.compile(
    r"^(\w+) = (\w+)\.accelerator\.current_accelerator\((?:check_available=True)?\) or \2\.device\([\"']cpu[\"']\)$"
)

#: text without any of these has nothing a rule rewrites, reports or lists to review: such a module is not parsed by
#: libcst (about 1.5 ms a line on a 2-core machine); a rule whose golden examples (tests/migrate/test_rules.py)
#: lack every trigger fails there
TRIGGERS = re.compile(
    rf"{SOURCE_DEVICE}|nccl|init_process_group|device_ids|output_device|flash_attn|cupy|triton|cpp_extension"
    r"|(\.to\(|device\(|device=)\s*[\w.]*?(\d|rank|gpu|device_i)|device_map\s*=\s*\{"  # integer devices
)

#: keyword arguments that name a device in any call
DEVICE_KEYWORDS = frozenset({"device", "device_type", "map_location", "device_map"})
#: calls whose first positional argument names a device
DEVICE_FIRST_ARG = frozenset(
    {"torch.device", "torch.Generator", "torch.autocast", "torch.amp.autocast", "torch.amp.GradScaler",
     "torch.set_default_device", "torch.amp.autocast_mode.autocast"}
)
#: methods whose first positional argument names a device, whatever the receiver
DEVICE_FIRST_ARG_METHODS = frozenset({"to", SOURCE_DEVICE})


@dataclass(frozen=True)
class Change:
    """One rewritten site. ``line`` and ``col`` (1-based) refer to the file before migration."""

    path: str
    line: int
    col: int
    rule: str
    before: str
    after: str


@dataclass(frozen=True)
class Unconverted:
    """One site left as written, with why and what to do by hand."""

    path: str
    line: int
    col: int
    what: str
    hint: str


@dataclass(frozen=True)
class Review:
    """One rewritten site whose behaviour on a machine without an accelerator depends on how the script is called."""

    path: str
    line: int
    col: int
    what: str
    hint: str


class Context:
    """What a rule may ask about the module being migrated, and how it builds replacement code."""

    def __init__(self, transformer: MigrationTransformer, torch_alias: str, device_name: str) -> None:
        self._transformer = transformer
        self.torch = torch_alias
        self.device_name = device_name
        self.needs_device = False
        self.needs_torch = False
        self.statement_guards: set[cst.IfExp] = set()
        self.blocked_names: set[str] = set()  # from-imported names whose import stays as written
        self.cache: dict[str, object] = {}  # what a rule works out once per module
        self.helpers: dict[str, str] = {}  # name -> definition, put after the device definition
        self.imports: set[str] = set()  # modules the helpers import

    def helper(self, name: str, definition: str, imports: tuple[str, ...] = ()) -> str:
        """Define ``name`` once in the module (``definition`` is its code, ``{name}`` its name), importing
        ``imports``; returns the name to call, which avoids the module's own names. A module that defines a
        class or function of that name already (a second run) keeps it."""
        if name in self._transformer.defined:
            return name
        used = self._transformer.used_names
        chosen = name if name not in used else next(f"{name}{i}" for i in range(2, 100) if f"{name}{i}" not in used)
        self.helpers.setdefault(chosen, definition.format(name=chosen))
        self.imports.update(imports)
        return chosen

    @property
    def module(self) -> cst.Module:
        """The module being migrated, as parsed (its nodes are the original ones)."""
        return self._transformer._module

    def qualified(self, node: cst.CSTNode) -> set[str]:
        """The fully qualified names ``node`` (an original node) may refer to, through imports and aliases."""
        found = self._transformer.get_metadata(QualifiedNameProvider, node, set())
        return {q.name for q in found}

    def source_attribute(self, node: cst.CSTNode) -> str | None:
        """``"X"`` when ``node`` refers to attribute X of the module being migrated away from, else None."""
        for name in self.qualified(node):
            if name.startswith(SOURCE + "."):
                return name[len(SOURCE) + 1 :]
        return None

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self._transformer.get_metadata(ParentNodeProvider, node, None)

    def is_device_position(self, node: cst.CSTNode) -> bool:
        """Whether ``node`` (an original node) stands where a device is expected."""
        return node in self._transformer.device_positions

    def expr(self, template: str) -> cst.BaseExpression:
        """Parse ``template`` with ``{torch}`` (the module's name for torch) and ``{device}`` (the device)."""
        if "{device}" in template:
            self.needs_device = True
        self.needs_torch = self.needs_torch or "{torch}" in template or "{device}" in template
        return cst.parse_expression(template.format(torch=self.torch, device=self.device_name))

    def device_type(self) -> cst.BaseExpression:
        return self.expr("{device}.type")

    def guarded(self, call: cst.BaseExpression, default: str) -> cst.IfExp:
        """``(call if torch.accelerator.is_available() else default)``; as a whole statement it becomes an if."""
        test = self.expr("{torch}.accelerator.is_available()")
        guard = cst.IfExp(test=test, body=call, orelse=cst.parse_expression(default),
                          lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        if default == "None":
            self.statement_guards.add(guard)
        return guard

    def unconverted(self, node: cst.CSTNode, what: str, hint: str) -> None:
        self._transformer.report_unconverted(node, what, hint)

    def review(self, node: cst.CSTNode, what: str, hint: str) -> None:
        self._transformer.report_review(node, what, hint)


def _torch_alias(module: cst.Module) -> tuple[str | None, int]:
    """The name the module binds torch to at top level, and the index after the leading imports."""
    alias, end = None, 0
    for index, statement in enumerate(module.body):
        if not isinstance(statement, cst.SimpleStatementLine):
            break
        small = statement.body
        if all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in small):
            for s in small:
                for name in s.names if isinstance(s, cst.Import) else ():
                    dotted = cst.Module([]).code_for_node(name.name)
                    if alias is None and dotted == "torch":
                        alias = name.asname.name.value if name.asname else "torch"
                    elif alias is None and dotted.startswith("torch.") and name.asname is None:
                        alias = "torch"  # import torch.nn binds torch
            end = index + 1
        elif index == 0 and len(small) == 1 and isinstance(small[0], cst.Expr) and isinstance(
            small[0].value, (cst.SimpleString, cst.ConcatenatedString)
        ):
            end = 1  # the docstring
        else:
            break
    return alias, end


def _existing_definition(module: cst.Module) -> str | None:
    for statement in module.body:
        if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
            match = _DEFINITION_RE.match(cst.Module([]).code_for_node(statement.body[0]).strip())
            if match:
                return match.group(1)
    return None


class MigrationTransformer(cst.CSTTransformer):
    """Applies every registered rule to one module; see the module docstring."""

    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def __init__(self, module: cst.Module, path: str) -> None:
        super().__init__()
        self.path = path
        self.changes: list[Change] = []
        self.unconverted: list[Unconverted] = []
        self.review: list[Review] = []
        self.device_positions: set[cst.CSTNode] = set()
        self._module = module
        self._options = review.command_line_options(module)
        alias, self._imports_end = _torch_alias(module)
        self._has_torch = alias is not None
        self._existing = _existing_definition(module)
        used = {node.value for node in _names(module)}
        self.used_names = used
        self.defined = {statement.name.value for statement in module.body
                        if isinstance(statement, (cst.ClassDef, cst.FunctionDef))}
        self._imported = {cst.Module([]).code_for_node(alias.name) for statement in module.body
                          if isinstance(statement, cst.SimpleStatementLine) for small in statement.body
                          if isinstance(small, cst.Import) for alias in small.names if alias.asname is None}
        name = self._existing or next((n for n in DEVICE_NAMES if n not in used), DEVICE_NAMES[-1] + "_")
        self.ctx = Context(self, alias or "torch", name)

    # -- bookkeeping --------------------------------------------------------------------------------------------
    def _position(self, node: cst.CSTNode) -> tuple[int, int]:
        start = self.get_metadata(PositionProvider, node).start
        return start.line, start.column + 1

    def report_unconverted(self, node: cst.CSTNode, what: str, hint: str) -> None:
        line, col = self._position(node)
        site = Unconverted(self.path, line, col, what, hint)
        if site not in self.unconverted:
            self.unconverted.append(site)

    def report_review(self, node: cst.CSTNode, what: str, hint: str) -> None:
        line, col = self._position(node)
        self.review.append(Review(self.path, line, col, what, hint))

    def _mark(self, node: cst.CSTNode | None) -> None:
        if node is not None:
            self.device_positions.add(node)

    # -- visiting: which expressions name a device, and what cannot be rewritten ----------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.qualified(node.func)
        method = node.func.attr.value if isinstance(node.func, cst.Attribute) else None
        positional = [arg for arg in node.args if arg.keyword is None and not arg.star]
        if positional and (names & DEVICE_FIRST_ARG or method in DEVICE_FIRST_ARG_METHODS):
            self._mark(positional[0].value)
        is_device_option = method == "add_argument" and any(
            isinstance(arg.value, cst.SimpleString) and "device" in arg.value.value for arg in positional
        )
        for arg in node.args:
            if arg.keyword and (arg.keyword.value in DEVICE_KEYWORDS or (is_device_option and arg.keyword.value
                                                                         == "default")):
                self._mark(arg.value)

    def visit_Assign(self, node: cst.Assign) -> None:
        if any("device" in cst.Module([]).code_for_node(t.target).lower() for t in node.targets):
            self._mark(node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if "device" in cst.Module([]).code_for_node(node.target).lower():
            self._mark(node.value)

    def visit_Param(self, node: cst.Param) -> None:
        if "device" in node.name.value.lower():
            self._mark(node.default)

    def visit_DictElement(self, node: cst.DictElement) -> None:
        if isinstance(node.key, cst.SimpleString) and "device" in node.key.value.lower():
            self._mark(node.value)

    def visit_Dict(self, node: cst.Dict) -> None:
        if node in self.device_positions:  # map_location={"cuda:0": f"cuda:{rank}"}: the devices loaded onto
            for element in node.elements:
                if isinstance(element, cst.DictElement):
                    self._mark(element.value)

    def visit_IfExp(self, node: cst.IfExp) -> None:
        if node in self.device_positions:
            self._mark(node.body)
            self._mark(node.orelse)

    def visit_BooleanOperation(self, node: cst.BooleanOperation) -> None:
        if node in self.device_positions:
            self._mark(node.left)
            self._mark(node.right)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        parent = self.ctx.parent(node)
        if not (isinstance(parent, cst.Attribute) and parent.value is node):  # only the whole dotted name
            unconvertible.check_name(self.ctx, node, parent)

    def visit_If(self, node: cst.If) -> None:
        review.check_if(self.ctx, node, self._options)

    def visit_Assert(self, node: cst.Assert) -> None:
        review.check_assert(self.ctx, node, self._options)

    def visit_Import(self, node: cst.Import) -> None:
        unconvertible.check_import(self.ctx, node)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        unconvertible.check_import(self.ctx, node)

    # -- leaving: rules rewrite ------------------------------------------------------------------------------------
    def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode) -> cst.CSTNode:
        updated = super().on_leave(original_node, updated_node)
        if not isinstance(updated, cst.CSTNode):
            return updated
        for rule in rules_for(type(original_node)):
            result = rule.rewrite(original_node, updated, self.ctx)
            if result is not None:
                line, col = self._position(original_node)
                code = self._module.code_for_node
                self.changes.append(Change(self.path, line, col, rule.id, code(original_node).strip(),
                                           cst.Module([]).code_for_node(result).strip()))
                return result
        return updated

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine,
                                  updated_node: cst.SimpleStatementLine) -> cst.BaseStatement:
        # a guarded call that is a whole statement reads better as an if statement
        if len(updated_node.body) == 1 and isinstance(updated_node.body[0], cst.Expr):
            value = updated_node.body[0].value
            if value in self.ctx.statement_guards:
                inner = cst.SimpleStatementLine([cst.Expr(value.body)], trailing_whitespace=updated_node.trailing_whitespace)
                return cst.If(test=value.test, body=cst.IndentedBlock([inner]), leading_lines=updated_node.leading_lines)
        return updated_node

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        header: list[cst.SimpleStatementLine] = []
        if self.ctx.needs_torch and not self._has_torch:
            header.append(cst.parse_statement("import torch\n"))  # joins the imports
        for module in sorted(self.ctx.imports - self._imported):
            header.append(cst.parse_statement(f"import {module}\n"))
        if self.ctx.needs_device and self._existing is None:
            code = DEVICE_DEFINITION.format(name=self.ctx.device_name, torch=self.ctx.torch)
            blank = [cst.EmptyLine()] if self._imports_end > 0 or header else []
            header.append(cst.parse_statement(code + "\n").with_changes(leading_lines=blank))
        for definition in self.ctx.helpers.values():
            blank = [cst.EmptyLine()] * (2 if self._imports_end > 0 or header else 0)
            header.append(cst.parse_statement(definition).with_changes(leading_lines=blank))
        if not header:
            return updated_node
        body = list(updated_node.body)
        end = self._imports_end
        if end < len(body) and len(body[end].leading_lines) < (2 if self.ctx.helpers else 1):
            body[end] = body[end].with_changes(leading_lines=[cst.EmptyLine()] * (2 if self.ctx.helpers else 1))
        return updated_node.with_changes(body=[*body[:end], *header, *body[end:]])


def _names(module: cst.Module) -> list[cst.Name]:
    class Collect(cst.CSTVisitor):
        def __init__(self) -> None:
            self.names: list[cst.Name] = []

        def visit_Name(self, node: cst.Name) -> None:
            self.names.append(node)

    collector = Collect()
    module.visit(collector)
    return collector.names
