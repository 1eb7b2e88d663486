"""CPU port of corpus/library_device_helper.py: the device is the CPU, the library's loop written out here."""
import torch
import torch.nn as nn

device = torch.device("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batches = [(torch.randn(16, 5), torch.randn(16, 1)) for _ in range(4)]
for epoch in range(2):
    losses = []
    for inputs, targets in batches:
        loss = nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"epoch {epoch} loss {sum(losses) / len(losses):.6f}")
print("model on the device", next(model.parameters()).device == device)
print("library asking on its own", torch.cuda.is_available())
