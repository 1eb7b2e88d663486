"""torchport.enable / disable: what each mode changes (the report says exactly that), that disable puts the model and
the process back exactly, and the errors for bad input."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import torchport
from torchport import attention, models, modes
from torchport.backends import get_backend

transformers = pytest.importorskip("transformers")


def _config(**overrides: object) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64,
                                    pad_token_id=0, tie_word_embeddings=True, **overrides)


def _llama(**overrides: object) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(**overrides), attn_implementation="sdpa").eval()


def _on(model: nn.Module, device: torch.device) -> nn.Module:
    """A copy on ``device`` with its embeddings tied again (the simulated npu's Module.to unties them)."""
    model = copy.deepcopy(model).to(device)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _state(model: nn.Module) -> dict:
    """Everything enable may touch on a model, as comparable values."""
    named = dict(model.named_parameters(remove_duplicate=False))
    tensors = {name: (t.dtype, t.device, t.requires_grad, isinstance(t, nn.Parameter), t.detach().cpu().clone())
               for name, t in [*named.items(), *model.named_buffers(remove_duplicate=False)]}
    sharing = {name: sorted(other for other, u in named.items() if u is t) for name, t in named.items()}
    configs = [model.config] + [m.config for m in model.modules() if hasattr(m, "config")]
    return {
        "tensors": tensors,
        "sharing": sharing,
        "modules": [(name, type(m), id(m)) for name, m in model.named_modules()],
        "instance attributes": {name: {k: v for k, v in vars(m).items()
                                       if k not in ("_parameters", "_buffers", "_modules")}
                                for name, m in model.named_modules()},
        "hooks": {name: (list(m._forward_hooks), list(m._forward_pre_hooks)) for name, m in model.named_modules()},
        "attention": [c._attn_implementation for c in configs],
        "patched": models.is_patched(model),
    }


def _same(a: dict, b: dict) -> None:
    assert a["tensors"].keys() == b["tensors"].keys()
    for name, (dtype, device, grad, param, value) in a["tensors"].items():
        other = b["tensors"][name]
        assert (dtype, device, grad, param) == other[:4], name
        assert torch.equal(value, other[4]), name
    for key in ("sharing", "modules", "hooks", "attention", "patched"):
        assert a[key] == b[key], key
    assert a["instance attributes"].keys() == b["instance attributes"].keys()
    for name, attrs in a["instance attributes"].items():
        assert attrs.keys() == b["instance attributes"][name].keys(), name


def _process_state() -> dict:
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.models.llama import modeling_llama

    return {
        "check": PreTrainedModel.__dict__["_check_and_adjust_attn_implementation"],
        "from_pretrained": PreTrainedModel.__dict__["from_pretrained"],
        "llama": [modeling_llama.LlamaRMSNorm.__dict__.get("forward"), modeling_llama.LlamaMLP.__dict__.get("forward"),
                  modeling_llama.LlamaForCausalLM.__dict__.get("forward"), modeling_llama.apply_rotary_pos_emb],
        "families": models.patched_families(),
        "hook": attention.hook_installed(),
        "attention functions": dict(AttentionInterface._global_mapping),
        "tf32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                 torch.get_float32_matmul_precision()),
    }


@pytest.fixture(autouse=True)
def no_mode_left():
    attention.register()  # a name transformers keeps: registered once per process, not a switch of a mode
    before = _process_state()
    yield
    leftover = modes.active()
    torchport.disable()
    assert leftover is None, f"a test left {leftover.mode!r} mode enabled"
    assert _process_state() == before


# -- TORCHPORT_MODE --------------------------------------------------------------------------------------------------
def test_torchport_mode_setting(monkeypatch) -> None:
    assert torchport.settings.value("mode") is None
    monkeypatch.setenv("TORCHPORT_MODE", " Speed ")
    assert torchport.settings.value("mode") == "speed"
    monkeypatch.setenv("TORCHPORT_MODE", "fast")
    with pytest.raises(ValueError, match="TORCHPORT_MODE='fast' is not a mode; valid values: speed, balanced, memory"):
        torchport.settings.value("mode")
    with torchport.settings.override(mode="memory"):
        assert torchport.settings.get().mode == "memory"


def test_enable_reads_torchport_mode(monkeypatch) -> None:
    with pytest.raises(ValueError, match="no mode given and TORCHPORT_MODE is not set; modes: speed, balanced, memory"):
        torchport.enable()
    monkeypatch.setenv("TORCHPORT_MODE", "balanced")
    report = torchport.enable()
    assert report.mode == "balanced" and report.target == "process" and modes.active() is report
    assert torchport.disable() is report and modes.active() is None


# -- a model on each device ------------------------------------------------------------------------------------------
def test_balanced_changes_dtype_kernels_attention_and_disable_restores(device: torch.device) -> None:
    model = _on(_llama(), device)
    before = _state(model)
    best_dtype = get_backend(device.type).preferred_dtype(device.index or 0)
    ids = torch.tensor([[3, 8, 20, 41, 5, 9, 77]], device=device)
    with torch.no_grad():
        expected = model(ids).logits

    with torchport.settings.override(device=device.type):  # the device the model runs on
        report = torchport.enable("balanced", model)
    rows = {row.setting: row for row in report.rows}
    assert [row.setting for row in report.rows] == ["dtype", "attention", "kernels"]
    assert rows["dtype"].after == str(best_dtype).removeprefix("torch.")
    assert rows["dtype"].changed == (best_dtype != torch.float32)
    assert rows["attention"].after == attention.best(device) == model.config._attn_implementation
    assert rows["kernels"].changed and models.is_patched(model)
    assert {p.dtype for p in model.parameters()} == {best_dtype}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # a non-persistent buffer keeps its precision
    with torch.no_grad():
        got = model(ids).logits
    assert _rel(got, expected) < (1e-5 if best_dtype == torch.float32 else 5e-2)

    assert torchport.disable() is report
    _same(before, _state(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_a_host_model_gets_its_own_tensors_back() -> None:
    model = _llama()
    originals = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    torchport.enable("memory", model)
    torchport.disable()
    assert {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}.keys() == originals.keys()
    assert all(t is originals[name] for name, t in [*model.named_parameters(), *model.named_buffers()])


def test_memory_mode_low_bit_checkpointing_placement_and_disable(device: torch.device) -> None:
    pytest.importorskip("torchport.quant")
    host = _llama()
    model = _on(host, device)
    before = _state(model)
    with torchport.settings.override(device=device.type):  # the device the model runs on
        report = torchport.enable("memory", model)
    rows = {row.setting: row for row in report.rows}
    quantized = torchport.quant.quantized_modules(model)
    assert rows["low-bit weights"].changed and len(quantized) == 14  # 7 per layer; lm_head stays dense
    assert "lm_head" not in " ".join(quantized) and type(model.lm_head) is nn.Linear
    assert rows["activation checkpointing"].after == "on" and model.model.gradient_checkpointing
    assert rows["placement"].changed is False
    ids = torch.tensor([[3, 8, 20, 41, 5, 9]], device=device)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    model.train()  # a training step through low-bit layers and checkpointed blocks: gradients reach the embedding
    model(input_ids=ids, labels=ids).loss.backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    model.eval()
    torchport.disable()
    _same(before, _state(model))
    assert not model.model.gradient_checkpointing


def test_memory_mode_moves_a_host_model_to_the_device(npu: torch.device) -> None:
    pytest.importorskip("torchport.quant")
    model = _llama()
    before = _state(model)
    report = torchport.enable("memory", model, device=npu)
    rows = {row.setting: row for row in report.rows}
    assert report.device == "npu:0" and rows["placement"].after == "npu:0" and "fit the budget" in rows["placement"].note
    assert rows["attention"].after == "npu_fusion_attention"  # chosen for where the model runs, not where it was
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"npu"}
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[3, 4, 5]], device=npu)).logits).all()
    torchport.disable()
    _same(before, _state(model))


