"""CUDA-written: TorchScript in a library and in the program. torch.distributed.optim compiles torch's functional
optimizers with torch.jit.script at import; the program scripts its loss and traces its model on "cuda"."""
import torch
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401  (compiles torch's scripted optimizers)


@torch.jit.script
def smooth_l1(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    diff = (pred - target).abs()
    return torch.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean() + torch.zeros_like(diff).sum()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).cuda()
x = torch.randn(32, 8).cuda()
y = torch.randn(32, 1).cuda()
traced = torch.jit.trace(model, x)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    optimizer.zero_grad()
    loss = smooth_l1(traced(x), y)
    loss.backward()
    optimizer.step()
print(f"loss {loss.item():.6f}")
print("compiled", isinstance(smooth_l1, torch.jit.ScriptFunction), isinstance(traced, torch.jit.ScriptModule))
