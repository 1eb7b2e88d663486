"""The shim's torch.cuda device queries on an Ascend chip: integer major/minor whose "major >= 8" answers whether the
chip computes in bfloat16, multi_processor_count from the vector cores, torch_npu's own fields kept."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch

import torchport
import torchport.compat as compat
from torchport.backends import get_backend
from torchport.compat.cuda_api import DeviceProperties
from torchport.kernels.triton import _multiprocessor_count
from torchport.testing import simulated_chip


@pytest.fixture
def sim_npu(npu: torch.device) -> torch.device:
    """The simulated NPU (these tests change its chip), with the shim installed on it."""
    if not torchport.testing.is_simulating():
        pytest.skip("changes the simulated chip; this NPU is a real one")
    compat.patch(npu)
    yield npu
    compat.unpatch()


@pytest.mark.parametrize(("soc", "capability", "cores"), [
    ("Ascend910B3", (8, 0), 40),     # A2: bfloat16, 40 vector cores
    ("Ascend910_9392", (8, 0), 48),  # A3
    ("Ascend310P3", (7, 0), 7),      # no bfloat16
    ("Ascend910A", (7, 0), 32),      # no bfloat16, no separate vector cores: the AI cores
])
def test_cuda_code_reads_integers_that_answer_as_the_chip(sim_npu: torch.device, soc: str,
                                                          capability: tuple[int, int], cores: int) -> None:
    with simulated_chip(soc) as chip, warnings.catch_warnings():
        warnings.simplefilter("error")  # torch_npu's "no CUDA capability" warning is not passed on
        assert torch.npu.get_device_properties(0).major is None  # torch_npu's own: never set
        props = torch.cuda.get_device_properties(0)
        assert (props.major, props.minor) == capability == torch.cuda.get_device_capability(0)
        assert (props.major >= 8) == chip.bf16 == torch.cuda.is_bf16_supported()  # the common CUDA idiom
        assert props.multi_processor_count == cores and props.name == soc
        assert props.total_memory == torch.npu.get_device_properties(0).total_memory > 0
        assert (props.cube_core_num, props.vector_core_num) == (chip.ai_cores, chip.vector_cores)  # torch_npu's
        assert f"major={capability[0]}" in repr(props)
        with pytest.raises(AttributeError, match="no_such_field"):
            props.no_such_field  # noqa: B018


def test_a_capability_set_for_torch_npu_is_the_answer(sim_npu: torch.device, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_NPU_DEVICE_CAPABILITY", "9.0")  # torch_npu's own variable (26.x releases)
    with simulated_chip("Ascend310P3"):
        assert torch.cuda.get_device_capability() == (9, 0)
        assert (torch.cuda.get_device_properties(0).major, torch.cuda.get_device_properties(0).minor) == (9, 0)


def _release_7_3(real):  # noqa: ANN001, ANN202
    """torch.npu.get_device_properties of a torch_npu 7.3.0 release: multi_processor_count declared, left None."""

    def props(device=None):  # noqa: ANN001, ANN202
        found = real(device)
        return found._replace(multi_processor_count=None)

    return props


def test_an_unset_multi_processor_count_is_the_vector_cores(sim_npu: torch.device, monkeypatch) -> None:
    with simulated_chip("Ascend310P3") as chip:
        monkeypatch.setattr(torch.npu, "get_device_properties", _release_7_3(torch.npu.get_device_properties))
        assert torch.npu.get_device_properties(0).multi_processor_count is None
        assert get_backend("npu").properties(0)["multi_processor_count"] == chip.vector_cores == 7
        assert torch.cuda.get_device_properties(0).multi_processor_count == 7
        assert _multiprocessor_count.__wrapped__("npu", 0) == 7  # Triton's persistent grids
    with simulated_chip("Ascend910A"):  # no separate vector cores: the AI cores, as torch_npu's 26.x releases say
        assert get_backend("npu").properties(0)["multi_processor_count"] == 32


def test_properties_that_already_answer_pass_through(monkeypatch) -> None:
    fields = "name total_memory major minor multi_processor_count"
    cuda_like = collections.namedtuple("Props", fields)("GPU", 1, 9, 0, 132)
    from torchport.compat.cuda_api import _cuda_like

    assert _cuda_like(cuda_like) and not _cuda_like(cuda_like._replace(major=None))
    assert not _cuda_like(cuda_like._replace(multi_processor_count=None))
    props = DeviceProperties(None, "cpu", 0, 7, 0, 4)
    with pytest.raises(AttributeError):
        props.cube_core_num  # noqa: B018 - nothing to forward to


def test_the_host_target_has_properties_too() -> None:
    compat.patch("cpu")
    try:
        props = torch.cuda.get_device_properties(0)
        assert isinstance(props.major, int) and isinstance(props.minor, int) and props.multi_processor_count >= 1
        assert props.total_memory > 0
    finally:
        compat.unpatch()


def _outcome(ask) -> tuple[str, object]:  # noqa: ANN001
    try:
        props, capability = ask()
    except Exception as exc:  # noqa: BLE001 - the kind of failure is what is compared
        return "raises", type(exc)
    # a properties object is made anew for each call: compare what it says
    return "answer", (props.name, props.major, props.minor, props.multi_processor_count, capability)


def test_torch_itself_hears_the_truth_about_cuda_devices() -> None:
    """Inductor builds its cache key from ``torch.cuda.get_device_properties(current_device())`` on every machine,
    catching the error a build without CUDA raises; given the shim's answer instead, it read a ROCm field and failed
    to compile anything under ``torchport run`` on the CPU. Inductor's frames get CUDA's own answer (or error), the
    program the target's."""
    source = ("def ask():\n"  # Inductor's own expression, and the capability
              "    props = torch.cuda.get_device_properties(torch.cuda.current_device())\n"
              "    return props, torch.cuda.get_device_capability(0)")
    inductor = {"__name__": "torch._inductor.codecache", "torch": torch}
    exec(source, inductor)
    program = {"__name__": "__main__", "torch": torch}
    exec(source, program)
    truth = _outcome(inductor["ask"])
    compat.patch("cpu")
    try:
        assert _outcome(inductor["ask"]) == truth
        props, capability = program["ask"]()
        assert capability == (props.major, props.minor) and props.multi_processor_count >= 1
    finally:
        compat.unpatch()


def test_a_compiled_program_sees_what_the_eager_one_sees(device: torch.device) -> None:
    """dynamo calls the device queries a traced program makes from its own frames: they must answer as they answer
    the program, not as they answer Inductor."""
    def capability(x: torch.Tensor) -> torch.Tensor:
        major, minor = torch.cuda.get_device_capability()
        return x * (10 * major + minor) + torch.cuda.get_device_properties(0).multi_processor_count

    if device.type == "cuda":
        pytest.skip("on CUDA the shim has nothing to redirect")
    if get_backend("cuda").is_available():
        pytest.skip("not verified beside a real CUDA device (one run on an H200 with torch 2.11 failed, cause not "
                    "determined)")
    compat.patch(device)
    try:
        x = torch.ones(2, device="cuda")
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(capability, backend="eager")(x), capability(x))
    finally:
        torch._dynamo.reset()
        compat.unpatch()
