"""Tiny transformers models of each supported family (hidden 64, 2 layers, vocab 96) and comparison helpers."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 96
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
# Per case: model_type and config overrides. phi3-partial rotates half of head_dim; gemma2 soft-caps its logits
# (so its fused linear CE falls back to logits), gemma2-nocap does not.
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 16}),
    "gemma2-nocap": ("gemma2", {"final_logit_softcapping": None, "sliding_window": 8}),
    "gemma3_text": ("gemma3_text", {"sliding_window": 8, "query_pre_attn_scalar": 16}),
    "olmo2": ("olmo2", {}),
    "phi3": ("phi3", {}),
    "phi3-partial": ("phi3", {"partial_rotary_factor": 0.5}),
}


def config(case: str, **overrides: object) -> object:
    model_type, extra = CASES[case]
    return transformers.AutoConfig.for_model(model_type, **{**COMMON, **extra, **overrides})


def build(case: str, seed: int = 0, attention: str = "eager", **overrides: object) -> torch.nn.Module:
    """A causal LM of the case's family with ``attention`` (eager by default), in float32 on the CPU, in training
    mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(case, **overrides), attn_implementation=attention)
    with torch.no_grad():  # Gemma-style norm weights start at 0 (scale 1): move them off it so errors would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.train()


def to_device(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A copy on ``device``; tied embeddings are re-tied (the simulated npu's Module.to unties them)."""
    model = copy.deepcopy(model).to(device=device, dtype=dtype)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
        assert model.lm_head.weight is model.get_input_embeddings().weight
    return model


def batch(device: torch.device, seed: int = 1, batch_size: int = 2, seq: int = 12) -> dict[str, torch.Tensor]:
    """input_ids and labels (two labels ignored, as padding would be)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=gen)
    labels = ids.clone()
    labels[0, :2] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def loss_and_grads(model: torch.nn.Module, inputs: dict, **kwargs: object) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.detach().float().cpu() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
