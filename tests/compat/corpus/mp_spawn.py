"""CUDA-written: torch.multiprocessing.spawn of workers that check torch.cuda.is_available(), compute with .cuda()
and report back through a queue."""
import torch
import torch.multiprocessing as mp


def worker(rank, queue):
    available = torch.cuda.is_available()
    x = (torch.arange(4, dtype=torch.float32) * (rank + 1)).cuda()
    y = torch.ones(4, device=f"cuda:{0}")
    queue.put((rank, available, x.is_cuda, float((x + y).sum().cpu())))


if __name__ == "__main__":
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(queue,), nprocs=2, join=True)
    for rank, available, is_cuda, total in sorted(queue.get() for _ in range(2)):
        print(f"rank {rank} available {available} is_cuda {is_cuda} sum {total:.6f}")
