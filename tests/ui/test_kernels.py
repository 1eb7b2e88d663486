"""The Kernels tab's functions: the registry table and a short benchmark of one op against its reference."""

from __future__ import annotations

import pytest
import torch

from torchport.kernels import list_kernels
from torchport.kernels.registry import KernelError, list_specs
from torchport.ui import kernels
from torchport.ui.jobs import Cancelled, Job


def test_registry_rows_are_the_kernel_table(npu: torch.device) -> None:
    rows = kernels.registry_rows([torch.device("cpu"), npu])
    assert all(len(row) == len(kernels.HEADERS) for row in rows)
    assert {(row[0], row[1]) for row in rows} == {(op, dev) for op in list_kernels() for dev in ("cpu", "npu:0")}
    rms = {row[1]: row for row in rows if row[0] == "rms_norm"}
    assert rms["cpu"][2] == "reference"
    assert rms["npu:0"][2] == "npu" and rms["npu:0"][3].startswith("npu")
    assert all(row[4] not in ("", "-") for row in rows), [row for row in rows if row[4] in ("", "-")]
    assert rms["cpu"][4].startswith("reference is the only implementation for cpu")


def test_every_benchmarkable_op_is_registered_and_has_three_sizes() -> None:
    ops = kernels.benchmarkable_ops()
    assert {"rms_norm", "layer_norm", "rope", "swiglu", "geglu", "cross_entropy"} <= set(ops) <= set(list_kernels())
    for op in ops:
        assert [kernels.describe_size(op, size) for size in kernels.SIZES]
    assert kernels.describe_size("rms_norm", "small") == "rows × hidden 1024×1024"


@pytest.mark.parametrize("op", list(list_specs()))
def test_every_op_runs_forward_and_backward_on_the_cpu(op: str) -> None:
    for backward in (False, True):
        result = kernels.benchmark(Job(), op, "cpu", "float32", "small", backward, warmup=1, iters=2)
        assert result.timings[-1].implementation == "reference"
        assert all(t.result is not None and t.result.median_ms > 0 for t in result.timings), result.timings
        assert result.auto in [t.implementation for t in result.timings]


def test_the_npu_implementation_is_timed_against_the_reference(npu: torch.device) -> None:
    progress = []
    result = kernels.benchmark(Job(lambda value, desc: progress.append(desc)), "rms_norm", "npu:0", "float32",
                               "small", warmup=1, iters=3)
    assert [t.implementation for t in result.timings] == ["npu", "reference"]
    assert result.auto == "npu" and result.device == "npu:0" and result.shape == "rows × hidden 1024×1024"
    assert all(t.result.iters == 3 and t.result.timer == "device events" for t in result.timings)
    assert any("timing npu" in line for line in progress) and any("timing reference" in line for line in progress)
    rows = kernels.timing_rows(result)
    assert [row[0] for row in rows] == ["npu (auto)", "reference"]
    assert rows[1][4] == "1.00x" and rows[0][5].endswith("MiB")
    frame = kernels.bar_frame(result)
    assert frame["implementation"].tolist() == ["npu (auto)", "reference"]
    assert frame["kind"].tolist() == ["fused kernel", "reference"]
    assert frame["median ms"].tolist() == [t.result.median_ms for t in result.timings]
    assert "torchport picks **npu** here" in kernels.summary(result) and "Fastest" in kernels.summary(result)


def test_an_implementation_that_cannot_run_is_listed_with_the_reason(npu: torch.device,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real = kernels._step

    def step(op, args, backward, gen):  # noqa: ANN001, ANN202 - the private signature
        from torchport import settings

        if settings.value("kernels").get(op) == "npu":
            raise KernelError("rms_norm: the forced implementation 'npu' cannot run on npu: no npu_rms_norm")
        return real(op, args, backward, gen)

    monkeypatch.setattr(kernels, "_step", step)
    result = kernels.benchmark(Job(), "rms_norm", "npu:0", warmup=0, iters=1)
    assert result.timings[0].result is None and "no npu_rms_norm" in result.timings[0].error
    rows = kernels.timing_rows(result)
    assert rows[0][1] == "-" and rows[0][6].startswith("cannot run: ")
    assert kernels.bar_frame(result)["implementation"].tolist() == ["reference"]


@pytest.mark.parametrize(("args", "message"), [
    (("nope", "cpu"), "no benchmark inputs for op 'nope'"),
    (("rms_norm", "cpu", "float32", "huge"), "size 'huge' is not one of small, medium, large"),
    (("rms_norm", "cpu", "int8"), "dtype 'int8' is not one of"),
    (("rms_norm", "xpu:0"), "xpu"),
])
def test_bad_choices_are_errors_that_say_what_is_allowed(args: tuple, message: str) -> None:
    with pytest.raises((ValueError, RuntimeError), match=message):
        kernels.benchmark(Job(), *args)


def test_a_dtype_the_device_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchport.backends import get_backend

    monkeypatch.setattr(get_backend("cpu"), "dtype_works", lambda dtype, index, probe=None: dtype == torch.float32)
    with pytest.raises(ValueError, match="float16 does not work on cpu"):
        kernels.benchmark(Job(), "swiglu", "cpu", "float16")


def test_a_size_that_does_not_fit_is_refused_before_anything_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchport.backends import get_backend

    monkeypatch.setattr(get_backend("cpu"), "mem_get_info", lambda index: (2**30, 2**34))
    with pytest.raises(ValueError, match=r"cross_entropy large .* needs about 2\d\.\d GiB on cpu, which has 1\.0 GiB"):
        kernels.benchmark(Job(), "cross_entropy", "cpu", "float32", "large", True)


def test_a_cancel_stops_within_one_call() -> None:
    job = Job()
    calls = 0
    real = kernels._step

    def step(*args):  # noqa: ANN002, ANN202
        inner = real(*args)

        def counted():  # noqa: ANN202
            nonlocal calls
            calls += 1
            if calls == 3:
                job.cancel()
            return inner()
        return counted

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "_step", step)
        with pytest.raises(Cancelled):
            kernels.benchmark(job, "rms_norm", "cpu", warmup=2, iters=50)
    assert calls == 3
