"""A mini Llama trained 30 AdamW steps, patched and unpatched, on the CPU: the loss curves and final weights agree.

Float32, one fixed batch (the model memorises it, so the loss falls steadily). Per-step differences in the
gradients are at the 1e-7 level (see test_model_patch.py); Adam normalises each update, so they grow over the steps but
stay small: seen, loss curves within 5e-6 relative and weights within 1.2e-5 absolute (the loss falls from 4.6 to
0.3); asserted 1e-4 and 1e-4.
"""

from __future__ import annotations

import pytest
import torch

import torchport

from tiny_models import batch, build, to_device

STEPS = 30


def _train(model: torch.nn.Module, inputs: dict) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_thirty_adamw_steps_patched_vs_unpatched():
    if not hasattr(torchport.kernels, "fused_linear_cross_entropy"):
        pytest.skip("torchport.kernels.fused_linear_cross_entropy is not available yet")
    cpu = torch.device("cpu")
    base = build("llama")
    reference, patched = to_device(base, cpu, torch.float32), to_device(base, cpu, torch.float32)
    torchport.patch(patched)
    try:
        inputs = batch(cpu, batch_size=2, seq=16)
        ref_losses, losses = _train(reference, inputs), _train(patched, inputs)
    finally:
        torchport.unpatch(patched)
    assert ref_losses[-1] < 0.8 * ref_losses[0], ref_losses  # it learns
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for (name, p), q in zip(patched.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
