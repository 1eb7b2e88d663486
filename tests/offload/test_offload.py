"""torchport.offload on each device: outputs identical to the resident model with blocks on every tier, the plan
matches where the weights are, bad input is refused before anything moves, and failures leave the model as it was."""

from __future__ import annotations

import os

import pytest
import torch
from offload_models import stack, tiny_llama

import torchport
from torchport.offload import find_blocks, placement, plan

BLOCK = 17 * 1024


# torch.no_grad() rather than inference_mode() where outputs are compared on the host: the simulated NPU cannot
# copy an inference tensor to the host (.cpu() returns a device tensor). One test runs under inference_mode and
# compares on the device.
def _reference(model_fn, device: torch.device, *inputs: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    model = model_fn().to(device)
    with torch.no_grad():
        return model(*(x.to(device) for x in inputs)).cpu()


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_outputs_identical_with_blocks_on_every_tier(device: torch.device, tmp_path, prefetch: int) -> None:
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    resident = stack().to(device)
    model = stack()
    budget = find_blocks(model).resident_bytes + (1 + prefetch + 1) * BLOCK  # one resident block at most
    expected = plan(model, budget, host_budget=2 * BLOCK, disk_dir=tmp_path, prefetch=prefetch, device=device)
    assert {"device", "host", "disk"} <= set(expected.tiers().values()) or prefetch == 3
    torchport.offload(model, budget, host_budget=2 * BLOCK, disk_dir=tmp_path, prefetch=prefetch, device=device,
                      progress=False)
    assert placement(model) == expected.tiers()
    with torch.inference_mode():
        want = resident(ids)
        for _ in range(3):  # later calls run on buffers filled by the previous call's wrap-around prefetch
            assert torch.equal(model(ids), want)
        # a call of one block out of order restarts the pipeline
        x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(2)).to(device)
        assert torch.equal(model.layers[4](x), resident.layers[4](x))
        assert torch.equal(model(ids), want)
    assert placement(model) == expected.tiers()


def test_everything_on_host_without_a_disk_tier(device: torch.device) -> None:
    ids = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(3))
    want = _reference(stack, device, ids)
    model = stack()
    budget = find_blocks(model).resident_bytes + 2 * BLOCK
    torchport.offload(model, budget, device=device)
    tiers = placement(model)
    assert "host" in tiers.values() and "disk" not in tiers.values()
    with torch.no_grad():
        assert torch.equal(model(ids.to(device)).cpu(), want)


def test_resident_and_home_tensors_are_where_the_plan_says(device: torch.device, tmp_path) -> None:
    model = stack()
    budget = find_blocks(model).resident_bytes + 4 * BLOCK
    torchport.offload(model, budget, host_budget=BLOCK, disk_dir=tmp_path, device=device, progress=False)
    tiers = placement(model)
    assert model.embed.weight.device == device and model.head.weight.device == device
    assert model.offset.device == device
    for i, layer in enumerate(model.layers):
        where = {p.device.type for p in layer.parameters()}
        assert where == ({device.type} if tiers[f"layers.{i}"] == "device" else {"cpu"})
    backend = torchport.backends.get_backend(device.type)
    if backend.pins_memory:
        host = [i for i in range(6) if tiers[f"layers.{i}"] == "host"]
        assert host and all(p.is_pinned() for p in model.layers[host[0]].parameters())
    files = sorted(os.listdir(tmp_path))
    assert files == sorted(["torchport-offload.json"] + [f"{name}.safetensors" for name, tier in tiers.items()
                                                         if tier == "disk"])
    state_dict = model.state_dict()  # home tensors: every weight is still readable
    assert torch.equal(state_dict["layers.5.up.weight"].cpu(), stack().layers[5].up.weight.detach())


