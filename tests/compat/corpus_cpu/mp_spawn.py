"""CPU port of corpus/mp_spawn.py."""
import torch
import torch.multiprocessing as mp


def worker(rank, queue):
    device = torch.device("cpu")
    x = (torch.arange(4, dtype=torch.float32) * (rank + 1)).to(device)
    y = torch.ones(4, device=device)
    queue.put((rank, True, x.device == device, float((x + y).sum().cpu())))


if __name__ == "__main__":
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(queue,), nprocs=2, join=True)
    for rank, available, is_cuda, total in sorted(queue.get() for _ in range(2)):
        print(f"rank {rank} available {available} is_cuda {is_cuda} sum {total:.6f}")
