"""Tiny models for the offload tests: a plain stack of blocks, and a Hugging Face Llama with random weights."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    """Embedding, ``depth`` blocks in an nn.ModuleList, a head; each block holds 17 KiB of fp32 weights at width 32."""

    def __init__(self, width: int = 32, depth: int = 6, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)
        self.register_buffer("offset", torch.linspace(0, 1, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.offset
        for layer in self.layers:
            x = layer(x, scale=0.5)
        return self.head(x)


def stack(seed: int = 0, **kwargs: int) -> Stack:
    torch.manual_seed(seed)
    return Stack(**kwargs)


def tiny_llama(seed: int = 0, layers: int = 4):  # noqa: ANN201 - a transformers model
    transformers = __import__("pytest").importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()
