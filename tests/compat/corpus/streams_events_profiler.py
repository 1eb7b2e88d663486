"""CUDA-written: torch.cuda.Event(enable_timing=True) and torch.Event with elapsed_time, torch.cuda.Stream with
`with torch.cuda.stream(s)`, current_stream/wait_stream, nvtx ranges, and torch.profiler with the CUDA activity."""
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
x = torch.randn(16, 32).cuda()

start = torch.cuda.Event(enable_timing=True)
end = torch.cuda.Event(enable_timing=True)
start.record()
y = model(x)
end.record()
torch.cuda.synchronize()
print("cuda.Event elapsed >= 0", start.elapsed_time(end) >= 0)

first = torch.Event(device="cuda", enable_timing=True)
second = torch.Event(device="cuda", enable_timing=True)
first.record()
y2 = model(x * 2)
second.record()
second.synchronize()
print("torch.Event elapsed >= 0", first.elapsed_time(second) >= 0)

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    z = (x * 3).sum(dim=1)
torch.cuda.current_stream().wait_stream(side)
done = torch.cuda.Event()
done.record(side)
done.synchronize()
side.synchronize()
print(f"stream {z.sum().item():.6f}")

torch.cuda.nvtx.range_push("forward")
y3 = model(x)
torch.cuda.nvtx.range_pop()
with torch.cuda.nvtx.range("loss"):
    loss = (y + y2 + y3).pow(2).mean()
print(f"loss {loss.item():.6f}")

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    with record_function("train_step"):
        model(x).sum().backward()
    torch.cuda.synchronize()
print("profiled", len(prof.key_averages()) > 0)
print(f"grad {model[0].weight.grad.abs().sum().item():.6f}")
