"""`torchport stack`: the memory tiers as a table or JSON; bad sizes are usage errors."""

from __future__ import annotations

import json

from torchport.cli.main import main


def test_json(capsys, tmp_path) -> None:
    assert main(["stack", "--device", "cpu", "--disk-dir", str(tmp_path), "--size", "1MiB", "--iterations", "1",
                 "--json"]) == 0
    stack = json.loads(capsys.readouterr().out)
    assert stack["size"] == 2**20 and stack["bandwidth"]["disk_read"] > 0


def test_table_names_the_tiers_and_the_size(capsys) -> None:
    assert main(["stack", "--device", "cpu", "--size", "1MiB", "--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "device" in out and "host RAM" in out and "disk" in out and "1.00 MiB" in out


def test_bad_size_is_a_usage_error(capsys) -> None:
    assert main(["stack", "--size", "lots"]) == 2
    assert "--size='lots'" in capsys.readouterr().err
