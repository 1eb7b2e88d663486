"""Written for CUDA as PyTorch's ImageNet example is: the process-group backend comes from argparse (--dist-backend,
default "nccl"), each process selects its GPU with the CUDA module's set_device(local rank), DDP gets device_ids.
Alone it is a world of one (tcp:// on a free port); three SGD steps."""
import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dist-backend", default="nccl", type=str, help="distributed backend")
    parser.add_argument("--dist-url", default=None, type=str, help="url used to set up distributed training")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    init_method = args.dist_url or f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group(backend=args.dist_backend, init_method=init_method, world_size=1, rank=0)

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 2).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = torch.randn(8, 4).cuda(local_rank), torch.randn(8, 2).cuda(local_rank)
    for step in range(3):
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")
    print("world", dist.get_world_size())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
