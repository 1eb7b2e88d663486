"""The table behind :func:`torchport.patch`: for each Hugging Face model family, where its pieces live and how.

One row per ``config.model_type``. A row names the transformers module and, per op, the class or function that op
replaces; the patching code in :mod:`torchport.models` reads only this table, so a family whose modeling file
follows the Llama layout is one line here.

=====================  ===================  ==========================================================
flag                   table field          what is replaced
=====================  ===================  ==========================================================
``rms_norm``           ``norm``             the RMSNorm class's forward -> :func:`torchport.kernels.rms_norm`
``swiglu``/``geglu``   ``mlp``              the MLP's forward -> gate/up projections, the gated kernel,
                                            down projection (the activation in the config picks the kernel)
``rope``               ``rope``             the module-level ``apply_rotary_pos_emb`` -> :func:`rope`
``cross_entropy``      ``causal_lm``        the causal LM's ``loss_function`` -> :func:`cross_entropy`
``fused_linear_...``   ``causal_lm``        the causal LM's forward: in training with labels, the loss of
                       ``base``             ``lm_head(hidden)`` without the logits (soft-capped as the
                                            family's ``softcap`` config attribute says); ``hidden`` comes from
                                            the base model the causal LM holds in its ``base`` attribute
=====================  ===================  ==========================================================

Example:
    >>> from torchport.models.families import FAMILIES
    >>> FAMILIES["gemma"].norm.offset
    1.0
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "Family", "MLP", "Norm", "GATED_ACTIVATIONS"]


@dataclass(frozen=True)
class Norm:
    """An RMSNorm class: ``y = x / rms(x) * (offset + weight)``."""

    cls: str
    eps: str = "variance_epsilon"  # the attribute holding epsilon
    offset: float = 0.0  # 1.0 where the weight is stored minus one (Gemma)
    # Norms (by attribute name in the decoder layer) whose output is added to the residual stream directly. Their
    # output gradient is the residual's gradient too, so the kernel must not overwrite it: in_place=False. Every
    # other norm feeds linear layers (or RoPE), whose backward is the only reader of that gradient: in_place=True.
    residual_outputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class MLP:
    """A gated MLP: ``down(act(gate(x)) * up(x))``, or with one fused ``gate_up`` projection (gate first)."""

    cls: str
    act: str = "act_fn"  # the attribute holding the activation module
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    gate_up: str | None = None  # a fused projection whose output's halves are gate and up (Phi-3)


@dataclass(frozen=True)
class Family:
    """Where one family's pieces live in transformers."""

    module: str  # the modeling module, e.g. "transformers.models.llama.modeling_llama"
    norm: Norm
    mlp: MLP
    causal_lm: str  # the causal-LM class (its loss and forward)
    rope: str = "apply_rotary_pos_emb"  # module-level function with Hugging Face's (q, k, cos, sin) contract
    softcap: str | None = None  # config attribute by which the logits are soft-capped (the fused loss does it too)
    # The causal LM's attribute holding the base model its forward calls. Not base_model_prefix: transformers 4.56's
    # Gemma3ForCausalLM says "language_model" there and keeps its base model in `model`.
    base: str = "model"


def _llama_like(name: str, prefix: str, **norm: object) -> Family:
    return Family(
        module=f"transformers.models.{name}.modeling_{name}",
        norm=Norm(f"{prefix}RMSNorm", **norm),  # type: ignore[arg-type]
        mlp=MLP(f"{prefix}MLP"),
        causal_lm=f"{prefix}ForCausalLM",
    )


_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")

FAMILIES: dict[str, Family] = {
    "llama": _llama_like("llama", "Llama"),
    "mistral": _llama_like("mistral", "Mistral"),
    "qwen2": _llama_like("qwen2", "Qwen2"),
    "qwen3": _llama_like("qwen3", "Qwen3"),  # q_norm/k_norm are Qwen3RMSNorm too (over head_dim)
    "gemma": _llama_like("gemma", "Gemma", eps="eps", offset=1.0),
    # Gemma 2/3: sandwich norms; post_* norms feed the residual directly. Logits may be soft-capped.
    "gemma2": Family(
        module="transformers.models.gemma2.modeling_gemma2",
        norm=Norm("Gemma2RMSNorm", eps="eps", offset=1.0, residual_outputs=_POST_NORMS),
        mlp=MLP("Gemma2MLP"),
        causal_lm="Gemma2ForCausalLM",
        softcap="final_logit_softcapping",
    ),
    "gemma3_text": Family(
        module="transformers.models.gemma3.modeling_gemma3",
        norm=Norm("Gemma3RMSNorm", eps="eps", offset=1.0, residual_outputs=_POST_NORMS),
        mlp=MLP("Gemma3MLP"),
        causal_lm="Gemma3ForCausalLM",
        softcap="final_logit_softcapping",
    ),
    # OLMo 2: no pre-norms; the post-norms feed the residual directly.
    "olmo2": Family(
        module="transformers.models.olmo2.modeling_olmo2",
        norm=Norm("Olmo2RMSNorm", residual_outputs=_POST_NORMS),
        mlp=MLP("Olmo2MLP"),
        causal_lm="Olmo2ForCausalLM",
    ),
    # Phi-3: one gate_up projection, split into views (no copy); apply_rotary_pos_emb rotates a prefix of
    # head_dim when partial_rotary_factor < 1, which the rope wrapper follows.
    "phi3": Family(
        module="transformers.models.phi3.modeling_phi3",
        norm=Norm("Phi3RMSNorm"),
        mlp=MLP("Phi3MLP", act="activation_fn", gate_up="gate_up_proj"),
        causal_lm="Phi3ForCausalLM",
    ),
}

# transformers.activations.ACT2CLS keys -> the gated kernel computing act(gate) * up exactly. "gelu_new" is the tanh
# approximation too. Any other activation leaves the MLP as it is.
GATED_ACTIVATIONS: dict[str, str] = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
}
