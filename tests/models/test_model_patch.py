"""torchport.patch on tiny models of every family: the loss and every gradient equal the unpatched model's.

Tolerances (relative: norm of the difference over the reference's norm, per parameter for gradients). In float32 the
kernels compute what transformers computes, in float32, in another order (chunked cross-entropy, fused norms): seen
on the CPU, loss 1e-7 and gradients 6e-7 at worst; asserted 1e-6 and 1e-5. In bfloat16 transformers rounds to
bfloat16 after each op where the kernels round once: seen, loss 3e-3 and gradients 2.1e-2 at worst (Qwen2);
asserted 1e-2 and 5e-2.
"""

from __future__ import annotations

import pytest
import torch

import torchport
from torchport.backends import get_backend

from tiny_models import CASES, batch, build, loss_and_grads, relative_error, to_device

TOLERANCE = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 5e-2)}
LOSS_KERNELS = ("cross_entropy", "fused_linear_cross_entropy")


def _needs(*kernels: str) -> None:
    """Skip until the kernels a test relies on exist in torchport.kernels (they land separately)."""
    for name in kernels:
        if not hasattr(torchport.kernels, name):
            pytest.skip(f"torchport.kernels.{name} is not available yet")


@pytest.fixture(autouse=True)
def _clean():
    torchport.unpatch()
    yield
    torchport.unpatch()


def _compare(case: str, device: torch.device, dtype: torch.dtype, **flags: bool) -> tuple:
    if not get_backend(device.type).dtype_works(dtype, device.index or 0):
        pytest.skip(f"{dtype} does not work on {device}")
    base = build(case)
    reference, patched = to_device(base, device, dtype), to_device(base, device, dtype)
    torchport.patch(patched, **flags)
    inputs = batch(device)
    out_ref, grads_ref = loss_and_grads(reference, inputs)
    out, grads = loss_and_grads(patched, inputs)
    loss_tol, grad_tol = TOLERANCE[dtype]
    assert relative_error(out.loss, out_ref.loss) < loss_tol, (out.loss, out_ref.loss)
    assert out.loss.dtype == out_ref.loss.dtype
    assert grads.keys() == grads_ref.keys()
    worst = max(grads, key=lambda name: relative_error(grads[name], grads_ref[name]))
    assert relative_error(grads[worst], grads_ref[worst]) < grad_tol, (worst, relative_error(grads[worst],
                                                                                              grads_ref[worst]))
    return out, out_ref


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_loss_and_grads_match(case, device):
    _needs("fused_linear_cross_entropy")
    out, out_ref = _compare(case, device, torch.float32)
    assert out.logits is None  # the fused loss makes no logits, soft-capped (Gemma 2) or not


@pytest.mark.parametrize("case", ["llama", "gemma", "gemma2", "phi3", "qwen3"])
def test_fp32_cross_entropy_route(case, device):
    _needs("cross_entropy")
    out, out_ref = _compare(case, device, torch.float32, cross_entropy=True, fused_linear_cross_entropy=False)
    torch.testing.assert_close(out.logits, out_ref.logits)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_loss_and_grads_match(case, device):
    _needs("fused_linear_cross_entropy")
    _compare(case, device, torch.bfloat16)


@pytest.mark.parametrize("case", ["llama", "gemma2"])
def test_kernel_ops_only(case, device):
    """Norms, MLP and RoPE without any loss kernel: the loss is transformers' own."""
    _compare(case, device, torch.float32, cross_entropy=False, fused_linear_cross_entropy=False)


def test_patched_modules_and_in_place_choice():
    model = torchport.patch(build("gemma2"))
    layer = model.model.layers[0]
    # forwards replaced on the instance; classes, parameters and state_dict untouched
    assert "forward" in layer.mlp.__dict__ and type(layer.mlp).__name__ == "Gemma2MLP"
    # post-norms feed the residual: not in place; the others are
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    in_place = {name: getattr(layer, name).forward.__func__.in_place for name in names}
    assert in_place == {"input_layernorm": True, "post_attention_layernorm": False,
                        "pre_feedforward_layernorm": True, "post_feedforward_layernorm": False}