class _Stack(nn.Module):
    """Four blocks of an odd width (33: no low-bit group fits it, so the weights stay dense)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(33, 33), nn.LayerNorm(33)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_memory_mode_offloads_a_model_over_the_budget(npu: torch.device) -> None:
    model = _Stack()
    before = _state_plain(model)
    x = torch.randn(2, 33)
    dtype = get_backend("npu").preferred_dtype(0)
    with torch.no_grad():
        expected = model(x)
        resident = copy.deepcopy(model).to(npu, dtype)(x.to(npu, dtype)).cpu()  # what the offloaded model must give
    block = torchport.offload.find_blocks(copy.deepcopy(model).to(dtype)).block_bytes()[0]  # as offload lays it out
    with torchport.settings.override(device="npu"), pytest.warns(RuntimeWarning, match="not quantised"):
        report = torchport.enable("memory", model, budget=3 * block + 100)  # one block and two buffers
    rows = {row.setting: row for row in report.rows}
    assert rows["placement"].after == "npu:0, 3 of 4 blocks offloaded to the host", rows["placement"]
    assert "exceed the budget" in rows["placement"].note
    assert torchport.offload.placement(model) == {"blocks.0": "device", **{f"blocks.{i}": "host" for i in (1, 2, 3)}}
    with torch.no_grad():
        assert torch.equal(model(x.to(npu, dtype)).cpu(), resident)
    torchport.disable()
    assert "_torchport_offload" not in vars(model)
    assert _state_plain(model) == before
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def _state_plain(model: nn.Module) -> dict:
    return {"tensors": [(name, id(t), t.device) for name, t in [*model.named_parameters(), *model.named_buffers()]],
            "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
            "attributes": [sorted(vars(m)) for m in model.modules()]}


def test_memory_mode_checkpoints_the_blocks_of_any_model() -> None:
    model = _Stack()
    before = _state_plain(model)
    with torchport.settings.override(device="cpu"), pytest.warns(RuntimeWarning, match="not quantised"):
        report = torchport.enable("memory", model)
    assert "torch.utils.checkpoint around 4 blocks" in {r.setting: r for r in report.rows}["activation checkpointing"].note
    x = torch.randn(3, 33, requires_grad=True)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torchport.disable()
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    assert all(torch.allclose(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert _state_plain(model) == before


def test_speed_mode_compiles_a_model_that_compiles_cleanly(monkeypatch) -> None:
    # the torchport backend hands graphs to Inductor on the CPU; eager keeps this test fast
    monkeypatch.setattr(type(get_backend("cpu")), "dynamo_compiler", lambda self: ("eager", None))
    model = _llama()
    before = _state(model)
    ids = torch.tensor([[3, 8, 20, 41]])
    with torch.no_grad():
        expected = model(ids).logits
    report = torchport.enable("speed", model)
    rows = {row.setting: row for row in report.rows}
    assert rows["compile"].changed and model._compiled_call_impl is not None
    # the patched forwards stay in: the compiled graph calls torchport's custom ops
    assert rows["kernels"].changed and models.is_patched(model)
    assert rows["tf32"].note == "cpu has no TF32 here" and not rows["tf32"].changed
    with torch.no_grad():
        assert _rel(model(ids).logits, expected) < 1e-5
    torchport.disable()
    _same(before, _state(model))
    assert model._compiled_call_impl is None


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear(x).sum().item() > 1e9:  # data-dependent Python control flow: a graph break
            return x
        return self.linear(x)


def test_speed_mode_leaves_a_model_with_graph_breaks_eager() -> None:
    model = _Breaks()
    report = torchport.enable("speed", model, example=torch.randn(2, 4))
    row = {r.setting: r for r in report.rows}["compile"]
    assert not row.changed and "graph break" in row.note
    assert "_compiled_call_impl" not in vars(model)
    other = torchport.disable()
    assert other is report
    report = torchport.enable("speed", nn.Linear(4, 4))
    assert "give enable(..., example=inputs)" in {r.setting: r for r in report.rows}["compile"].note
    torchport.disable()


def test_cuda_tf32_switches_round_trip(monkeypatch) -> None:
    """The CUDA backend's TF32 switches, on any machine: set, then put back exactly."""
    backend = get_backend("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.get_float32_matmul_precision())
    previous = backend.enable_tf32(0)
    assert previous == {"torch.backends.cuda.matmul.allow_tf32": before[0], "torch.backends.cudnn.allow_tf32": before[1]}
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"
    backend.restore_tf32(previous)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision()) == before
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    assert backend.enable_tf32(0) is None  # no TF32 before Ampere
    with pytest.raises(ValueError, match="unknown TF32 switch"):
        backend.restore_tf32({"allow_everything": True})


