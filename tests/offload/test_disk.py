"""The disk tier: safetensors files with checksums, verified when opened, read through a memory map."""

from __future__ import annotations

import json
import os

import pytest
import torch

from torchport.offload import open_tier, write_tier
from torchport.offload.disk import MANIFEST


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"up.weight": torch.randn(64, 32, generator=g), "up.bias": torch.randn(64, generator=g).bfloat16(),
            "step": torch.tensor(7, dtype=torch.int64), "mask": torch.rand(5, generator=g) > 0.5}


def test_round_trip_is_exact_and_files_are_plain_safetensors(tmp_path) -> None:
    from safetensors.torch import load_file

    tensors = _tensors()
    written = write_tier(str(tmp_path), [("model.layers.0", tensors), ("model.layers.1", {"w": tensors["up.weight"]})],
                         progress=False)
    assert [os.path.basename(p) for p in written] == ["model.layers.0.safetensors", "model.layers.1.safetensors",
                                                      MANIFEST]
    tier = open_tier(str(tmp_path))
    for key, value in tensors.items():
        got = tier["model.layers.0"].tensor(key)
        assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value)
    assert torch.equal(tier["model.layers.1"].tensor("w"), tensors["up.weight"])
    again = load_file(written[0])  # the safetensors library reads the same tensors
    assert all(torch.equal(again[key], value) for key, value in tensors.items())


def test_tensors_are_views_of_the_file_not_copies(tmp_path) -> None:
    write_tier(str(tmp_path), [("b", _tensors())], progress=False)
    block = open_tier(str(tmp_path))["b"]
    weight = block.tensor("up.weight")
    assert block.contains(weight.data_ptr())
    weight.zero_()  # a private map: writes never reach the file
    assert not torch.equal(open_tier(str(tmp_path))["b"].tensor("up.weight"), weight)


def test_a_corrupted_file_is_detected(tmp_path) -> None:
    write_tier(str(tmp_path), [("model.layers.0", _tensors())], progress=False)
    path = tmp_path / "model.layers.0.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the weights
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model.layers.0.safetensors.*block 'model.layers.0'.*corrupted.*BLAKE2b"):
        open_tier(str(tmp_path))


def test_truncated_missing_and_foreign_tiers_are_refused(tmp_path) -> None:
    write_tier(str(tmp_path), [("a", _tensors()), ("b", _tensors())], progress=False)
    path = tmp_path / "a.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        open_tier(str(tmp_path))
    os.remove(path)
    with pytest.raises(ValueError, match="is missing"):
        open_tier(str(tmp_path))
    (tmp_path / MANIFEST).write_text(json.dumps({"something": "else"}))
    with pytest.raises(ValueError, match="not a torchport disk-tier manifest"):
        open_tier(str(tmp_path))


def test_a_failed_write_removes_what_it_wrote(tmp_path, monkeypatch) -> None:
    import safetensors.torch

    calls = []

    def failing(tensors, metadata=None):  # noqa: ANN001, ANN202
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return original(tensors, metadata)

    original = safetensors.torch.save
    monkeypatch.setattr(safetensors.torch, "save", failing)
    with pytest.raises(ValueError, match="filled up"):
        write_tier(str(tmp_path), [("a", _tensors()), ("b", _tensors())], progress=False)
    assert os.listdir(tmp_path) == []
