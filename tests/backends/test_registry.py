import pytest

from torchport import backends
from torchport.backends import Backend, detect, get_backend, list_backends, register_backend


def test_builtins_in_detection_order() -> None:
    assert list_backends()[:5] == ["npu", "cuda", "xpu", "mps", "cpu"]


def test_unknown_type_names_what_exists() -> None:
    with pytest.raises(ValueError) as err:
        get_backend("gpu", source="TORCHPORT_DEVICE")
    assert str(err.value) == (
        "TORCHPORT_DEVICE='gpu' is not a device type; registered: " + ", ".join(list_backends())
    )


def test_register_rejects_duplicates_and_mismatched_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "_backends", backends._backends.copy())
    monkeypatch.setattr(backends, "_instances", dict(backends._instances))

    @register_backend("fakedev")
    class FakeBackend(Backend):
        name = "fakedev"

    assert "fakedev" in list_backends() and isinstance(get_backend("fakedev"), FakeBackend)
    with pytest.raises(ValueError, match="'fakedev' is already registered"):

        @register_backend("fakedev")
        class Other(Backend):
            name = "fakedev"

    with pytest.raises(ValueError, match="whose name is 'other'"):

        @register_backend("fakedev2")
        class Misnamed(Backend):
            name = "other"

    @register_backend("fakedev", replace=True)
    class Replacement(Backend):
        name = "fakedev"

    assert isinstance(get_backend("fakedev"), Replacement)


def test_npu_is_detected_before_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # On Ascend machines a CUDA->NPU shim makes torch.cuda.is_available() True: npu must win.
    for name in ("npu", "cuda"):
        b = get_backend(name)
        monkeypatch.setattr(b, "is_available", lambda: True)
        monkeypatch.setattr(b, "device_count", lambda: 1)
    assert detect().name == "npu"


def test_cpu_when_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list_backends():
        if name != "cpu":
            monkeypatch.setattr(get_backend(name), "is_available", lambda: False)
    assert detect().name == "cpu"


@pytest.mark.parametrize(
    ("name", "dist", "variable"),
    [("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES"), ("xpu", "xccl", "ZE_AFFINITY_MASK"), ("cpu", "gloo", None),
     ("mps", "gloo", None)],
)
def test_distributed_backend_and_visible_variable(name: str, dist: str, variable: str | None) -> None:
    b = get_backend(name)
    assert (b.dist_backend, b.visible_devices_variable) == (dist, variable)


def test_cuda_names_follow_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    b = get_backend("cuda")
    assert b.dist_backend == "nccl"
    monkeypatch.setattr(torch.version, "hip", None)
    assert b.visible_devices_variable == "CUDA_VISIBLE_DEVICES"
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert b.visible_devices_variable == "HIP_VISIBLE_DEVICES"
    assert "rocm_hip" in b.versions()


def test_preferred_conv_memory_format(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    assert get_backend("npu").preferred_conv_memory_format(0) == torch.contiguous_format
    assert get_backend("mps").preferred_conv_memory_format(0) == torch.contiguous_format
    onednn = torch.backends.mkldnn.is_available()
    expected = torch.channels_last if onednn else torch.contiguous_format
    assert get_backend("cpu").preferred_conv_memory_format(0) == expected
    with torch.backends.mkldnn.flags(enabled=False):
        assert get_backend("cpu").preferred_conv_memory_format(0) == torch.contiguous_format
    cuda = get_backend("cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert cuda.preferred_conv_memory_format(0) == torch.channels_last
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (6, 1))  # no Tensor Cores
    assert cuda.preferred_conv_memory_format(0) == torch.contiguous_format
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 4))
    assert cuda.preferred_conv_memory_format(0) == torch.contiguous_format
