"""One AdamW step of a torchport-patched tiny Llama on this rank's share of a fixed batch, then a checkpoint.

Run by the distributed tests as ``torchport run --nproc-per-node 2 step_worker.py STRATEGY OUT`` (or without
a launcher, as one process); writes ``OUT/params.pt`` (full parameters after the step, rank 0) and the checkpoint
``OUT/ckpt``. The model and batch come from :func:`build`, which the tests also use for the one-process reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import torchport
import torchport.distributed as td

BATCH, SEQ, VOCAB = 4, 6, 97


def build() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    torchport.patch(model)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, tokens


def step(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.optim.Optimizer, float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    return optimizer, loss.item()


def main(strategy: str, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    device = td.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    model, tokens = build()
    wrapped = td.wrap(model, strategy)
    share = BATCH // world
    optimizer, loss = step(wrapped, tokens[rank * share:(rank + 1) * share].to(device))
    full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(full, out / "params.pt")
    dist.barrier()
    td.save_checkpoint(out / "ckpt", wrapped, optimizer)
    print(f"rank {rank} world {world} loss {loss:.6f}")
    # free DDP's reducer while its process group still exists (freed after, it can wait forever on gloo)
    del wrapped, model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
