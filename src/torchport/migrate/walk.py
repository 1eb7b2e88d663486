"""Which files ``torchport migrate`` looks at: the named files, and the ``.py`` files under the named directories.

Directories are walked without following symbolic links (a link to a file is skipped too: it points out of the
tree, or at a file the walk reaches anyway), skipping hidden directories, virtual environments (any directory with
a ``pyvenv.cfg``), ``__pycache__``, ``site-packages`` and ``node_modules``, and whatever matches an exclude glob.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["SKIPPED_DIRS", "iter_python_files", "is_excluded"]

SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "node_modules"})


def is_excluded(relative: Path, excludes: Iterable[str]) -> bool:
    """Whether ``relative`` (a path under a walked directory) or any of its parts matches a glob.

    Example:
        >>> is_excluded(Path("tests/test_x.py"), ["tests"]), is_excluded(Path("a/b.py"), ["*/b.py"])
        (True, True)
    """
    text, parts = relative.as_posix(), relative.parts
    return any(fnmatch.fnmatch(text, glob) or any(fnmatch.fnmatch(part, glob) for part in parts) for glob in excludes)


def _skip_directory(path: Path) -> bool:
    return path.name.startswith(".") or path.name in SKIPPED_DIRS or (path / "pyvenv.cfg").exists()


def iter_python_files(paths: Iterable[str | os.PathLike[str]], excludes: Iterable[str] = ()) -> Iterator[Path]:
    """Every file to migrate, each once, in a stable order.

    A file named explicitly is taken whatever its suffix, unless an exclude glob matches it. A missing path raises
    FileNotFoundError naming it.

    Example:
        >>> list(iter_python_files(["src/torchport/migrate"], excludes=["rules.py"]))[:1]
        [PosixPath('src/torchport/migrate/__init__.py')]
    """
    excludes = list(excludes)
    seen: set[Path] = set()
    for given in map(Path, paths):
        if not given.exists() and not given.is_symlink():
            raise FileNotFoundError(f"{given}: no such file or directory")
        if given.is_file():
            if not is_excluded(Path(given.name), excludes) and not is_excluded(given, excludes):
                yield from _once(given, seen)
            continue
        for root, dirs, files in os.walk(given, followlinks=False):
            here = Path(root)
            dirs[:] = sorted(d for d in dirs if not _skip_directory(here / d)
                             and not is_excluded((here / d).relative_to(given), excludes))
            for name in sorted(files):
                path = here / name
                if name.endswith(".py") and not path.is_symlink() and not is_excluded(path.relative_to(given),
                                                                                       excludes):
                    yield from _once(path, seen)


def _once(path: Path, seen: set[Path]) -> Iterator[Path]:
    key = path.resolve()
    if key not in seen:
        seen.add(key)
        yield path