def test_eval_and_no_labels_keep_logits():
    _needs("fused_linear_cross_entropy")
    base = build("llama")
    patched = torchport.patch(to_device(base, torch.device("cpu"), torch.float32))
    inputs = batch(torch.device("cpu"))
    out = patched(input_ids=inputs["input_ids"])  # training, no labels
    torch.testing.assert_close(out.logits, base(input_ids=inputs["input_ids"]).logits)
    patched.eval(), base.eval()
    with torch.no_grad():
        out, ref = patched(**inputs), base(**inputs)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss)
    generated = patched.generate(inputs["input_ids"][:, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, base.generate(inputs["input_ids"][:, :4], max_new_tokens=3, do_sample=False))


def test_num_items_in_batch_and_shift_labels():
    _needs(*LOSS_KERNELS)
    base = build("qwen2")
    inputs = batch(torch.device("cpu"))
    n = torch.tensor(7)
    shift = torch.nn.functional.pad(inputs["labels"], (0, 1), value=-100)[..., 1:].contiguous()
    ref = base(**inputs, num_items_in_batch=n).loss
    other = torch.zeros_like(inputs["labels"])  # shift_labels, when given, win over labels
    ref_shift = base(input_ids=inputs["input_ids"], labels=other, shift_labels=shift, num_items_in_batch=n).loss
    torch.testing.assert_close(ref_shift, ref)
    for flags in ({}, {"cross_entropy": True, "fused_linear_cross_entropy": False}):
        patched = torchport.patch(to_device(base, torch.device("cpu"), torch.float32), **flags)
        torch.testing.assert_close(patched(**inputs, num_items_in_batch=n).loss, ref)
        torch.testing.assert_close(patched(input_ids=inputs["input_ids"], labels=other, shift_labels=shift,
                                           num_items_in_batch=n).loss, ref)
        assert patched(input_ids=inputs["input_ids"], shift_labels=shift).loss is None  # no labels, no loss
        # positional arguments are named as the original forward names them
        torch.testing.assert_close(patched(inputs["input_ids"], None, labels=inputs["labels"]).loss,
                                   base(**inputs).loss)


def test_return_dict_false():
    _needs("fused_linear_cross_entropy")
    base = build("llama")
    patched = torchport.patch(to_device(base, torch.device("cpu"), torch.float32))
    out = patched(**batch(torch.device("cpu")), return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0


def test_fused_loss_takes_the_hidden_states_from_the_base_model_the_forward_calls():
    """Not from ``base_model_prefix``: transformers 4.56's Gemma3ForCausalLM sets it to "language_model" and keeps
    its base model in ``model``, as every family in the table does."""
    _needs("fused_linear_cross_entropy")
    base = build("llama")
    patched = torchport.patch(to_device(base, torch.device("cpu"), torch.float32))
    patched.base_model_prefix = "language_model"
    inputs = batch(torch.device("cpu"))
    out = patched(**inputs)
    assert out.logits is None
    torch.testing.assert_close(out.loss, base(**inputs).loss)


def test_weights_stay():
    model = build("phi3")
    before = {name: p for name, p in model.named_parameters()}
    state = {name: t.clone() for name, t in model.state_dict().items()}
    torchport.patch(model)
    assert {name: p for name, p in model.named_parameters()} == before  # the same Parameter objects
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


def test_unpatch_restores_originals():
    import transformers.models.gemma.modeling_gemma as gemma

    model = build("gemma")
    rope, forward = gemma.apply_rotary_pos_emb, gemma.GemmaRMSNorm.forward
    modules = [m for m in model.modules()]
    torchport.patch(model, cross_entropy=True)
    assert gemma.apply_rotary_pos_emb is not rope and torchport.models.is_patched(model)
    assert model.model.norm.forward.__func__ is not forward
    torchport.patch(model, cross_entropy=True)  # idempotent
    torchport.unpatch(model)
    assert gemma.apply_rotary_pos_emb is rope and gemma.GemmaRMSNorm.forward is forward
    assert all("forward" not in m.__dict__ for m in modules)
    assert "_loss_function" not in model.__dict__ and "_torchport_patch" not in model.__dict__
    assert model.model.norm.forward.__func__ is forward
    assert not torchport.models.is_patched()
    torchport.unpatch(model)  # safe twice


def test_rope_is_shared_until_the_last_model_is_unpatched():
    import transformers.models.llama.modeling_llama as llama

    original = llama.apply_rotary_pos_emb
    first, second = torchport.patch(build("llama")), torchport.patch(build("llama", seed=1))
    torchport.unpatch(first)
    assert llama.apply_rotary_pos_emb is not original
    torchport.unpatch(second)
    assert llama.apply_rotary_pos_emb is original
    torchport.patch(build("llama"))  # dropped without unpatch: its hold goes with it
    import gc

    gc.collect()
    assert llama.apply_rotary_pos_emb is original


def test_patch_transformers_then_build():
    _needs("fused_linear_cross_entropy")
    import transformers.models.phi3.modeling_phi3 as phi3

    originals = (phi3.Phi3RMSNorm.forward, phi3.Phi3MLP.forward, phi3.Phi3ForCausalLM.forward,
                 phi3.apply_rotary_pos_emb)
    assert torchport.patch_transformers("phi3") == ["phi3"]
    assert torchport.patch_transformers("phi3") == ["phi3"]  # idempotent
    model = build("phi3")
    assert type(model.model.norm).forward.__qualname__ == "torchport.Phi3RMSNorm.forward"
    assert type(model.model.layers[0].mlp).forward.__qualname__ == "torchport.Phi3MLP.forward"
    assert phi3.apply_rotary_pos_emb.__wrapped__ is originals[3]
    inputs = batch(torch.device("cpu"))
    out = model(**inputs)
    assert out.logits is None
    torchport.unpatch()
    assert (phi3.Phi3RMSNorm.forward, phi3.Phi3MLP.forward, phi3.Phi3ForCausalLM.forward,
            phi3.apply_rotary_pos_emb) == originals
    torch.testing.assert_close(model(**inputs).loss, out.loss)


def test_patch_transformers_every_family():
    families = torchport.patch_transformers(rms_norm=True, fused_linear_cross_entropy=False)
    assert set(families) == set(torchport.models.supported())
    torchport.unpatch()
    assert not torchport.models.is_patched()


def test_peft_wrapped_model():
    peft = pytest.importorskip("peft")
    base = build("llama")
    reference = peft.get_peft_model(to_device(base, torch.device("cpu"), torch.float32),
                                    peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "lm_head"]))
    wrapped = peft.get_peft_model(to_device(base, torch.device("cpu"), torch.float32),
                                  peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "lm_head"]))
    wrapped.load_state_dict(reference.state_dict())
    for model in (reference, wrapped):
        with torch.no_grad():  # LoRA B starts at zero: give the adapters something to contribute
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.linspace(-0.1, 0.1, p.numel()).view_as(p))
    assert torchport.patch(wrapped) is wrapped
    inner = wrapped.base_model.model
    assert "forward" in inner.model.norm.__dict__
    inputs = batch(torch.device("cpu"))
    out_ref, grads_ref = loss_and_grads(reference, inputs)
    out, grads = loss_and_grads(wrapped, inputs)
    assert relative_error(out.loss, out_ref.loss) < 1e-5
    assert grads.keys() == grads_ref.keys() and any("lora" in name for name in grads)
    assert all(relative_error(grads[k], grads_ref[k]) < 1e-4 for k in grads)
    torchport.unpatch(wrapped)
    assert "forward" not in inner.model.norm.__dict__


