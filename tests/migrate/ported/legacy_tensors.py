"""legacy_tensors.py ported by hand to the CPU."""
import numpy as np
import torch
import torch.nn as nn

rng = np.random.default_rng(0)
torch.manual_seed(0)
generator = nn.Sequential(nn.Linear(4 + 3, 16), nn.ReLU(), nn.Linear(16, 6))
discriminator = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
adversarial = nn.BCELoss()
opt_g = torch.optim.Adam(generator.parameters(), lr=0.01)
opt_d = torch.optim.Adam(discriminator.parameters(), lr=0.01)
real_data = rng.normal(1.0, 0.5, size=(64, 6))
batch = 16

for step in range(4):
    real = torch.tensor(real_data[step * batch:(step + 1) * batch], dtype=torch.float32)
    labels = torch.tensor(rng.integers(0, 3, batch), dtype=torch.int64)
    onehot = torch.zeros(real.size(0), 3).scatter_(1, labels.view(-1, 1), 1)
    valid = torch.ones(batch, 1)
    fake = torch.zeros(batch, 1)
    z = torch.tensor(rng.normal(0, 1, (batch, 4)), dtype=torch.float32)

    opt_g.zero_grad()
    generated = generator(torch.cat([z, onehot], 1))
    g_loss = adversarial(discriminator(generated), valid)
    g_loss.backward()
    opt_g.step()

    opt_d.zero_grad()
    d_loss = (adversarial(discriminator(real), valid) + adversarial(discriminator(generated.detach()), fake)) / 2
    d_loss.backward()
    opt_d.step()
    print(f"step {step} d_loss {d_loss.item():.6f} g_loss {g_loss.item():.6f}")

counts = torch.zeros(3, dtype=torch.int64)
counts += torch.tensor([1, 2, 3])
as_double = real.double()
back = as_double.float()
print("dtypes", counts.dtype, as_double.dtype, back.dtype, counts.tolist())
print(f"score {discriminator(back).mean().item():.6f}")
