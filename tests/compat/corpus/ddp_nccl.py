"""CUDA-written: dist.init_process_group("nccl"), DistributedDataParallel(device_ids=[local_rank]), one step and an
all_reduce. Alone it is a one-process world (tcp:// on a free port); under torchrun it reads RANK etc. (env://)."""
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    if "RANK" in os.environ:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        dist.init_process_group("nccl")
    else:
        rank, local_rank = 0, 0
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    torch.manual_seed(0)  # every rank builds the same model and data
    model = nn.Linear(4, 2).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = torch.randn(8, 4).to(device), torch.randn(8, 2).to(device)
    loss = nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()

    t = torch.full((3,), float(rank + 1), device=device)
    dist.all_reduce(t)
    dist.barrier()
    print(f"rank {rank} world {dist.get_world_size()} loss {loss.item():.6f} "
          f"weight {model.weight.sum().item():.6f} allreduce {t.sum().item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