def test_minimal_wrapper():
    class Wrapper:
        def __init__(self, model):
            self.base_model = type("Inner", (), {"model": model})()

    model = build("qwen3")
    wrapper = Wrapper(model)
    assert torchport.patch(wrapper) is wrapper
    assert torchport.models.is_patched(model) and "forward" in model.model.layers[0].self_attn.q_norm.__dict__
    torchport.unpatch(wrapper)
    assert not torchport.models.is_patched(model)


def test_unsupported_family_lists_supported():
    import transformers

    config = transformers.AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=50)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported: gemma, gemma2.*llama.*phi3"):
        torchport.patch(model)
    with pytest.raises(ValueError, match="not supported"):
        torchport.patch_transformers("gpt2")
    with pytest.raises(TypeError, match="unknown flag"):
        torchport.patch_transformers("llama", fused_rope=True)
    with pytest.raises(TypeError, match="expected a transformers model"):
        torchport.patch(object())


def test_mlp_with_another_activation_is_left_alone():
    model = torchport.patch(build("llama", hidden_act="relu"))
    assert "forward" not in model.model.layers[0].mlp.__dict__
    assert "forward" in model.model.layers[0].input_layernorm.__dict__


def test_lazy_names_on_the_namespace():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import sys, torchport; f = torchport.patch; "
                          "print(callable(f), 'transformers' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]
    assert {"patch", "patch_transformers", "unpatch"} <= set(dir(torchport))


