"""``torchport migrate``: rewrite CUDA-specific source into plain device-agnostic PyTorch.

The result uses ``torch.accelerator``, ``torch.amp``, ``torch.Event`` and ``torch.get_device_module`` and does not
import torchport. Built on libcst, so comments and formatting survive; each idiom is one rule of
:mod:`torchport.migrate.rules`, listed by :func:`list_rules`.

Example:
    >>> from torchport.migrate import migrate_source
    >>> result = migrate_source("import torch\\nx = torch.ones(2).cuda()\\n")
    >>> print(result.code)
    import torch
    <BLANKLINE>
    DEVICE = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    x = torch.ones(2).to(DEVICE)
    <BLANKLINE>
    >>> [change.rule for change in result.changes]
    ['tensor-cuda']
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .registry import Rule, get_rule, list_rules, register_rule
from .transform import Change, Review, Unconverted

__all__ = ["Change", "FileResult", "Review", "Rule", "Unconverted", "get_rule", "list_rules", "migrate_paths",
           "migrate_source", "register_rule"]


@dataclass
class FileResult:
    """What migrating one file gives: the new code, its changes, unconverted sites and sites to review (guards that
    stop the script without a GPU), or why it was skipped."""

    path: str
    original: str = ""
    code: str = ""
    changes: list[Change] = field(default_factory=list)
    unconverted: list[Unconverted] = field(default_factory=list)
    review: list[Review] = field(default_factory=list)
    skipped: str | None = None  # why the file was not migrated (syntax error, not UTF-8, ...)
    written: bool = False

    @property
    def changed(self) -> bool:
        return self.skipped is None and self.code != self.original


def migrate_source(code: str, path: str = "<string>") -> FileResult:
    """Migrate the source of one module; ``path`` only labels the result.

    A syntax error gives a result with ``skipped`` set and the code unchanged.

    Example:
        >>> migrate_source("import torch\\nok = torch.cuda.is_available()\\n").code.splitlines()[-1]
        'ok = torch.accelerator.is_available()'
    """
    import libcst as cst
    from libcst.metadata import MetadataWrapper

    from . import rules  # noqa: F401  (registers the built-in rules)
    from .transform import TRIGGERS, MigrationTransformer

    result = FileResult(path, original=code, code=code)
    if not TRIGGERS.search(code):  # nothing any rule looks at: only the syntax check, which Python does fast
        error = _syntax_error(code)
        if error is not None:
            result.skipped = f"syntax error: {error}"
        return result
    try:
        module = cst.parse_module(code)
    except cst.ParserSyntaxError as exc:
        result.skipped = f"syntax error: {_syntax_error(code) or exc.message}"
        return result
    wrapper = MetadataWrapper(module)
    transformer = MigrationTransformer(wrapper.module, path)
    new_code = wrapper.visit(transformer).code
    result.changes, result.unconverted, result.review = transformer.changes, transformer.unconverted, transformer.review
    if new_code != code:
        try:
            ast.parse(code)
        except SyntaxError:
            pass  # libcst accepts some syntax this Python does not; nothing to compare against
        else:
            try:
                ast.parse(new_code)
            except SyntaxError as exc:  # a bug in a rule: say so rather than write broken code
                result.skipped = f"the migrated code does not parse ({exc.msg} at line {exc.lineno}); left as is"
                return result
    result.code = new_code
    return result


def _syntax_error(code: str) -> str | None:
    # Python's own message names the line and column reliably; libcst's positions point at the statement start
    try:
        ast.parse(code)
    except SyntaxError as exc:
        return f"{exc.msg} (line {exc.lineno}, column {exc.offset})"
    return None


def migrate_paths(paths: Iterable[str | os.PathLike[str]], *, excludes: Iterable[str] = (),
                  write: bool = False) -> list[FileResult]:
    """Migrate every file :func:`~torchport.migrate.walk.iter_python_files` finds; with ``write``, save changes.

    Files that are not UTF-8 or do not parse are skipped with the reason in ``FileResult.skipped``. Only files
    that change are written. A missing path raises FileNotFoundError naming it, before anything is read.

    Example:
        >>> [r.path for r in migrate_paths(["train.py"]) if r.changed]
        ['train.py']
    """
    from .walk import iter_python_files

    files = list(iter_python_files(paths, excludes))
    results = []
    for path in files:
        label = path.as_posix()
        try:
            data = path.read_bytes()
        except OSError as exc:
            results.append(FileResult(label, skipped=f"cannot read: {exc.strerror or exc}"))
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            results.append(FileResult(label, skipped=f"not UTF-8 (byte {data[exc.start]:#04x} at offset {exc.start})"))
            continue
        result = migrate_source(text, label)
        if write and result.changed:
            _write(path, result.code)
            result.written = True
        results.append(result)
    return results


def _write(path: Path, code: str) -> None:
    # write next to the file, then replace it, so an interrupted run never leaves half a file
    temporary = path.with_name(f".{path.name}.torchport-migrate")
    with open(temporary, "w", encoding="utf-8", newline="") as handle:
        handle.write(code)
    os.chmod(temporary, path.stat().st_mode & 0o7777)
    os.replace(temporary, path)
