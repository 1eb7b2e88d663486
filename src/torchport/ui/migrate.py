"""The Migrate tab: paste or upload a Python file, see the diff and the report ``torchport migrate`` would print
(:func:`torchport.migrate.migrate_source`, :mod:`torchport.migrate.report`), and download the rewritten file."""

from __future__ import annotations

import html
import os
import tempfile
from typing import Any

from ..migrate import FileResult, migrate_source
from .jobs import done, failed

__all__ = ["CHANGE_HEADERS", "MAX_BYTES", "PASTED", "UNCONVERTED_HEADERS", "change_rows", "diff_html", "diff_text",
           "migrate_text",
           "read_upload", "source_of", "summary", "tab", "unconverted_rows", "write_outputs"]

PASTED = "pasted.py"
MAX_BYTES = 4 * 2**20  # a larger "source file" is generated or data; torchport migrate on the command line takes it
CHANGE_HEADERS = ["site", "rule", "before", "after"]
UNCONVERTED_HEADERS = ["site", "what", "hint"]


def read_upload(path: str) -> tuple[str, str]:
    """The name and text of an uploaded file.

    Raises:
        ValueError: the file is larger than :data:`MAX_BYTES` or is not UTF-8 text (the message names the first
            bad byte), as ``torchport migrate`` reads Python source in UTF-8.

    Example:
        >>> read_upload("train.py")
        ('train.py', 'import torch\\n...')
    """
    name = os.path.basename(path)
    size = os.path.getsize(path)
    if size > MAX_BYTES:
        raise ValueError(f"{name} is {size / 2**20:.1f} MiB; the page takes Python files up to "
                         f"{MAX_BYTES // 2**20} MiB (run `torchport migrate {name}` for larger ones)")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return name, data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); "
                         "upload a Python source file saved as UTF-8") from exc


def source_of(editor: str, upload: tuple[str, str] | None) -> tuple[str, str]:
    """The source to migrate and its name: the uploaded file's exact text while the editor still shows it (the
    editor drops a final newline and turns CRLF into LF), else the editor's text, under the uploaded name if any.

    Example:
        >>> source_of("x = 1", ("a.py", "x = 1\\n"))
        ('x = 1\\n', 'a.py')
    """
    if upload is None:
        return editor, PASTED
    name, text = upload
    same = editor.replace("\r\n", "\n").rstrip("\n") == text.replace("\r\n", "\n").rstrip("\n")
    return (text if same else editor), name


def migrate_text(code: str, name: str = PASTED) -> FileResult:
    """Migrate one file's source; ``name`` labels the diff and the report.

    Example:
        >>> migrate_text("import torch\\nx = torch.ones(2).cuda()\\n").changed
        True
    """
    return migrate_source(code, name or PASTED)


def diff_text(result: FileResult) -> str:
    """The unified diff ``torchport migrate`` prints for this file; empty when nothing changes.

    Example:
        >>> diff_text(migrate_text("import torch\\nx = torch.ones(2).cuda()\\n", "a.py")).splitlines()[0]
        '--- a/a.py'
    """
    from ..migrate.report import render_diff

    return render_diff([result])


def diff_html(diff: str) -> str:
    """A unified diff as HTML: added lines green, removed lines red, hunk headers blue (text escaped).

    Example:
        >>> diff_html("+x = 1\\n")
        '<pre class="tp-diff"><span class="tp-add">+x = 1</span>\\n</pre>'
    """
    if not diff:
        return '<pre class="tp-diff tp-empty">no change</pre>'
    lines = []
    for line in diff.splitlines():
        kind = ("tp-file" if line.startswith(("+++", "---")) else "tp-add" if line.startswith("+")
                else "tp-del" if line.startswith("-") else "tp-hunk" if line.startswith("@@") else None)
        text = html.escape(line)
        lines.append(f'<span class="{kind}">{text}</span>' if kind else text)
    return '<pre class="tp-diff">' + "\n".join(lines) + "\n</pre>"


def _report(result: FileResult) -> dict[str, Any]:
    from ..migrate.report import to_dict

    return to_dict([result])


def change_rows(result: FileResult) -> list[list[str]]:
    """One row per rewritten site: ``path:line:col``, rule, before, after.

    Example:
        >>> change_rows(migrate_text("import torch\\nx = torch.ones(2).cuda()\\n"))[0][1]
        'tensor-cuda'
    """
    return [[f"{c['path']}:{c['line']}:{c['col']}", c["rule"], c["before"], c["after"]]
            for c in _report(result)["changes"]]


def unconverted_rows(result: FileResult) -> list[list[str]]:
    """One row per site left as written (to port by hand): ``path:line:col``, what it is, a hint.

    Example:
        >>> unconverted_rows(migrate_text("import torch\\ntorch.cuda.nvtx.range_push('a')\\n"))[0][:2]
        ['pasted.py:2:1', 'NVTX range']
    """
    return [[f"{u['path']}:{u['line']}:{u['col']}", u["what"], u["hint"]] for u in _report(result)["unconverted"]]