def test_concurrent_patch_and_unpatch():
    import threading

    import transformers.models.mistral.modeling_mistral as mistral

    original = mistral.apply_rotary_pos_emb
    models = [build("mistral", seed=i) for i in range(4)]
    errors = []

    def work(model):
        try:
            for _ in range(5):
                torchport.patch(model)
                torchport.unpatch(model)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert mistral.apply_rotary_pos_emb is original and not torchport.models.is_patched()


def test_deep_copy_is_a_patched_model_of_its_own():
    import copy

    import transformers.models.llama.modeling_llama as llama

    original = llama.apply_rotary_pos_emb
    model = torchport.patch(build("llama"))
    twin = copy.deepcopy(model)
    assert twin.model.norm.forward.__self__ is twin.model.norm and torchport.models.is_patched(twin)
    torchport.unpatch(model)
    assert llama.apply_rotary_pos_emb is not original  # the copy still holds it
    inputs = batch(torch.device("cpu"))
    torch.testing.assert_close(twin(**inputs).loss, model(**inputs).loss)
    torchport.unpatch(twin)
    assert "forward" not in twin.model.norm.__dict__ and llama.apply_rotary_pos_emb is original


def test_accelerate_style_hook_stays_around_the_kernel():
    model = build("llama")
    norm = model.model.norm
    calls = []

    def hooked(*args, **kwargs):  # what accelerate's add_hook_to_module installs
        calls.append(1)
        return norm._old_forward(*args, **kwargs)

    norm.__dict__["_old_forward"] = norm.forward
    norm.__dict__["forward"] = hooked
    torchport.patch(model)
    assert norm.__dict__["forward"] is hooked and norm._old_forward.__func__.__qualname__.startswith("torchport.")
    model(**batch(torch.device("cpu")))
    assert calls
    torchport.unpatch(model)
    assert norm._old_forward.__func__.__qualname__ == "LlamaRMSNorm.forward"


def test_subclass_with_its_own_forward_is_left_alone():
    import transformers.models.llama.modeling_llama as llama

    class ScaledNorm(llama.LlamaRMSNorm):
        def forward(self, x):
            return 2 * super().forward(x)

    model = build("llama")
    model.model.norm = ScaledNorm(64)
    torchport.patch(model)
    assert "forward" not in model.model.norm.__dict__ and "forward" in model.model.layers[0].input_layernorm.__dict__


@pytest.mark.parametrize("flags", [dict(cross_entropy=True, fused_linear_cross_entropy=False), {}],
                         ids=["cross_entropy", "fused_linear_cross_entropy"])
def test_bf16_loss_is_float32_and_unrounded(flags):
    """A bf16 model's loss, with only the loss patched: float32 like transformers' own, and equal to it in float32
    arithmetic (a loss rounded to bf16 on the way is off by up to 2^-9 = 2e-3)."""
    _needs(*LOSS_KERNELS)
    base = build("qwen3")
    reference = to_device(base, torch.device("cpu"), torch.bfloat16)
    patched = torchport.patch(to_device(base, torch.device("cpu"), torch.bfloat16), rms_norm=False, rope=False,
                              swiglu=False, geglu=False, **flags)
    inputs = batch(torch.device("cpu"))
    loss, ref = patched(**inputs).loss, reference(**inputs).loss
    assert loss.dtype == ref.dtype == torch.float32
    assert relative_error(loss, ref) < 2e-5, (loss.item(), ref.item())
    loss.backward()
    assert patched.lm_head.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["gemma2", "gemma3_text"])
def test_softcapped_logits_through_the_fused_loss(case):
    """Gemma 2/3 soft-cap their logits (cap · tanh(logits / cap)); the fused loss does the same. With logits of a
    few units and a cap of 1, a loss without the cap would differ by far more than the tolerance."""
    _needs("fused_linear_cross_entropy")
    base = build(case, final_logit_softcapping=1.0)
    with torch.no_grad():
        base.lm_head.weight.mul_(20.0)  # tied to the embeddings: the inputs grow too, the norms take that
    reference, patched = (to_device(base, torch.device("cpu"), torch.float32) for _ in range(2))
    torchport.patch(patched)
    inputs = batch(torch.device("cpu"))
    out_ref, grads_ref = loss_and_grads(reference, inputs)
    out, grads = loss_and_grads(patched, inputs)
    assert out.logits is None
    assert relative_error(out.loss, out_ref.loss) < 1e-6
    assert all(relative_error(grads[k], grads_ref[k]) < 1e-5 for k in grads_ref)
    uncapped = to_device(base, torch.device("cpu"), torch.float32)
    uncapped.config.final_logit_softcapping = None
    assert relative_error(uncapped(**inputs).loss, out_ref.loss) > 1e-2


