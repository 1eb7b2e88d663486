"""The disk tier is read from its files on every forward: the process keeps no mapping of the pages between
forwards, and evict_disk_tier makes the next forward read the disk (checked with mincore)."""

from __future__ import annotations

import os

import pytest
import torch
from offload_models import stack

import torchport
from torchport.offload import evict_disk_tier, find_blocks, placement
from torchport.offload.disk import evict

BLOCK = 17 * 1024


def _on_disk(device: torch.device, tmp_path) -> torch.nn.Module:  # noqa: ANN001
    model = stack()
    budget = find_blocks(model).resident_bytes + 3 * BLOCK  # two slots and a block: the others all on disk
    torchport.offload(model, budget, host_budget=0, disk_dir=tmp_path, device=device, progress=False)
    assert list(placement(model).values()).count("disk") >= 3
    return model


def _disk_blocks(model: torch.nn.Module):  # noqa: ANN202
    return [b.disk for b in model._torchport_offload.offloaded]


def _forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).cpu()


def test_each_forward_reads_the_files_again(device: torch.device, tmp_path) -> None:
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    model = _on_disk(device, tmp_path)
    want = _forward(model, ids)
    assert torch.equal(_forward(model, ids), want)
    last = _disk_blocks(model)[-1]  # read during the same forward, never fetched ahead by the previous one
    start, end, _, _ = last.entries["up.weight"]
    with open(last.path, "r+b") as f:
        f.seek(start)
        original = f.read(end - start)
        f.seek(start)
        f.write(bytes(end - start))  # zero the weight in the file itself
    assert not torch.equal(_forward(model, ids), want)  # the forward saw the file's new bytes
    with open(last.path, "r+b") as f:
        f.seek(start)
        f.write(original)
    assert torch.equal(_forward(model, ids), want)


def test_a_forward_leaves_no_page_mapped_and_eviction_is_verified(device: torch.device, tmp_path) -> None:
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("posix_fadvise is not available on this OS")
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    model = _on_disk(device, tmp_path)
    want = _forward(model, ids)
    blocks = _disk_blocks(model)
    if any(b.cached_bytes() is None for b in blocks):
        pytest.skip("mincore cannot report the page cache here")
    model._torchport_offload.reset()  # reads fetched ahead for the next forward are finished
    for block in blocks:
        fd = os.open(block.path, os.O_RDONLY)
        try:  # the page cache alone, without unmapping: only pages no process maps are dropped
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    assert sum(b.cached_bytes() for b in blocks) == 0  # so the forward kept none of them mapped
    report = evict_disk_tier(model)
    assert report["verified"] and report["cached_bytes"] == 0 and report["bytes"] == sum(b.data.numel()
                                                                                          for b in blocks)
    assert torch.equal(_forward(model, ids), want)  # read back from the disk


def test_evict_reports_pages_a_reader_still_maps(tmp_path) -> None:
    from torchport.offload import open_tier, write_tier

    write_tier(str(tmp_path), [("b", {"w": torch.randn(4096)})], progress=False)
    block = open_tier(str(tmp_path))["b"]
    if block.cached_bytes() is None:
        pytest.skip("mincore cannot report the page cache here")
    assert block.cached_bytes() > 0  # just written and checksummed
    report = evict([block])
    assert report == {"bytes": block.data.numel(), "cached_bytes": 0, "verified": True, "method": report["method"]}
    torch.frombuffer(bytearray(block.raw("w").numpy().tobytes()), dtype=torch.uint8)  # reads the pages again
    assert block.cached_bytes() > 0


def test_evict_disk_tier_needs_a_disk_tier(tmp_path) -> None:
    model = stack()
    with pytest.raises(ValueError, match="was not offloaded"):
        evict_disk_tier(model)
    torchport.offload(model, find_blocks(model).resident_bytes + 2 * BLOCK, device="cpu", progress=False)
    with pytest.raises(ValueError, match="has no disk tier"):
        evict_disk_tier(model)