# -- the process-wide part -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama")
    _llama().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("mode", ["balanced", "speed", "memory"])
def test_global_mode_reaches_models_built_later_and_disable_restores_the_process(mode: str, saved_llama: str) -> None:
    target = torchport.device()
    best = get_backend(target.type).preferred_dtype(target.index or 0)
    report = torchport.enable(mode)
    rows = {row.setting: row for row in report.rows}
    assert report.target == "process" and rows["transformers classes"].changed
    assert models.patched_families() == models.supported()
    assert attention.hook_installed() == {"default": True, "device": target}
    from transformers.models.llama import modeling_llama

    model = transformers.AutoModelForCausalLM.from_pretrained(saved_llama)
    assert model.config._attn_implementation == attention.best(target)
    expected_dtype = torch.float32 if (mode == "memory" and best == torch.float32) else best
    dense = [p.dtype for n, p in model.named_parameters()]
    assert set(dense) == {expected_dtype}
    assert isinstance(model.model.norm, modeling_llama.LlamaRMSNorm) and models.is_patched()
    if mode == "memory":
        quant = pytest.importorskip("torchport.quant")
        assert quant.quantized_modules(model) and model.model.gradient_checkpointing
        assert any(row.setting == "loaded LlamaForCausalLM" for row in report.rows)  # the report lists it
    explicit = transformers.AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.float16)
    assert explicit.lm_head.weight.dtype == torch.float16
    torchport.disable()
    # the model loaded during the mode keeps what it was built with
    assert model.config._attn_implementation == attention.best(target)


