"""CPU port of corpus/streams_events_profiler.py: no events, streams or nvtx; the profiler records the CPU only."""
import time

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

device = torch.device("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
x = torch.randn(16, 32).to(device)

start = time.perf_counter()
y = model(x)
print("cuda.Event elapsed >= 0", (time.perf_counter() - start) * 1000 >= 0)

start = time.perf_counter()
y2 = model(x * 2)
print("torch.Event elapsed >= 0", (time.perf_counter() - start) * 1000 >= 0)

z = (x * 3).sum(dim=1)
print(f"stream {z.sum().item():.6f}")

y3 = model(x)
loss = (y + y2 + y3).pow(2).mean()
print(f"loss {loss.item():.6f}")

with profile(activities=[ProfilerActivity.CPU]) as prof:
    with record_function("train_step"):
        model(x).sum().backward()
print("profiled", len(prof.key_averages()) > 0)
print(f"grad {model[0].weight.grad.abs().sum().item():.6f}")
