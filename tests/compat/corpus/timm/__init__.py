"""A stand-in for a training library, found beside corpus/library_device_helper.py: its name is one the shim knows as
a library's (so it gets torch's real answers, not the program's), its code is a few lines of the pattern.

``setup_device(device)`` checks that the device it is handed can be used before making it, as training libraries'
device helpers do; ``train(...)`` moves each batch to the device it is given; ``has_cuda()`` asks on its own.
"""
import torch

__all__ = ["has_cuda", "setup_device", "train"]


def setup_device(device="cuda"):
    kind, _, index = device.partition(":")
    if kind == "cuda":
        assert torch.cuda.is_available(), f"CUDA is not available but {device} was specified."
        count = torch.cuda.device_count()
        if index and int(index) >= count:
            raise ValueError(f"{device} was specified but there are {count} CUDA devices")
    return torch.device(device)


def train(model, batches, optimizer, device):
    losses = []
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def has_cuda():
    return torch.cuda.is_available()
