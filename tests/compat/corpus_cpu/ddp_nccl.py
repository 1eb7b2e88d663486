"""CPU port of corpus/ddp_nccl.py: gloo, DistributedDataParallel without device_ids."""
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
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo")
    else:
        rank = 0
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    device = torch.device("cpu")

    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    ddp = DDP(model)
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
