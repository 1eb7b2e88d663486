"""Models the export tests and the CLI tests export: a small CNN, a tiny Llama, and models that cannot be exported."""

from __future__ import annotations

import torch
from torch import nn


def cnn(batch_size: int = 2) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    return model, torch.randn(batch_size, 3, 16, 16)


class LlamaLogits(nn.Module):
    """A causal LM whose output is the logits tensor (no cache, no ModelOutput)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=False)[0]


def llama(batch_size: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    ids = torch.randint(0, 128, (batch_size, 12))
    return LlamaLogits(LlamaForCausalLM(config)), (ids, torch.ones_like(ids))


class Diff(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.diff(x, dim=-1)


def unsupported_op() -> tuple[nn.Module, torch.Tensor]:
    return Diff(), torch.randn(2, 5)


class ValueBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


def value_branch() -> tuple[nn.Module, torch.Tensor]:
    return ValueBranch(), torch.ones(2, 4)
