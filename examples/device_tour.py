"""A short tour of torchport's device layer: the same script on an Ascend NPU, a GPU, or a CPU.

Run it with ``bash scripts/demo.sh`` (or ``python examples/device_tour.py``). Force a device with
``TORCHPORT_DEVICE=cpu``, or try the simulated Ascend NPU with ``TORCHPORT_SIMULATE=npu``.
"""

from __future__ import annotations

import torch

import torchport


def main() -> None:
    torchport.seed(0)
    device = torchport.device()
    dtype = torchport.dtype(device)
    info = torchport.info(probe=False)
    entry = next(d for d in info["devices"] if d["device"] == str(device))
    print(f"torchport {torchport.__version__} | torch {torch.__version__} | devices: "
          f"{', '.join(map(str, torchport.devices()))}")
    print(f"using {device} ({entry['name']}), compute dtype {str(dtype).removeprefix('torch.')}, "
          f"distributed backend {entry['dist_backend']}")

    # A small classifier trained for a few steps, with mixed precision where the device has it.
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torchport.generator(1, device)
    x = torch.randn(4096, 64, device=device, generator=g)
    teacher = torch.randn(64, 10, device=device, generator=g)
    y = (torch.tanh(x @ teacher) + 0.5 * torch.randn(4096, 10, device=device, generator=g)).argmax(dim=1)
    low_precision = dtype != torch.float32
    with torchport.Timer(device) as timer:
        for step in range(60):
            with torch.autocast(device.type, dtype=dtype, enabled=low_precision):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 20 == 0 or step == 59:
                print(f"  step {step:2d}  loss {loss.item():.4f}")
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"60 steps in {timer.ms:.1f} ms on {device}; training accuracy {accuracy:.1%}")

    mem = torchport.memory()["devices"][str(device)]
    if mem["peak_allocated"] is not None:
        print(f"peak device memory {mem['peak_allocated'] / 2**20:.1f} MiB of {mem['total'] / 2**30:.1f} GiB")
    else:
        print(f"process memory {mem['process_peak_rss'] / 2**20:.0f} MiB (the CPU counts no tensor bytes)")
    print("next: `torchport doctor` checks this machine in depth")


if __name__ == "__main__":
    main()
