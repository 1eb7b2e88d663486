import pytest
import torch
from safetensors.torch import save_file

import torchport


@pytest.fixture
def checkpoint(tmp_path):
    tensors = {"w": torch.randn(17, 5), "b": torch.arange(7, dtype=torch.int64), "h": torch.randn(3).half()}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_round_trip_to_device(device: torch.device, checkpoint) -> None:
    path, tensors = checkpoint
    loaded = torchport.load_safetensors(path, device=device)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].device == device and loaded[name].dtype == t.dtype
        assert torch.equal(loaded[name].cpu(), t)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        torchport.load_safetensors(tmp_path / "nope.safetensors", device="cpu")


def test_directory(tmp_path) -> None:
    with pytest.raises(IsADirectoryError, match="is a directory"):
        torchport.load_safetensors(tmp_path, device="cpu")


@pytest.mark.parametrize("keep", [0, 5, 40, -10])
def test_truncated_file(checkpoint, keep: int) -> None:
    path, _ = checkpoint
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(ValueError, match="not a valid safetensors file.*truncated or corrupt"):
        torchport.load_safetensors(path, device="cpu")


def test_bad_device(checkpoint) -> None:
    path, _ = checkpoint
    with pytest.raises(ValueError, match="is not a device type"):
        torchport.load_safetensors(path, device="gpu")
