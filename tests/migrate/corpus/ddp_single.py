import os
import socket

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(local_rank=0):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", rank=0, world_size=1)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2).cuda(local_rank), device_ids=[local_rank])
    batch = torch.randn(8, 4).cuda(local_rank)
    loss = model(batch).pow(2).mean()
    loss.backward()
    print("loss", round(loss.item(), 6))
    print("grad", round(model.module.weight.grad.sum().item(), 6))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
