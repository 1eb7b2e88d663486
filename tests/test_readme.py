"""The commands of README.md and docs/*.md run as written.

Every fenced ```bash and ```python block of README.md and of the pages in docs/ is a test. A bash block runs as one
script (``bash -e -o pipefail``), a python block as ``python -`` with the block on stdin, both from the repository
root, with the virtual environment's ``bin`` folder first on ``PATH`` and without the ``TORCHPORT_*`` variables (and
``TRITON_INTERPRET``, which tests/conftest.py sets), so a block sees what a reader's fresh shell sees. It passes when
it exits with 0 within ``TIMEOUT_S``. README blocks run in every test run; the docs pages' blocks (about 100 s
together on a 2-core machine) run under the ``slow`` marker.

Markers, each an HTML comment alone on the line before the opening fence (a rendered page does not show it):

    <!-- readme-test: skip -->   the block is not run: a clone, an install, a server that runs until stopped, a
                                 synopsis with placeholders, a fragment that needs the reader's own model.
                                 A skipped python block must still parse.
    <!-- readme-test: slow -->   the block runs under the ``slow`` marker.

The blocks call the venv's programs as ``.venv/bin/...``. When this suite runs from another virtual environment
(``scripts/test.sh --latest`` uses ``.venv-latest``), that prefix is replaced by the running interpreter's folder.
Relative links between the pages, and their ``#anchors``, are checked too.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 300
MARKER = re.compile(r"^<!--\s*readme-test:\s*(skip|slow)\s*-->$")
FENCE = re.compile(r"^```(bash|python)\s*$")
# The venv whose python runs this suite: its bin folder stands for the blocks' ".venv/bin/".
VENV_BIN = os.path.dirname(os.path.abspath(sys.executable))


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # "skip", "slow" or None
    section: str  # the heading above the block

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's ```bash and ```python blocks, with the marker on the line before each."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, section, i = [], "", 0
    while i < len(lines):
        if lines[i].startswith("#"):
            section = lines[i].lstrip("#").strip()
        fence = FENCE.match(lines[i])
        if fence is None:
            if lines[i].startswith("```"):  # another language: step over the whole block
                i += 1
                while i < len(lines) and not lines[i].startswith("```"):
                    i += 1
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if i == len(lines):
            raise AssertionError(f"{page.relative_to(ROOT)}:{start + 1}: the code block is never closed")
        previous = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
        marker = MARKER.match(previous)
        found.append(Block(page, start + 1, fence.group(1), "\n".join(lines[start + 1:i]) + "\n",
                           marker.group(1) if marker else None, section))
        i += 1
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]


def _params(selected: list[Block]) -> list:
    params = []
    for block in selected:
        slow = block.marker == "slow" or block.page.name != "README.md"
        params.append(pytest.param(block, id=block.name, marks=[pytest.mark.slow] if slow else []))
    return params


def _environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("TORCHPORT_") and key != "TRITON_INTERPRET"}
    env["PATH"] = os.pathsep.join([VENV_BIN, env.get("PATH", "")])
    return env


def _as_written(code: str) -> str:
    if os.path.abspath(ROOT / ".venv" / "bin") == VENV_BIN:
        return code
    return code.replace(".venv/bin/", VENV_BIN + "/")


@pytest.fixture(autouse=True)
def _once_per_suite(request: pytest.FixtureRequest) -> None:
    # scripts/test.sh runs a second pass, --devices npu, on machines with a GPU; these tests need no device of their own
    devices = request.config.getoption("--devices", default="auto")
    if devices != "auto" and "cpu" not in devices.split(","):
        pytest.skip("the README's commands run in the pass that tests the cpu")


@pytest.mark.parametrize("block", _params([b for b in ALL_BLOCKS if b.marker != "skip"]))
def test_block_runs(block: Block) -> None:
    code = _as_written(block.code)
    if block.language == "bash":
        command, stdin = ["bash", "-e", "-o", "pipefail", "-c", code], None
    else:
        command, stdin = [os.path.join(VENV_BIN, "python"), "-"], code
    try:
        done = subprocess.run(command, input=stdin, cwd=ROOT, env=_environment(), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.name} ran longer than {TIMEOUT_S} s:\n{block.code}\n{exc.stdout or ''}{exc.stderr or ''}")
    assert done.returncode == 0, (
        f"{block.name} exited with {done.returncode}:\n{block.code}\n"
        f"--- stdout (end) ---\n{done.stdout[-3000:]}\n--- stderr (end) ---\n{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in ALL_BLOCKS if b.language == "python"])
def test_python_block_parses(block: Block) -> None:
    compile(block.code, block.name, "exec")


def test_try_it_block_is_tested() -> None:
    """The README's "Try it in two minutes" is one block of five commands, and the test runs it."""
    tried = [b for b in ALL_BLOCKS if b.page.name == "README.md" and b.section == "Try it in two minutes"]
    assert len(tried) == 1, f"expected one code block under 'Try it in two minutes', found {len(tried)}"
    commands = [line for line in tried[0].code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert tried[0].marker is None, f"{tried[0].name} is marked {tried[0].marker!r}: it must run in every test run"
    assert len(commands) == 5, f"{tried[0].name} has {len(commands)} commands, not five"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, in_code = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(_anchor(line))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
