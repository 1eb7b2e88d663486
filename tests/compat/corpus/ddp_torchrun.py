"""CUDA-written, as the torchrun DDP tutorial: nccl, the device id from the rank modulo the GPU count, .to(int),
DDP(device_ids=[int]), a checkpoint reloaded with map_location={"cuda:0": f"cuda:{id}"}. Under torchrun it reads
RANK etc.; alone it is a one-process world on a free port."""
import os
import socket
import tempfile

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
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    rank = dist.get_rank()
    device_id = rank % torch.cuda.device_count()
    torch.manual_seed(0)  # every rank builds the same model
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device_id)
    ddp_model = DDP(model, device_ids=[device_id])
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data
    for step in range(3):
        inputs = torch.randn(4, 8, generator=generator).to(device_id)
        labels = torch.randn(4, 2, generator=generator).to(device_id)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp_model(inputs), labels)
        loss.backward()
        optimizer.step()
    run = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    path = os.path.join(tempfile.gettempdir(), f"ddp_torchrun_{run}.pt")
    if rank == 0:
        torch.save(ddp_model.state_dict(), path)
    dist.barrier()
    ddp_model.load_state_dict(torch.load(path, map_location={"cuda:0": f"cuda:{device_id}"}))
    total = torch.tensor([loss.item()], device=device_id)
    dist.all_reduce(total)
    weight = ddp_model.module[0].weight.detach().sum()
    dist.barrier()
    if rank == 0:
        print(f"mean loss {total.item() / dist.get_world_size():.6f} weight sum {weight.item():.6f}")
        os.remove(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