def summary(result: FileResult) -> str:
    """Markdown: whether the file was migrated, what changed per rule, and what is left to port by hand.

    Example:
        >>> summary(migrate_text("x = 1\\n"))
        '### `pasted.py`: nothing to change\\n...'
    """
    if result.skipped:
        return f"### `{result.path}` was not migrated\n{result.skipped}"
    report = _report(result)
    left = len(report["unconverted"])
    tail = (f"{left} site{'s' if left != 1 else ''} left as written: port {'them' if left != 1 else 'it'} by hand "
            "(see below)." if left else "Nothing is left to port by hand.")
    if not result.changed:
        return f"### `{result.path}`: nothing to change\n{tail}"
    rules = ", ".join(f"`{rule}` x{count}" for rule, count in report["counts"]["rules"].items())
    sites = len(report["changes"])
    return f"### `{result.path}`: {sites} site{'s' if sites != 1 else ''} rewritten\nRules: {rules}. {tail}"


def write_outputs(result: FileResult, folder: str) -> tuple[str, str]:
    """Write the migrated file (under its own name) and the JSON report into a new folder under ``folder``;
    returns both paths.

    Example:
        >>> write_outputs(migrate_text(code, "train.py"), "/tmp")
        ('/tmp/migrate-x1y2/train.py', '/tmp/migrate-x1y2/train.migrate.json')
    """
    from ..migrate.report import render_json

    where = tempfile.mkdtemp(prefix="migrate-", dir=folder)
    name = os.path.basename(result.path) or PASTED
    code_path = os.path.join(where, name)
    with open(code_path, "w", encoding="utf-8", newline="") as f:
        f.write(result.code)
    report_path = os.path.join(where, f"{os.path.splitext(name)[0]}.migrate.json")
    with open(report_path, "w", encoding="utf-8") as f:
        f.write(render_json([result]) + "\n")
    return code_path, report_path


def tab(folder: str) -> None:
    """Build the Migrate tab inside the current ``gr.Blocks``; downloads are written under ``folder``.

    Example:
        >>> with gr.Blocks() as app:
        ...     tab(tempfile.mkdtemp())
    """
    import gradio as gr

    gr.Markdown("Rewrite CUDA-specific source into device-agnostic PyTorch (`torchport migrate`): the diff, the "
                "report, and the rewritten file to download. Nothing on disk is changed.")
    uploaded = gr.State(None)  # (name, text) of the last upload: its exact text, which the editor may not keep
    with gr.Row():
        with gr.Column(scale=3):
            source = gr.Code(language="python", label="source (paste here, or upload a file)", interactive=True,
                             lines=14, max_lines=30, elem_id="migrate-source")
        with gr.Column(scale=1):
            upload = gr.File(label="upload a .py file", file_types=[".py"], type="filepath",
                             elem_id="migrate-upload")
            start = gr.Button("Migrate", variant="primary", elem_id="migrate-run")
    result_md = gr.Markdown(elem_id="migrate-summary")
    diff = gr.HTML(elem_id="migrate-diff", padding=False)
    with gr.Row():
        download_code = gr.DownloadButton("Download the migrated file", visible=False, elem_id="migrate-download")
        download_report = gr.DownloadButton("Download the report (JSON)", visible=False)
    changes = gr.Dataframe(headers=CHANGE_HEADERS, interactive=False, wrap=True, label="rewritten sites")
    unconverted = gr.Dataframe(headers=UNCONVERTED_HEADERS, interactive=False, wrap=True,
                               label="left as written: port by hand")
    with gr.Accordion("migrated file", open=False):
        migrated = gr.Code(language="python", interactive=False, label="migrated source")

    outputs = [result_md, diff, download_code, download_report, changes, unconverted, migrated]

    def cleared(message: Any) -> tuple[Any, ...]:
        return (message, "", gr.DownloadButton(visible=False), gr.DownloadButton(visible=False), None, None, "")

    def show(code: str, upload: tuple[str, str] | None) -> tuple[Any, ...]:
        if not code.strip():
            return cleared(failed("paste Python source or upload a .py file first"))
        result = migrate_text(*source_of(code, upload))
        code_path, report_path = write_outputs(result, folder)
        return (failed(f"{result.path} was not migrated: {result.skipped}") if result.skipped
                else done(summary(result)), diff_html(diff_text(result)),
                gr.DownloadButton(value=code_path, visible=result.changed),
                gr.DownloadButton(value=report_path, visible=result.skipped is None), change_rows(result),
                unconverted_rows(result), result.code)

    def on_upload(path: str | None) -> tuple[Any, ...]:
        try:
            name, text = read_upload(path)
        except (ValueError, OSError) as exc:  # not UTF-8, too large, gone
            return (gr.skip(), None, *cleared(failed(str(exc))))
        return (text, (name, text), *show(text, (name, text)))

    upload.upload(on_upload, inputs=upload, outputs=[source, uploaded, *outputs])
    upload.clear(lambda: None, outputs=uploaded, queue=False)
    start.click(lambda code, up: show(code or "", up), inputs=[source, uploaded], outputs=outputs)
