"""What an Ascend chip runs of torchport, before you deploy to it: :func:`chip_coverage`.

For every torchport kernel, and for fused attention: the torch_npu fused operator its NPU path calls, whether the
chip runs that operator (torch_npu defines every operator on every chip; on a chip without a kernel for one the call
fails, so torchport takes the reference there), the dtypes the operator takes on that chip, and the documented limits
that send a call to the reference (or to SDPA) anyway. Then the dtypes the chip computes in, and where the aten
operators come from: torch_npu's operator list, with the operators it lacks run on the host unless
``TORCH_NPU_FALLBACK_CPU_DISABLE`` is set.

Everything comes from torchport's snapshots of torch_npu (``backends/data/torch_npu_contract.json``,
``ascend_chips.json``, ``compile/data/torch_npu_ops-<release>.txt``) and from the kernel registry, so any known chip
can be asked about on any machine, with or without an NPU. What it reports is auto mode's choice
(``TORCHPORT_KERNELS`` unset).

Example:
    >>> report = chip_coverage("Ascend310P3")
    >>> [(row.kernel, row.implementation) for row in report.kernels if not row.fused][:2]
    [('cross_entropy', 'reference'), ('fused_linear_cross_entropy', 'npu')]
    >>> report.lacks_dtypes
    [torch.bfloat16]
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..backends import get_backend
from ..backends.npu import (ChipProfile, NpuBackend, chip_profile, device_chip, npu_chip_profiles, operator_limits,
                            torch_npu_contract)
from ..kernels import registry

__all__ = ["ChipCoverage", "KernelRow", "chip_coverage", "chip_report", "resolve_chip", "vendor_operator"]

_DTYPE_ORDER = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class KernelRow:
    """How one torchport kernel (or ``"attention"``, transformers' attention) runs on a chip.

    Attributes:
        kernel: the kernel's name (``"rms_norm"``), or ``"attention"``.
        implementation: what auto mode runs there: the registry's implementation name (``"npu"``, ``"reference"``),
            or for attention the ``attn_implementation`` (``"npu_fusion_attention"``, ``"sdpa"``).
        operator: the torch_npu fused operator the NPU path calls, None when it calls none.
        fused: whether that operator runs on this chip (and so is what runs).
        dtypes: the dtypes the kernel computes in there: those the operator takes on this chip where it is fused,
            else those the chip computes in (the reference is PyTorch's own operators).
        reference_when: the documented limits of the operator that send a call to the reference (SDPA for
            attention) although the chip has the operator.
        note: why this implementation.
    """

    kernel: str
    implementation: str
    operator: str | None
    fused: bool
    dtypes: tuple[str, ...]
    reference_when: tuple[str, ...]
    note: str

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "dtypes": list(self.dtypes), "reference_when": list(self.reference_when)}


@dataclasses.dataclass
class ChipCoverage:
    """What one Ascend chip runs of torchport; see :func:`chip_coverage`."""

    chip: ChipProfile
    device: str | None  # "npu:0" where the chip is this machine's NPU (a simulated one says so), None when planned
    kernels: list[KernelRow]
    operators: dict[str, bool]  # every torch_npu operator of torchport's contract -> whether the chip runs it
    aten_source: str  # what lists torch_npu's aten operators: the dispatcher or a snapshot file
    host_fallback: bool  # whether torch_npu runs an aten operator it lacks on the host (else: it fails)

    @property
    def lacks_dtypes(self) -> list[torch.dtype]:
        """The floating dtypes torchport handles that the chip does not compute in (bfloat16 on 910A and 310P)."""
        return [getattr(torch, name) for name in _DTYPE_ORDER if getattr(torch, name) not in self.chip.dtypes]

    def dtypes(self) -> dict[str, bool]:
        """``{"float32": True, "float16": True, "bfloat16": False}``: whether the chip computes in each."""
        return {name: getattr(torch, name) in self.chip.dtypes for name in _DTYPE_ORDER}

    def dtype_note(self) -> str:
        """What code that uses a dtype the chip lacks meets there, and what torchport does about it."""
        if not self.lacks_dtypes:
            return "every floating dtype computes here; torchport prefers bfloat16"
        lacking = ", ".join(_name(d) for d in self.lacks_dtypes)
        return (f"no {lacking}: torch.npu.is_bf16_supported() is False and operators computing in it fail on "
                f"{self.chip.soc_version}; torchport prefers float16, autocast asked for {lacking} runs in float16 "
                f"under torchport run, and torch.cuda.get_device_capability() answers 7.0 there")

    def to_dict(self) -> dict[str, Any]:
        chip = self.chip
        return {
            "soc": chip.soc_version, "family": chip.family, "family_name": chip.family_name, "device": self.device,
            "ai_cores": chip.ai_cores, "vector_cores": chip.vector_cores,
            "multi_processor_count": chip.multi_processor_count, "memory_bytes": chip.memory_bytes,
            "dtypes": self.dtypes(), "dtype_note": self.dtype_note(),
            "kernels": [row.to_dict() for row in self.kernels], "operators": dict(self.operators),
            "aten": {"source": self.aten_source, "host_fallback": self.host_fallback, "note": self.aten_note()},
        }

    def aten_note(self) -> str:
        if self.host_fallback:
            return ("an aten operator torch_npu lacks runs on the host (torch_npu warns once per operator); "
                    "TORCH_NPU_FALLBACK_CPU_DISABLE=1 makes it an error")
        return ("an aten operator torch_npu lacks fails here: the host fallback is off (TORCH_NPU_FALLBACK_CPU_DISABLE "
                "is set, or the NPU is simulated without it)")

    def tables(self) -> list[Any]:
        """The chip, its dtypes and the kernels as ``rich`` renderables."""
        from rich.table import Table

        chip = self.chip
        where = self.device or "planned from torchport's snapshots"
        facts = Table(title=f"{chip.soc_version} ({chip.family}: {chip.family_name}; {where})", show_header=False)
        facts.add_column("what", no_wrap=True)
        facts.add_column("value", overflow="fold")
        facts.add_row("cores", f"{chip.ai_cores} AI cores, {chip.vector_cores} vector cores "
                               f"(multi_processor_count {chip.multi_processor_count})")
        facts.add_row("memory", f"{chip.memory_bytes / 2**30:.1f} GiB")
        facts.add_row("dtypes", ", ".join(f"{name} {'yes' if ok else '[red]no[/]'}" for name, ok in
                                          self.dtypes().items()) + f"; {self.dtype_note()}")
        facts.add_row("aten operators", f"{self.aten_source}; {self.aten_note()}")
        lacking = [op for op, runs in self.operators.items() if not runs]
        facts.add_row("torch_npu operators", f"{', '.join(op for op, runs in self.operators.items() if runs)}"
                                             + (f"; [yellow]not on this chip[/]: {', '.join(lacking)}" if lacking
                                                else ""))
        kernels = Table(title=f"torchport kernels on {chip.soc_version} (auto mode)")
        for column in ("kernel", "runs as", "torch_npu operator", "dtypes", "reference when", "note"):
            kernels.add_column(column, overflow="fold")
        for row in self.kernels:
            runs = f"[green]{row.implementation}[/]" if row.fused else f"[yellow]{row.implementation}[/]"
            kernels.add_row(row.kernel, runs, row.operator or "-", ", ".join(row.dtypes),
                            "; ".join(row.reference_when) or "-", row.note)
        return [facts, kernels]

    def print(self, file: Any = None) -> None:
        """Print :meth:`tables` (stdout by default)."""
        from rich.console import Console

        console = Console(file=file or sys.stdout, width=160)
        for table in self.tables():
            console.print(table)


def resolve_chip(device: str, soc: str | None) -> ChipProfile | None:
    """The chip to report on for device type ``device``: ``soc`` when given, else that of this machine's (or the
    simulated) ``npu:0``, else None.

    Raises:
        ValueError: ``soc`` for a device type that is not an Ascend NPU, or a chip torchport does not know (the
            message lists the known ones).

    Example:
        >>> resolve_chip("npu", "ascend310p3").soc_version
        'Ascend310P3'
    """
    backend = get_backend(device, source="device")
    if not isinstance(backend, NpuBackend):
        if soc is not None:
            raise ValueError(f"--soc names an Ascend chip, which only --device npu has; {device!r} has none "
                             f"(known chips: {', '.join(npu_chip_profiles())})")
        return None
    if soc is not None:
        return chip_profile(soc)
    return _present_chip(backend)


def chip_report(device: str, soc: str | None = None) -> ChipCoverage:
    """The chip report ``torchport coverage --device DEVICE [--soc CHIP]`` prints without a model: that of ``soc``,
    else of the NPU present.

    Raises:
        ValueError: ``device`` is not an Ascend NPU (``"npu"``), ``soc`` is no known chip, or no chip is named and
            none is present; each message says what to write instead.

    Example:
        >>> chip_report("npu", "Ascend910B3").operators["npu_swiglu"]
        True
    """
    from .._settings import parse_device_spec

    kind = parse_device_spec(device, "--device")[0]
    chip = resolve_chip(kind, soc)
    if chip is None and not isinstance(get_backend(kind), NpuBackend):
        raise ValueError(f"TARGET is required with --device {kind}; without a model, torchport coverage reports on "
                         f"an Ascend chip: --device npu --soc CHIP")
    return chip_coverage(chip)


def _present_chip(backend: NpuBackend) -> ChipProfile | None:
    if not backend.is_available() or backend.device_count() < 1:
        return None
    return device_chip(backend.device(0))


def chip_coverage(soc: str | ChipProfile | None = None) -> ChipCoverage:
    """What chip ``soc`` runs of torchport: each kernel's torch_npu operator and whether the chip has it, the
    dtypes, the limits that send calls to the reference, and where aten operators come from.

    Args:
        soc: the chip, as torch_npu names it (``"Ascend310P3"``, any case; see
            :func:`torchport.backends.npu.npu_chip_profiles`), or a profile; None: this machine's NPU (``npu:0``,
            real or simulated).

    Raises:
        ValueError: an unknown chip (the message lists the known ones), or None with no NPU here.

    Example:
        >>> chip_coverage("Ascend910A").operators["npu_swiglu"]
        False
    """
    backend = get_backend("npu")
    present = _present_chip(backend)  # type: ignore[arg-type]
    if soc is None:
        if present is None:
            raise ValueError(f"no Ascend NPU here to report on: name a chip (--soc); known: "
                             f"{', '.join(npu_chip_profiles())}")
        chip = present
    else:
        chip = soc if isinstance(soc, ChipProfile) else chip_profile(soc)
    device = None
    if present is not None and present.soc_version == chip.soc_version:
        device = str(backend.device(0)) + (" (simulated)" if backend.versions().get("simulated") else "")
    from .coverage_target import target_source

    source, listed = target_source(backend)
    if listed is not None:
        source = f"{source}: {listed} operator overloads with torch_npu's own kernels"
    contract = torch_npu_contract()
    return ChipCoverage(chip, device, _kernel_rows(chip), {op: op in chip.ops for op in contract}, source,
                        bool(backend.host_fallback))


# -- the kernels ---------------------------------------------------------------------------------------------------
def vendor_operator(impl: registry.Implementation) -> str | None:
    """The vendor fused operator an implementation requires (``registry.fused_op_reason``), or None."""
    requires = impl.requires
    if isinstance(requires, functools.partial) and requires.func is registry.fused_op_unavailable:
        return str(requires.args[0])
    return None


def _kernel_rows(chip: ChipProfile) -> list[KernelRow]:
    rows = []
    for kernel, names in sorted(registry.list_kernels().items()):
        serving = [registry.implementation(kernel, name) for name in names]
        rows.append(_kernel_row(kernel, [impl for impl in serving if impl.serves(NpuBackend.name)], chip))
    rows.extend(_attention_rows(chip))
    return rows


def _kernel_row(kernel: str, serving: list[registry.Implementation], chip: ChipProfile) -> KernelRow:
    skipped: list[tuple[str, str]] = []  # (operator, why the chip does not run it)
    for impl in serving:  # highest priority first
        operator = vendor_operator(impl)
        if operator is not None:
            lacks = chip.lacks(operator)
            if lacks is None:
                return KernelRow(kernel, impl.name, operator, True, _operator_dtypes(operator, chip),
                                 tuple(_REFERENCE_WHEN[operator](operator_limits(operator), chip)),
                                 f"torch_npu.{operator}")
            skipped.append((operator, _documented_for(operator)))
            continue
        if impl.requires is not None:  # a requirement only the device itself can answer: never taken offline
            continue
        chip_dtypes = tuple(name for name in _DTYPE_ORDER if getattr(torch, name) in chip.dtypes)
        if skipped:
            operator, families = skipped[0]
            return KernelRow(kernel, impl.name, operator, False, chip_dtypes, (),
                             f"not on {chip.family}: torch_npu documents {operator} for {families} only; "
                             f"PyTorch operators here")
        what = ("no NPU implementation: PyTorch operators, which torch_npu runs" if impl.name == "reference"
                else f"torchport's {impl.name} implementation: PyTorch operators, no torch_npu fused operator")
        return KernelRow(kernel, impl.name, None, False, chip_dtypes, (), what)
    raise AssertionError(f"kernel {kernel!r} has no reference")  # pragma: no cover - the registry requires one


def _attention_rows(chip: ChipProfile) -> list[KernelRow]:
    from ..attention import FUSED

    rows = []
    for operator in FUSED:
        if operator not in torch_npu_contract():
            continue
        if chip.lacks(operator) is None:
            rows.append(KernelRow("attention", operator, operator, True, _operator_dtypes(operator, chip),
                                  tuple(_REFERENCE_WHEN[operator](operator_limits(operator), chip)),
                                  f"torch_npu.{operator}, registered with transformers by torchport.attention"))
        else:
            chip_dtypes = tuple(name for name in _DTYPE_ORDER if getattr(torch, name) in chip.dtypes)
            rows.append(KernelRow("attention", "sdpa", operator, False, chip_dtypes, (),
                                  f"not on {chip.family}: torch_npu documents {operator} for "
                                  f"{_documented_for(operator)} only; torchport.attention.best() answers sdpa"))
    return rows


def _documented_for(operator: str) -> str:
    return ", ".join(torch_npu_contract()[operator]["families"])


def _operator_dtypes(operator: str, chip: ChipProfile) -> tuple[str, ...]:
    """The dtypes torchport's call of ``operator`` computes in on ``chip``, by its documented limits."""
    limits = operator_limits(operator)
    if "dtype_pairs" in limits:  # npu_rms_norm: (x, gamma) pairs; torchport passes gamma in x's dtype
        names = {x for x, gamma in limits["dtype_pairs"].get(chip.family, []) if x == gamma}
    elif "x_dtypes" in limits:  # npu_weight_quant_batchmatmul: the activations'
        names = set(limits["x_dtypes"].get(chip.family, []))
    elif "dtypes" in limits:
        found = limits["dtypes"]
        names = set(found.get(chip.family, []) if isinstance(found, dict) else found)
    else:
        names = set(_DTYPE_ORDER)
    return tuple(name for name in _DTYPE_ORDER if name in names and getattr(torch, name) in chip.dtypes)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# The documented limits of each torch_npu operator that make torchport call the reference (or SDPA) instead, in
