"""measure_stack: sizes of each tier and measured bandwidths, with what does not apply left as None."""

from __future__ import annotations

import os

import pytest
import torch

from torchport.backends import get_backend
from torchport.offload import measure_stack


def test_measures_every_tier(device: torch.device, tmp_path) -> None:
    stack = measure_stack(device, tmp_path, size=2**20, iterations=1)
    assert stack["size"] == 2**20 and stack["device"]["device"] == str(device)
    assert stack["host"]["total"] > 0 and stack["disk"]["free"] > 0
    assert stack["bandwidth"]["disk_read"] > 0
    backend = get_backend(device.type)
    if device.type == "cpu":
        assert stack["bandwidth"]["pageable_h2d"] is None and any("no accelerator" in n for n in stack["notes"])
    else:
        assert stack["bandwidth"]["pageable_h2d"] > 0
        assert (stack["bandwidth"]["pinned_h2d"] is not None) == backend.pins_memory
    assert os.listdir(tmp_path) == []  # the probe file is removed


def test_refuses_tiny_measurements() -> None:
    with pytest.raises(ValueError, match="at least 1 MiB"):
        measure_stack("cpu", size=1000)
