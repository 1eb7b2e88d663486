"""CUDA-written: a DataLoader with num_workers=2, multiprocessing_context="spawn" and pin_memory=True; the loop moves
batches with .cuda(non_blocking=True). The dataset asks torch.cuda.is_available() in the worker process."""
import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        x = torch.full((3,), float(i))
        return x, x.pow(2).sum(), torch.tensor(torch.cuda.is_available())


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loader = DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context="spawn", pin_memory=True)
    total = torch.zeros((), device=device)
    flags = []
    for x, y, flag in loader:
        x = x.cuda(non_blocking=True)
        y = y.cuda(non_blocking=True)
        total += (x.sum(dim=1) + y).sum()
        flags.append(bool(flag.all()))
    torch.cuda.synchronize()
    print("batches", len(flags), "workers saw cuda", all(flags))
    print(f"total {total.item():.6f}")


if __name__ == "__main__":
    main()