# words, with the figures of torch_npu_contract.json; the call sites check the same figures.
def _rms_norm_limits(limits: dict[str, Any], chip: ChipProfile) -> list[str]:
    least = limits["min_last_dim_bytes"].get(chip.family)
    return [f"rows of fewer than {least} bytes (hidden size x element size)"] if least else []


def _rotary_mul_limits(limits: dict[str, Any], chip: ChipProfile) -> list[str]:
    low, high = limits["r_range"]
    found = [f"head_dim of {limits['head_dim_below']} or more",
             f"batch or heads of {max(limits['batch_below'], limits['heads_below'])} or more",
             f"cos/sin that require grad with batch x heads above {limits['batch_heads_max_with_r_grad']}",
             f"cos/sin outside [{low:g}, {high:g}] (YaRN's or LongRoPE's attention scaling)"]
    if chip.family in limits["compiled_kernel_families"]:
        kernel = limits["compiled_kernel"]
        found.append(f"head_dim other than {kernel['head_dim']}, or cos/sin of batch other than {kernel['r_batch']} "
                     f"({chip.family} chips have the one compiled kernel)")
    return found


def _swiglu_limits(limits: dict[str, Any], chip: ChipProfile) -> list[str]:
    return []  # other ranks go as [rows, features]; an empty input needs no kernel


