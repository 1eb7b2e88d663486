"""CUDA-written tensor parallelism, as PyTorch's tensor-parallel examples are: a torchrun script that refuses to
start with fewer GPUs than ranks, sets its device from LOCAL_RANK, builds a device mesh on "cuda", shards an MLP
column- then row-wise (DTensor parameters) and trains three SGD steps; then shards a tensor and gathers it back, and
drops out a sharded tensor (a random operator on the mesh's device).
Alone it is a world of one; under torchrun each rank prints its records."""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

if "RANK" not in os.environ:  # started alone: a world of one on a free port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
world_size, local_rank = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
if torch.cuda.device_count() < world_size:
    sys.exit(f"this example needs {world_size} GPUs, found {torch.cuda.device_count()}")
torch.cuda.set_device(local_rank)
mesh = init_device_mesh("cuda", (world_size,))
rank = dist.get_rank()

torch.manual_seed(0)  # every rank builds the same model and data
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8, device="cuda"), torch.randn(32, 4, device="cuda")
for step in range(3):
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"rank {rank} world {world_size} step {step} loss {loss.item():.6f}", flush=True)

table = distribute_tensor(torch.arange(8.0, device="cuda").reshape(4, 2), mesh, [Shard(0)])
print(f"rank {rank} shard {tuple(table.to_local().shape)} gathered {table.full_tensor().sum().item():.1f}",
      flush=True)
dropped = nn.functional.dropout(distribute_tensor(torch.ones(4, 4, device="cuda"), mesh, [Shard(0)]), 0.5)
print(f"rank {rank} dropout zeros or twos {bool(((dropped.to_local() == 0) | (dropped.to_local() == 2)).all())}",
      flush=True)
dist.destroy_process_group()