def _assert_patched_copy(copy_, original, inputs):
    """``copy_`` is a patched model of its own that computes what ``original`` computes."""
    assert torchport.models.is_patched(copy_)
    forward = copy_.model.norm.forward
    assert forward.__self__ is copy_.model.norm and forward.__func__.__qualname__.startswith("torchport.")
    assert copy_.model.layers[0].mlp.forward.__self__ is copy_.model.layers[0].mlp
    out = copy_(**inputs)
    assert out.logits is None  # the fused loss
    torch.testing.assert_close(out.loss, original(**inputs).loss)


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_pickle_save_and_deepcopy_of_a_patched_model(how):
    import copy
    import io
    import pickle

    import transformers.models.llama.modeling_llama as llama

    rope = llama.apply_rotary_pos_emb
    model = torchport.patch(build("llama"))
    if how == "pickle":
        twin = pickle.loads(pickle.dumps(model))
    elif how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    else:
        twin = copy.deepcopy(model)
    assert twin is not model and twin.model.norm is not model.model.norm
    _assert_patched_copy(twin, model, batch(torch.device("cpu")))
    torchport.unpatch(model)
    assert llama.apply_rotary_pos_emb is not rope  # the copy holds the rope patch of its own
    torchport.unpatch(twin)
    assert "forward" not in twin.model.norm.__dict__ and "forward" not in twin.__dict__
    assert llama.apply_rotary_pos_emb is rope and not torchport.models.is_patched()


def test_a_model_pickled_under_the_earlier_module_names_loads_patched(monkeypatch):
    """Earlier versions defined the replaced forward, the record and its restore function in torchport.models
    itself: a pickle naming them there still loads as a patched model."""
    import pickle

    from torchport.models import _held

    model = torchport.patch(build("llama"))
    for name in ("_Forward", "_Recipe", "_Record", "_restore_record"):
        monkeypatch.setattr(getattr(_held, name), "__module__", "torchport.models")
    data = pickle.dumps(model)
    monkeypatch.undo()
    assert b"torchport.models._held" not in data and b"_restore_record" in data
    twin = pickle.loads(data)
    _assert_patched_copy(twin, model, batch(torch.device("cpu")))
    torchport.unpatch(twin)
    torchport.unpatch(model)
    assert not torchport.models.is_patched()


def test_patched_forward_keeps_the_signature():
    import inspect

    base = build("gemma")
    model = torchport.patch(to_device(base, torch.device("cpu"), torch.float32))
    assert inspect.signature(model.forward) == inspect.signature(base.forward)  # what HF's generate/Trainer read
    assert len(inspect.signature(model.model.norm.forward).parameters) == 1  # bound: no self
    assert "torchport" in repr(model.model.norm.forward)


def test_saved_patched_model_loads_patched_in_a_new_process(tmp_path):
    """torch.save in this process, torch.load in a fresh one: the loaded model runs the kernels there (rope
    included, which lives in transformers' module) and gives the same loss."""
    import subprocess
    import sys

    model = torchport.patch(build("llama"))
    inputs = batch(torch.device("cpu"))
    torch.save({"model": model, "inputs": inputs, "loss": model(**inputs).loss.detach()}, tmp_path / "patched.pt")
    script = (
        "import sys, torch\n"
        "import transformers.models.llama.modeling_llama as llama\n"
        "rope = llama.apply_rotary_pos_emb\n"
        f"saved = torch.load({str(tmp_path / 'patched.pt')!r}, weights_only=False)\n"
        "import torchport\n"
        "model = saved['model']\n"
        "out = model(**saved['inputs'])\n"
        "assert torchport.models.is_patched(model) and out.logits is None\n"
        "assert llama.apply_rotary_pos_emb is not rope\n"
        "torch.testing.assert_close(out.loss, saved['loss'])\n"
        "torchport.unpatch(model)\n"
        "assert llama.apply_rotary_pos_emb is rope\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stderr[-2000:]
