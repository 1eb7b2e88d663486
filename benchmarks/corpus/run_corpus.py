"""`torchport migrate` over the sources of public PyPI packages written for CUDA.

Downloads pinned releases (wheels of pure-Python packages: their sources as published, without building anything)
with pip into a cache folder, runs the codemod on every ``.py`` file in memory (nothing is written), migrates each
changed file a second time, and prints one row per package:

- files, rewritten sites, sites left as written (with their reasons, summed over the corpus), sites to review,
- parse failures: a file that parses before but not after migration (must be 0),
- non-idempotent files: a second migration changes the first one's output (must be 0),
- files/s: files migrated per second of codemod time (downloads and unpacking not counted).

Run from the repository root (the cache is ``benchmarks/corpus/.cache``, ignored by git; about 40 MB)::

    PYTHONPATH=src python benchmarks/corpus/run_corpus.py [--only NAME ...] [--json benchmarks/results/corpus.json]

Exit status 1 when a parse failure, a non-idempotent file or a crash of the codemod was found.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import subprocess
import sys
import time
import traceback
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"

# (distribution, pinned version, style): pure-Python wheels with CUDA-specific PyTorch code, of varied kinds.
PACKAGES = [
    ("accelerate", "1.2.1", "trainer tooling"),
    ("pytorch-lightning", "2.4.0", "trainer"),
    ("pytorch-ignite", "0.5.1", "trainer"),
    ("mmengine", "0.10.5", "trainer"),
    ("timm", "1.0.12", "vision models"),
    ("kornia", "0.7.4", "vision ops"),
    ("lpips", "0.1.4", "vision metric"),
    ("diffusers", "0.31.0", "diffusion"),
    ("k-diffusion", "0.1.1.post1", "diffusion"),
    ("denoising-diffusion-pytorch", "2.1.1", "diffusion"),
    ("ultralytics", "8.3.40", "detection"),
    ("yolov5", "7.0.14", "detection"),
    ("mmdet", "3.3.0", "detection"),
    ("stable-baselines3", "2.4.0", "reinforcement learning"),
    ("tianshou", "1.1.0", "reinforcement learning"),
    ("speechbrain", "1.0.2", "audio"),
    ("asteroid", "0.7.0", "audio"),
    ("peft", "0.13.2", "LLM tooling"),
    ("trl", "0.12.1", "LLM tooling"),
    ("litgpt", "0.5.3", "LLM tooling"),
    ("torchtune", "0.4.0", "LLM tooling"),
    ("optimum", "1.23.3", "inference"),
    ("sentence-transformers", "3.3.1", "inference"),
    ("torch-geometric", "2.6.1", "graph learning"),
]


@dataclass
class PackageResult:
    name: str
    version: str
    style: str
    files: int = 0
    changed: int = 0
    rewritten: int = 0
    left: int = 0
    review: int = 0
    skipped: int = 0  # not UTF-8, or not valid syntax for this Python before migration
    parse_failures: list[str] = field(default_factory=list)
    non_idempotent: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    left_reasons: dict[str, int] = field(default_factory=dict)


def download(name: str, version: str) -> Path:
    """The wheel of ``name==version`` in the cache, fetched by pip when missing."""
    folder = CACHE / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    stem = name.replace("-", "_").lower()
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-")]
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--dest", str(folder), f"{name}=={version}"], check=True)
        found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-")]
    if not found:
        raise FileNotFoundError(f"pip downloaded no wheel named {stem}-{version}-*.whl into {folder}")
    return found[0]


def sources(wheel: Path) -> list[tuple[str, str | bytes]]:
    """(path, text) of every .py file in the wheel; bytes where the file is not UTF-8."""
    out: list[tuple[str, str | bytes]] = []
    with zipfile.ZipFile(wheel) as archive:
        for member in sorted(archive.namelist()):
            if member.endswith(".py"):
                data = archive.read(member)
                try:
                    out.append((member, data.decode("utf-8")))
                except UnicodeDecodeError:
                    out.append((member, data))
    return out


def migrate_package(name: str, version: str, style: str) -> PackageResult:
    from torchport.migrate import migrate_source

    result = PackageResult(name, version, style)
    reasons: collections.Counter[str] = collections.Counter()
    for path, text in sources(download(name, version)):
        result.files += 1
        if isinstance(text, bytes):
            result.skipped += 1
            continue
        start = time.perf_counter()
        try:
            first = migrate_source(text, path)
            second = migrate_source(first.code, path) if first.code != text else None
        except Exception:  # noqa: BLE001 - a crash of the codemod is a finding, with its traceback
            result.crashes.append(f"{path}: {traceback.format_exc(limit=-3).strip().splitlines()[-1]}")
            continue
        finally:
            result.seconds += time.perf_counter() - start
        if first.skipped:
            if first.skipped.startswith("the migrated code does not parse"):
                result.parse_failures.append(f"{path}: {first.skipped}")
            else:
                result.skipped += 1
            continue
        if first.code != text:
            result.changed += 1
            try:
                ast.parse(first.code)
            except SyntaxError as exc:
                result.parse_failures.append(f"{path}: {exc.msg} at line {exc.lineno}")
            if second is not None and (second.skipped or second.code != first.code):
                result.non_idempotent.append(path)
        result.rewritten += len(first.changes)
        result.left += len(first.unconverted)
        result.review += len(first.review)
        reasons.update(site.what for site in first.unconverted)
    result.left_reasons = dict(reasons.most_common())
    return result


def table(results: list[PackageResult]) -> str:
    head = ("| package | style | files | changed | rewritten sites | left (reasons below) | to review | skipped "
            "| parse failures | non-idempotent | crashes | files/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    total = PackageResult("total", "", "")
    for r in results:
        lines.append(f"| {r.name} {r.version} | {r.style} | {r.files} | {r.changed} | {r.rewritten} | {r.left} | "
                     f"{r.review} | {r.skipped} | {len(r.parse_failures)} | {len(r.non_idempotent)} | "
                     f"{len(r.crashes)} | {r.files / max(r.seconds, 1e-9):.0f} |")
        for name in ("files", "changed", "rewritten", "left", "review", "skipped", "seconds"):
            setattr(total, name, getattr(total, name) + getattr(r, name))
        total.parse_failures += r.parse_failures
        total.non_idempotent += r.non_idempotent
        total.crashes += r.crashes
    lines.append(f"| **{len(results)} packages** | | {total.files} | {total.changed} | {total.rewritten} | "
                 f"{total.left} | {total.review} | {total.skipped} | {len(total.parse_failures)} | "
                 f"{len(total.non_idempotent)} | {len(total.crashes)} | {total.files / max(total.seconds, 1e-9):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="just these distributions")
    parser.add_argument("--json", type=Path, default=HERE.parent / "results" / "corpus.json",
                        help="where to write every figure and finding (default: %(default)s)")
    args = parser.parse_args(argv)
    chosen = [p for p in PACKAGES if not args.only or p[0] in args.only]
    unknown = set(args.only or ()) - {p[0] for p in PACKAGES}
    if unknown:
        parser.error(f"not in the corpus: {', '.join(sorted(unknown))}; known: {', '.join(p[0] for p in PACKAGES)}")
    results = []
    for name, version, style in chosen:
        results.append(migrate_package(name, version, style))
        r = results[-1]
        print(f"{name} {version}: {r.files} files, {r.rewritten} rewritten, {r.left} left, "
              f"{len(r.parse_failures)} parse failures, {len(r.non_idempotent)} non-idempotent, "
              f"{len(r.crashes)} crashes, {r.seconds:.1f} s", file=sys.stderr, flush=True)
    print(table(results))
    reasons: collections.Counter[str] = collections.Counter()
    for r in results:
        reasons.update(r.left_reasons)
    print("\n| left as written | sites |\n|---|---|")
    for what, count in reasons.most_common():
        print(f"| {what} | {count} |")
    findings = [(r.name, kind, item) for r in results
                for kind, items in (("parse failure", r.parse_failures), ("non-idempotent", r.non_idempotent),
                                    ("crash", r.crashes)) for item in items]
    for name, kind, item in findings:
        print(f"{kind}: {name}: {item}", file=sys.stderr)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