def _cross_entropy_limits(limits: dict[str, Any], chip: ChipProfile) -> list[str]:
    return [f"more than {limits['rows'][1]} rows", "z_loss", "label_smoothing when the logits require grad"]


def _weight_quant_limits(limits: dict[str, Any], chip: ChipProfile) -> list[str]:
    low, high = limits["k_n_range"]
    found = ["formats other than int8 and int4", f"in or out features outside [{low}, {high}] (a 128256-word LM head)"]
    pack = "npu_convert_weight_to_int4pack"
    if "int32" in limits["weight_dtypes"].get(chip.family, []) and chip.lacks(pack) is None:
        found.append(f"int4 groups other than one per row or a multiple of {limits['group_size_multiple']} "
                     f"(at least {limits['group_size_min']})")
        found.append("int4 with out features not a multiple of 8")
    else:
        found.append(f"int4 weights (not on {chip.family}: torch_npu documents {pack} for {_documented_for(pack)})")
    return found


def _fusion_attention_limits(limits: dict[str, Any], chip: ChipProfile) -> list[str]:
    low, high = limits["head_dim"]
    return ["key and value of different shapes (MLA)", f"head dims outside [{low}, {high}]",
            f"more than {limits['query_heads'][1]} query heads", "graphs being compiled (eager execution only)"]


_REFERENCE_WHEN: dict[str, Callable[[dict[str, Any], ChipProfile], list[str]]] = {
    "npu_rms_norm": _rms_norm_limits,
    "npu_rotary_mul": _rotary_mul_limits,
    "npu_swiglu": _swiglu_limits,
    "npu_cross_entropy_loss": _cross_entropy_limits,
    "npu_weight_quant_batchmatmul": _weight_quant_limits,
    "npu_fusion_attention": _fusion_attention_limits,
}