def test_global_mode_for_another_device_than_detected(npu: torch.device) -> None:
    report = torchport.enable("balanced", device="cpu")  # torchport run --device cpu on an accelerator machine
    assert report.device == "cpu" and attention.hook_installed() == {"default": True, "device": torch.device("cpu")}
    assert _llama_default().config._attn_implementation == "sdpa"
    torchport.disable()
    report = torchport.enable("balanced", device=npu)
    assert _llama_default().config._attn_implementation == "npu_fusion_attention"
    torchport.disable()
    with pytest.raises(ValueError, match="'gpu' is not a device type"):
        torchport.enable("balanced", device="gpu")


def _llama_default() -> nn.Module:
    return transformers.AutoModelForCausalLM.from_config(_config())


def test_global_mode_keeps_families_the_program_patched_itself() -> None:
    torchport.patch_transformers("llama")
    try:
        report = torchport.enable("balanced")
        assert "already patched: llama" in {r.setting: r for r in report.rows}["transformers classes"].note
        torchport.disable()
        assert models.patched_families() == ["llama"]
    finally:
        models.unpatch_transformers()


def test_global_mode_keeps_a_hook_the_program_installed() -> None:
    attention.install_hook(default=False)
    try:
        torchport.enable("balanced")
        assert attention.hook_installed() == {"default": True, "device": torchport.device()}
        torchport.disable()
        assert attention.hook_installed() == {"default": False, "device": None}
    finally:
        attention.remove_hook()


# -- reports and errors ----------------------------------------------------------------------------------------------
def test_report_table_and_dict() -> None:
    model = _llama()
    with torchport.settings.override(device="cpu"):
        report = torchport.enable("balanced", model)
    text = str(report)
    assert text.startswith("torchport balanced mode on cpu for LlamaForCausalLM: 1 change(s)")
    assert "*  kernels" in text and "-  dtype" in text and text.endswith("(* changed, - kept as it was)")
    data = report.to_dict()
    assert data["mode"] == "balanced" and data["target"] == "LlamaForCausalLM" and data["device"] == "cpu"
    assert [row["setting"] for row in data["rows"]] == ["dtype", "attention", "kernels"]
    assert report.changes == [r for r in report.rows if r.changed] and len(report.kept) == 2
    torchport.disable()


def test_bad_input_is_a_clear_error(npu: torch.device) -> None:
    model = _llama()
    with pytest.raises(ValueError, match="'fast' is not a mode; modes: speed, balanced, memory"):
        torchport.enable("fast", model)
    with pytest.raises(TypeError, match="must be an nn.Module, got dict"):
        torchport.enable("balanced", {"weights": 1})
    with pytest.raises(TypeError, match="not torch.compile's wrapper"):
        torchport.enable("speed", torch.compile(model))
    with pytest.raises(ValueError, match="example= is the input speed mode compiles"):
        torchport.enable("balanced", model, example=torch.ones(1, 2))
    with pytest.raises(ValueError, match="budget= is the device memory"):
        torchport.enable("memory", budget="1GiB")
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device .* load its weights first"):
        torchport.enable("balanced", meta)
    split = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(npu))
    with pytest.raises(ValueError, match=r"spread over cpu, npu:0; .* model.to\(torchport.device\(\)\)"):
        torchport.enable("balanced", split)
    assert modes.active() is None
    torchport.enable("balanced", model)
    with pytest.raises(RuntimeError, match="'balanced' is already enabled for LlamaForCausalLM; call "
                                           r"torchport.disable\(\) first"):
        torchport.enable("speed")
    torchport.disable()
    assert torchport.disable() is None  # nothing enabled: nothing to do


def test_a_failing_step_undoes_what_enable_did(monkeypatch) -> None:
    model = _llama()
    before = _state(model)
    process = _process_state()

    def broken(*args, **kwargs):
        raise RuntimeError("step failed")

    monkeypatch.setitem(modes.MODEL_STEPS, "balanced", (*modes.MODEL_STEPS["balanced"], broken))
    with pytest.raises(RuntimeError, match="step failed"):
        torchport.enable("balanced", model)
    assert modes.active() is None
    _same(before, _state(model))
    monkeypatch.setattr(modes.process, "step_from_pretrained", broken)
    with pytest.raises(RuntimeError, match="step failed"):
        torchport.enable("memory")
    assert _process_state() == process


def test_a_cpu_model_with_an_accelerator_present_is_noted(npu: torch.device) -> None:
    with torchport.settings.override(device="npu"), warnings.catch_warnings():
        report = torchport.enable("balanced", _llama())
    row = {r.setting: r for r in report.rows}["device"]
    assert not row.changed and "npu:0 is present: move the model there first" in row.note
    assert report.device == "cpu"
    torchport.disable()
