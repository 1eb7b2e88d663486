import torch


def run():
    torch.manual_seed(1)
    model = torch.nn.Linear(32, 4)
    data = torch.randn(16, 32)
    labels = torch.randint(0, 4, (16,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(4):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(data)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"{step}: {loss.item():.4f} {logits.dtype}")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        print(model(data).dtype)
    print(model(data).dtype)


if __name__ == "__main__":
    run()