def test_hugging_face_llama_forward_and_cached_decode_are_identical(device: torch.device, tmp_path) -> None:
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(4))
    resident = tiny_llama().to(device)
    with torch.no_grad():
        want_logits = resident(ids.to(device)).logits.cpu()
        want_tokens = resident.generate(ids.to(device), max_new_tokens=6, do_sample=False,
                                        pad_token_id=0).cpu()
    model = tiny_llama()
    sizes = find_blocks(model).block_bytes()
    budget = find_blocks(model).resident_bytes + 3 * sizes[0]
    torchport.offload(model, budget, host_budget=sizes[0], disk_dir=tmp_path, device=device, progress=False)
    assert set(placement(model).values()) == {"device", "host", "disk"}
    with torch.no_grad():
        assert torch.equal(model(ids.to(device)).logits.cpu(), want_logits)
        tokens = model.generate(ids.to(device), max_new_tokens=6, do_sample=False, pad_token_id=0).cpu()
    assert torch.equal(tokens, want_tokens)


def test_a_forward_that_records_grad_is_refused(device: torch.device) -> None:
    model = stack()
    torchport.offload(model, find_blocks(model).resident_bytes + 2 * BLOCK, device=device)
    with pytest.raises(RuntimeError, match=r"inference only: block 'layers\.\d'.*inference_mode"):
        model(torch.zeros(1, 3, dtype=torch.long, device=device))
    model.requires_grad_(False)
    model(torch.zeros(1, 3, dtype=torch.long, device=device))  # nothing to record: runs


def test_offloading_twice_is_refused(device: torch.device) -> None:
    model = stack()
    torchport.offload(model, 10**9, device=device)
    with pytest.raises(ValueError, match="already offloaded"):
        torchport.offload(model, 10**9, device=device)


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[int, torch.device]]:
    return {name: (id(p), p.device) for name, p in [*model.named_parameters(), *model.named_buffers()]}


def test_an_unwritable_disk_dir_is_refused_before_anything_moves(tmp_path) -> None:
    model = stack()
    before = _snapshot(model)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="disk_dir=.*a-file.*cannot be created"):
        torchport.offload(model, find_blocks(model).resident_bytes + 2 * BLOCK, host_budget=0,
                          disk_dir=blocker / "tier", device="cpu")
    assert _snapshot(model) == before and not hasattr(model, "_torchport_offload")


def test_a_full_disk_dir_is_refused_before_anything_moves(tmp_path, monkeypatch) -> None:
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    model = stack()
    before = _snapshot(model)
    with pytest.raises(ValueError, match="has 1000 B free; the disk tier needs"):
        torchport.offload(model, find_blocks(model).resident_bytes + 2 * BLOCK, host_budget=0, disk_dir=tmp_path,
                          device="cpu")
    assert _snapshot(model) == before and os.listdir(tmp_path) == []


def test_a_failure_while_moving_leaves_the_model_as_it_was(device: torch.device, tmp_path, monkeypatch) -> None:
    from torchport.offload import runtime

    def broken(folder: str, verify: bool = True) -> None:
        raise OSError("simulated read failure")

    monkeypatch.setattr(runtime, "open_tier", broken)
    ids = torch.randint(0, 50, (1, 4), generator=torch.Generator().manual_seed(5))
    model = stack()
    with torch.no_grad():
        want = model(ids)
    before = _snapshot(model)
    with pytest.raises(OSError, match="simulated"):
        torchport.offload(model, find_blocks(model).resident_bytes + 3 * BLOCK, host_budget=BLOCK,
                          disk_dir=tmp_path, device=device, progress=False)
    assert _snapshot(model) == before and os.listdir(tmp_path) == []
    assert not model.layers[0]._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(model(ids), want)


def test_a_budget_too_small_names_the_largest_block(device: torch.device) -> None:
    model = stack()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"largest block, 'layers.0', holds 17.00 KiB"):
        torchport.offload(model, find_blocks(model).resident_bytes + BLOCK // 2, device=device)
    assert _snapshot(model) == before


def test_the_module_is_callable_and_has_plan() -> None:
    import torchport.offload as package

    assert callable(torchport.offload) and package.plan is plan
    assert "offload" in type(torchport.offload).__call__.__doc__
