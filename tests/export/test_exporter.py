"""torchport.export.onnx: a CNN and a tiny Llama exported on CPU and checked in onnxruntime; dynamic batch at 1, 3
and 8; fp16; models that cannot be exported; a missing extra."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from torchport import export  # noqa: E402

import export_targets as targets  # noqa: E402


def _run_at(path: str, model: torch.nn.Module, make, sizes=(1, 3, 8)) -> None:
    """The exported file agrees with PyTorch at each batch size."""
    sess = export.session(path, "cpu")
    model.eval()
    for size in sizes:
        _, inputs = make(batch_size=size)
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        feeds = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}
        got = sess.run(None, feeds)[0]
        with torch.no_grad():
            expected = model(*args).numpy()
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_cnn_at_an_ascend_opset_with_a_dynamic_batch(tmp_path) -> None:
    model, x = targets.cnn()
    model.train()
    path = str(tmp_path / "cnn.onnx")
    report = export.onnx(model, x, path, opset=13, dynamic_batch=True)
    assert report.ok and report.opset == 13 and "TorchScript" in report.exporter
    assert [(i.name, i.shape, i.dynamic_batch) for i in report.inputs] == [("input", (2, 3, 16, 16), True)]
    assert report.outputs == ("output",) and report.provider == "CPUExecutionProvider"
    assert [c.batch_size for c in report.checks] == [2, 3] and report.max_abs_error < 1e-5
    assert model.training  # the caller's model is put back as it was
    _run_at(path, model, targets.cnn)
    assert export.graph_inputs(path) == [("input", (-1, 3, 16, 16))]
    assert "opset 13" in str(report) and report.to_dict()["ok"]


def test_cnn_in_fp16(tmp_path) -> None:
    model, x = targets.cnn()
    report = export.onnx(model, x, tmp_path / "cnn16.onnx", opset=15, dtype="fp16", input_names=["image"],
                         output_names=["scores"])
    assert report.ok and report.dtype == "float16" and report.rtol == export.TOLERANCES[torch.float16][0]
    assert report.inputs[0].name == "image" and report.outputs == ("scores",)
    assert next(model.parameters()).dtype == torch.float32  # exported from a copy


def test_tiny_llama_logits_dynamic_batch(tmp_path) -> None:
    pytest.importorskip("transformers")
    model, inputs = targets.llama()
    path = str(tmp_path / "llama.onnx")
    report = export.onnx(model, inputs, path, opset=14, dynamic_batch=True)
    assert report.ok, str(report)
    assert [i.name for i in report.inputs] == ["input_ids", "attention_mask"]  # the forward's argument names
    _run_at(path, model, targets.llama)


def test_tiny_llama_with_the_torch_export_based_exporter(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    model, inputs = targets.llama(batch_size=1)  # a batch of one is traced with two rows to keep the axis dynamic
    path = str(tmp_path / "llama18.onnx")
    report = export.onnx(model, {"input_ids": inputs[0], "attention_mask": inputs[1]}, path, opset=18,
                         dynamic_batch=True)
    assert report.ok and report.opset == 18 and "torch.export" in report.exporter
    _run_at(path, model, targets.llama)


def test_an_operator_the_exporter_lacks_is_named(tmp_path) -> None:
    model, x = targets.unsupported_op()
    with pytest.raises(export.ExportError, match=r"TorchScript-based exporter.*opset 13.*aten::diff.*opset 18"):
        export.onnx(model, x, tmp_path / "diff.onnx", opset=13)


def test_value_dependent_control_flow_is_named(tmp_path) -> None:
    pytest.importorskip("onnxscript")
    model, x = targets.value_branch()
    with pytest.raises(export.ExportError, match=r"torch.export-based exporter.*x.sum\(\) > 0"):
        export.onnx(model, x, tmp_path / "branch.onnx", opset=18)


def test_tracer_warnings_become_notes(tmp_path) -> None:
    model, x = targets.value_branch()
    report = export.onnx(model, x, tmp_path / "branch.onnx", opset=13)
    assert report.ok and any("tracer fixed a value" in note for note in report.notes)


def test_over_tolerance_is_reported_not_raised(tmp_path) -> None:
    model, x = targets.cnn()
    report = export.onnx(model, x, tmp_path / "cnn.onnx", opset=13, rtol=0, atol=0)
    assert not report.ok and report.rel_error > 0


@pytest.mark.parametrize("kwargs, message", [
    ({"opset": 9}, "opset=9 is not supported"),
    ({"dtype": "bf16"}, "valid: fp32, fp16"),
    ({"input_names": ["a", "b"]}, "input_names has 2 name(s)"),
    ({"output_names": ["y", "y"]}, "output_names has 2"),
    ({"rtol": -1}, "rtol=-1 is not a tolerance"),
])
def test_bad_arguments(tmp_path, kwargs, message) -> None:
    model, x = targets.cnn()
    with pytest.raises(ValueError) as info:
        export.onnx(model, x, tmp_path / "m.onnx", **kwargs)
    assert message in str(info.value)


def test_missing_onnx_names_the_extra(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnx", None)
    model, x = targets.cnn()
    with pytest.raises(ImportError, match=r'pip install "torchport\[export\]"'):
        export.onnx(model, x, tmp_path / "m.onnx")


def test_session_falls_back_to_cpu_with_one_warning(npu, tmp_path, caplog, monkeypatch) -> None:
    model, x = targets.cnn()
    path = str(tmp_path / "cnn.onnx")
    export.onnx(model, x, path, opset=13)
    monkeypatch.setattr("torchport.export.runtime._warned", set())
    with caplog.at_level(logging.WARNING, logger="torchport"):
        first = export.session(path, npu, precision_mode="force_fp16")
        export.session(path, npu)
    assert first.get_providers()[0] == "CPUExecutionProvider"
    warnings = [r.getMessage() for r in caplog.records if "CANNExecutionProvider" in r.getMessage()]
    assert len(warnings) == 1 and "onnxruntime-cann" in warnings[0]


def test_provider_options_are_checked(npu) -> None:
    from torchport.backends import get_backend
    from torchport.export.runtime import device_providers

    backend = get_backend("npu")
    name, options = device_providers(backend, 0, {"precision_mode": "must_keep_origin_dtype"})[0]
    assert name == "CANNExecutionProvider" and options["device_id"] == 0
    assert options["precision_mode"] == "must_keep_origin_dtype" and options["op_select_impl_mode"]
    with pytest.raises(ValueError, match="no option 'precision'"):
        device_providers(backend, 0, {"precision": "fp16"})
    with pytest.raises(ValueError, match="valid: force_fp32"):
        device_providers(backend, 0, {"precision_mode": "fp16"})
    with pytest.raises(ValueError, match="takes no provider options"):
        export.providers("cpu", device_id=0)
    assert device_providers(get_backend("cuda"), 1, {})[0] == ("CUDAExecutionProvider", {"device_id": 1})
