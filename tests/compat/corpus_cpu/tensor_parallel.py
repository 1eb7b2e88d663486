"""CPU port of corpus/tensor_parallel.py: the same computation in one process, unsharded (a world of one)."""
import torch
import torch.nn as nn

rank, world_size = 0, 1
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32, 4)
for step in range(3):
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"rank {rank} world {world_size} step {step} loss {loss.item():.6f}", flush=True)

table = torch.arange(8.0).reshape(4, 2)
print(f"rank {rank} shard {tuple(table.shape)} gathered {table.sum().item():.1f}", flush=True)
dropped = nn.functional.dropout(torch.ones(4, 4), 0.5)
print(f"rank {rank} dropout zeros or twos {bool(((dropped == 0) | (dropped == 2)).all())}", flush=True)
