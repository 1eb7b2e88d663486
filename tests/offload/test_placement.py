"""Planning: blocks are found, sized and placed without moving anything; impossible budgets name the block."""

from __future__ import annotations

import pytest
import torch
from offload_models import stack, tiny_llama
from torch import nn

import torchport
from torchport.offload import find_blocks
from torchport.offload.placement import place

BLOCK = 17 * 1024  # Stack(width=32): LayerNorm 2x32, up 32x64+64, down 64x32+32 floats, each aligned to 256 bytes


def test_blocks_are_the_largest_list_of_repeated_layers() -> None:
    model = tiny_llama()
    found = find_blocks(model)
    assert found.names == [f"model.layers.{i}" for i in range(4)]
    nbytes = [t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]]
    in_blocks = [p.numel() * p.element_size() for params in found.params for p in params]
    assert found.resident_bytes + sum(in_blocks) == sum(nbytes)
    assert all(size % 256 == 0 and size >= 37120 for size in found.block_bytes())  # aligned layout


def test_blocks_given_by_name_list_or_modulelist() -> None:
    model = stack()
    by_name = find_blocks(model, "layers").names
    assert by_name == find_blocks(model, model.layers).names == find_blocks(model, list(model.layers)[:3]).names + [
        "layers.3", "layers.4", "layers.5"]
    with pytest.raises(ValueError, match="not a submodule.*layers"):
        find_blocks(model, "decoder")
    with pytest.raises(ValueError, match="not a submodule"):
        find_blocks(model, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="no repeated layers"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_shared_weights_stay_resident() -> None:
    model = stack()
    model.layers[1].up = model.layers[0].up  # tied between two blocks
    found = find_blocks(model)
    assert [len(p) for p in found.params][:2] == [4, 4]  # norm and down only
    assert found.resident_bytes > find_blocks(stack()).resident_bytes


def test_plan_moves_nothing_and_fills_the_device_first(device: torch.device) -> None:
    model = stack()
    before = {name: (p.device, p.data_ptr()) for name, p in model.named_parameters()}
    resident = find_blocks(model).resident_bytes
    result = torchport.offload.plan(model, resident + 4 * BLOCK, host_budget=BLOCK, disk_dir="unused",
                                    device=device)
    assert {name: (p.device, p.data_ptr()) for name, p in model.named_parameters()} == before
    tiers = list(result.tiers().values())
    assert tiers == sorted(tiers, key=["device", "host", "disk"].index)
    assert {"device", "host", "disk"} == set(tiers)
    assert result.device_bytes <= result.budget
    assert result.to_dict()["disk_bytes"] == result.tier_bytes("disk")
    assert "layers.5" in str(result)


def test_every_block_resident_when_the_budget_allows() -> None:
    result = place(["a", "b", "c"], [10, 10, 10], 5, 35, prefetch=1, host_budget=None, disk=False, device="x")
    assert result.tiers() == {"a": "device", "b": "device", "c": "device"} and result.buffers == 0


def test_buffers_count_against_the_budget() -> None:
    # 2 buffers of 10 + resident 5 leave room for one resident block at a budget of 35
    result = place(["a", "b", "c", "d"], [10] * 4, 5, 35, prefetch=1, host_budget=None, disk=False, device="x")
    assert list(result.tiers().values()) == ["device", "host", "host", "host"]
    assert result.device_bytes == 5 + 10 + 20


def test_a_budget_below_the_largest_block_names_it() -> None:
    with pytest.raises(ValueError, match=r"largest block, 'big', holds 100 B.*prefetch=0 needs 105 B"):
        place(["a", "big"], [10, 100], 5, 60, prefetch=1, host_budget=None, disk=False, device="x")
    with pytest.raises(ValueError, match="outside the blocks"):
        place(["a"], [10], 50, 20, prefetch=1, host_budget=None, disk=False, device="x")


def test_the_disk_tier_needs_a_folder() -> None:
    with pytest.raises(ValueError, match="pass disk_dir="):
        place(["a", "b", "c"], [10] * 3, 0, 20, prefetch=1, host_budget=10, disk=False, device="x")


def test_plan_rejects_a_budget_too_small_for_the_largest_block_of_a_model() -> None:
    with pytest.raises(ValueError, match=r"'model.layers.0', holds"):
        torchport.offload.plan(tiny_llama(), 20000, device="cpu")
