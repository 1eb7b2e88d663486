"""The Migrate tab's functions: an uploaded or pasted file migrated, its diff, its report and the download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchport.ui import migrate

CUDA_SCRIPT = """import torch

model = Net().cuda()
x = torch.ones(2, device="cuda")
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("step")
"""


def test_read_upload_gives_the_name_and_exact_text(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_bytes(b"import torch\r\nx = 1\r\n")
    assert migrate.read_upload(str(path)) == ("train.py", "import torch\r\nx = 1\r\n")


def test_a_file_that_is_not_utf8_is_refused_with_the_bad_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin.py"
    path.write_bytes("# café\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.py is not UTF-8 text \(byte 0xe9 at offset 5\)"):
        migrate.read_upload(str(path))


def test_a_huge_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(migrate, "MAX_BYTES", 10)
    path = tmp_path / "big.py"
    path.write_text("x = 1\n" * 10)
    with pytest.raises(ValueError, match="big.py is 0.0 MiB; the page takes Python files up to 0 MiB"):
        migrate.read_upload(str(path))


def test_a_cuda_script_gives_the_diff_and_report_of_torchport_migrate() -> None:
    result = migrate.migrate_text(CUDA_SCRIPT, "train.py")
    assert result.changed
    diff = migrate.diff_text(result)
    assert diff.startswith("--- a/train.py\n+++ b/train.py\n")
    assert "-model = Net().cuda()\n" in diff and "+model = Net().to(DEVICE)\n" in diff
    rows = migrate.change_rows(result)
    assert ["train.py:3:9", "tensor-cuda", "Net().cuda()", "Net().to(DEVICE)"] in rows
    left = migrate.unconverted_rows(result)
    assert len(left) == 1 and left[0][0] == "train.py:6:1" and left[0][1] == "NVTX range"
    text = migrate.summary(result)
    assert text.startswith(f"### `train.py`: {len(rows)} sites rewritten\nRules: `tensor-cuda` x1")
    assert text.endswith("1 site left as written: port it by hand (see below).")


def test_diff_html_colours_lines_and_escapes_the_code() -> None:
    out = migrate.diff_html("--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-if a < b:\n+if a <b> b:\n ctx\n")
    assert out.startswith('<pre class="tp-diff">') and out.endswith("\n</pre>")
    assert '<span class="tp-file">--- a/x.py</span>' in out
    assert '<span class="tp-hunk">@@ -1 +1 @@</span>' in out
    assert '<span class="tp-del">-if a &lt; b:</span>' in out and '<span class="tp-add">+if a &lt;b&gt; b:</span>' in out
    assert "\n ctx\n" in out
    assert "no change" in migrate.diff_html("")


def test_unchanged_and_unparsable_sources_say_so() -> None:
    same = migrate.migrate_text("x = 1\n")
    assert not same.changed and migrate.diff_text(same) == ""
    assert migrate.summary(same) == "### `pasted.py`: nothing to change\nNothing is left to port by hand."
    broken = migrate.migrate_text("def f(:\n", "bad.py")
    assert broken.skipped and migrate.summary(broken).startswith("### `bad.py` was not migrated\nsyntax error: ")


def test_the_uploaded_text_is_used_while_the_editor_shows_it() -> None:
    upload = ("train.py", "import torch\r\nx = 1\r\n")
    assert migrate.source_of("import torch\nx = 1", upload) == upload[::-1]  # editor: LF, no final newline
    assert migrate.source_of("import torch\nx = 2", upload) == ("import torch\nx = 2", "train.py")
    assert migrate.source_of("y = 1", None) == ("y = 1", "pasted.py")


def test_outputs_are_the_rewritten_file_under_its_name_and_the_json_report(tmp_path: Path) -> None:
    result = migrate.migrate_text(CUDA_SCRIPT, "train.py")
    code_path, report_path = migrate.write_outputs(result, str(tmp_path))
    assert Path(code_path).name == "train.py" and Path(code_path).read_text() == result.code
    assert Path(report_path).name == "train.migrate.json"
    report = json.loads(Path(report_path).read_text())
    assert report["changed"] == ["train.py"] and report["counts"]["rules"]["tensor-cuda"] == 1
    again = migrate.write_outputs(result, str(tmp_path))[0]
    assert again != code_path  # each run has its own folder: an earlier download stays what it was
