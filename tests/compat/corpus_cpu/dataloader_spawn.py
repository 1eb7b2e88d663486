"""CPU port of corpus/dataloader_spawn.py."""
import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        x = torch.full((3,), float(i))
        return x, x.pow(2).sum(), torch.tensor(True)


def main():
    device = torch.device("cpu")
    loader = DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context="spawn")
    total = torch.zeros((), device=device)
    flags = []
    for x, y, flag in loader:
        x = x.to(device)
        y = y.to(device)
        total += (x.sum(dim=1) + y).sum()
        flags.append(bool(flag.all()))
    print("batches", len(flags), "workers saw cuda", all(flags))
    print(f"total {total.item():.6f}")


if __name__ == "__main__":
    main()
