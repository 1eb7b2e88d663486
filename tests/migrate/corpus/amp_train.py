from torch.cuda.amp import autocast, GradScaler
import torch


def run():
    torch.manual_seed(1)
    model = torch.nn.Linear(32, 4).cuda()
    data = torch.randn(16, 32, device="cuda")
    labels = torch.randint(0, 4, (16,), device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = GradScaler()
    for step in range(4):
        optimizer.zero_grad(set_to_none=True)
        with autocast(dtype=torch.bfloat16):
            logits = model(data)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"{step}: {loss.item():.4f} {logits.dtype}")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        print(model(data).dtype)
    with torch.cuda.amp.autocast(enabled=False):
        print(model(data).dtype)


if __name__ == "__main__":
    run()
