"""CUDA-written: a training loop timed with CUDA events (enable_timing=True), record, synchronize and
elapsed_time, as benchmark scripts do."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
x = torch.randn(64, 16).to("cuda")
y = torch.randint(0, 4, (64,)).to(device="cuda")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for step in range(3):
    start.record()
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end))
print(f"loss {loss.item():.6f}")
print("timed", len(times), "steps, all >= 0:", all(t >= 0 for t in times), "done:", end.query())
