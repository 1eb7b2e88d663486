"""Huawei Ascend NPUs through torch_npu (CANN), imported only when an NPU is asked for."""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import register_backend
from .base import Backend

__all__ = ["ChipProfile", "NpuBackend", "cann_version", "chip_profile", "device_chip", "npu_chip_profiles",
           "operator_limits", "torch_npu_contract"]

logger = logging.getLogger("torchport")

_CANN_HOMES = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
_CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"


def cann_version() -> str | None:
    """The CANN toolkit version from its install record, without loading any Ascend library."""
    homes = [os.environ[v] for v in _CANN_HOMES if os.environ.get(v)] + [_CANN_DEFAULT]
    for home in homes:
        # <home>/<arch>-linux/ascend_toolkit_install.info holds "version=8.0.RC3"
        for path in sorted(glob.glob(os.path.join(home, "*", "ascend_toolkit_install.info"))) + [
            os.path.join(home, "version.cfg")
        ]:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        key, _, value = line.strip().partition("=")
                        if key.strip() in ("version", "Version") and value.strip():
                            return value.strip()
            except OSError:
                continue
    return None


def nearest_release(version: str, releases: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """The (major, minor) of ``releases`` nearest to ``version`` ("2.13.0+cpu"); the newer one on a tie.

    Example:
        >>> nearest_release("2.13.0+cpu", [(2, 6), (2, 14)])
        (2, 14)
    """
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"version {version!r} does not start with major.minor")
    major, minor = int(found.group(1)), int(found.group(2))
    return min(releases, key=lambda r: (abs((r[0] - major) * 100 + r[1] - minor), -r[0], -r[1]))


# -- what torch_npu and the Ascend chips offer ------------------------------------------------------------------
# Two data files, each naming the repositories and commits its facts come from: data/torch_npu_contract.json (the
# schemas, backward and documented limits of the torch_npu operators torchport calls) and data/ascend_chips.json
# (the chips as torch_npu reports them).
_DATA = os.path.join(os.path.dirname(__file__), "data")


@functools.lru_cache(maxsize=None)
def _data(name: str) -> dict[str, Any]:
    with open(os.path.join(_DATA, name), encoding="utf-8") as f:
        return json.load(f)


def torch_npu_contract() -> dict[str, Any]:
    """The torch_npu operators torchport calls, by name: ``schema`` (op-plugin's, newest), ``oldest_schema`` (where
    older releases lack trailing arguments), ``backward``, ``differentiable_outputs``, ``families`` (the chip
    families torch_npu documents it for), ``torchair_converter`` and ``limits``. Shared: do not modify.

    Example:
        >>> torch_npu_contract()["npu_swiglu"]["schema"]
        'npu_swiglu(Tensor self, int dim=-1) -> Tensor'
    """
    return _data("torch_npu_contract.json")["operators"]


def operator_limits(name: str) -> dict[str, Any]:
    """The documented limits of torch_npu operator ``name`` that torchport checks before calling it.

    Example:
        >>> operator_limits("npu_weight_quant_batchmatmul")["k_n_range"]
        [1, 65535]
    """
    contract = torch_npu_contract()
    if name not in contract:
        raise ValueError(f"torch_npu operator {name!r} is not in torchport's contract; it has: {', '.join(contract)}")
    return contract[name]["limits"]


@dataclasses.dataclass(frozen=True)
class ChipProfile:
    """One Ascend chip as torch_npu reports it, and what it runs.

    Attributes:
        soc_version: the name ``torch.npu.get_device_name()`` returns (``"Ascend910B3"``), which ATC also takes as
            ``--soc_version``.
        family: ``"A1"`` (Ascend 910), ``"A2"`` (910B1 to B4), ``"A3"`` (910_93xx) or ``"310P"``.
        ai_cores: AI cores (cube cores where cube and vector units are split): ``cube_core_num``.
        vector_cores: vector cores (``vector_core_num``); 0 where the AI cores hold the vector units (A1).
        memory_bytes: device memory.
        l2_bytes: L2 cache.
        ops: the torch_npu operators of :func:`torch_npu_contract` that run on this chip.
        dtypes: the floating dtypes the chip computes in (bfloat16 from the 910B1 on).
    """

    soc_version: str
    family: str
    ai_cores: int
    vector_cores: int
    memory_bytes: int
    l2_bytes: int
    ops: frozenset[str]
    dtypes: tuple[torch.dtype, ...]

    @property
    def multi_processor_count(self) -> int:
        """What ``get_device_properties().multi_processor_count`` reports: the vector cores, else the AI cores."""
        return self.vector_cores or self.ai_cores

    @property
    def bf16(self) -> bool:
        """Whether the chip computes in bfloat16 (``torch.npu.is_bf16_supported()``)."""
        return torch.bfloat16 in self.dtypes

    @property
    def family_name(self) -> str:
        """The products of the family, as the vendor names them (``"Atlas A2 series, Ascend 910B"``)."""
        return _data("torch_npu_contract.json")["families"][self.family]

    def lacks(self, op: str) -> str | None:
        """Why torch_npu operator ``op`` cannot run on this chip, or None when it can (or is not in the contract).

        Example:
            >>> chip_profile("Ascend910A").lacks("npu_swiglu")
            'npu_swiglu does not run on Ascend910A (A1: ...); torch_npu documents it for A2 only'
        """
        contract = torch_npu_contract()
        if op not in contract or op in self.ops:
            return None
        return (f"{op} does not run on {self.soc_version} ({self.family}: {self.family_name}); torch_npu documents "
                f"it for {', '.join(contract[op]['families'])} only")


@functools.lru_cache(maxsize=None)
def _profiles() -> dict[str, ChipProfile]:
    contract = torch_npu_contract()
    profiles = {}
    for soc, chip in _data("ascend_chips.json")["chips"].items():
        ops = frozenset(op for op, entry in contract.items() if chip["family"] in entry["families"])
        # torch_npu's IsBF16Supported: true from the Ascend910B1 on (A2, A3), false for A1 and 310P
        bf16 = chip["family"] in ("A2", "A3")
        dtypes = (torch.float32, torch.float16, torch.bfloat16) if bf16 else (torch.float32, torch.float16)
        profiles[soc] = ChipProfile(soc, chip["family"], chip["ai_cores"], chip["vector_cores"], chip["memory_bytes"],
                                    chip["l2_bytes"], ops, dtypes)
    return profiles


def npu_chip_profiles() -> dict[str, ChipProfile]:
    """Every Ascend chip torchport knows, by the name torch_npu reports for it.

    Example:
        >>> npu_chip_profiles()["Ascend310P3"].bf16
        False
    """
    return dict(_profiles())


def chip_profile(soc: str | None = None) -> ChipProfile:
    """The profile of chip ``soc`` (any case; ``"Ascend910_93"`` names the A3 chip Ascend910_9392), or of the
    default chip (Ascend910B3) when None.

    Raises:
        ValueError: ``soc`` is no chip torchport knows; the message lists the known ones.

    Example:
        >>> chip_profile("ascend910b4").memory_bytes
        34359738368
    """
    data = _data("ascend_chips.json")
    wanted = data["default"] if soc is None else str(soc).strip()
    wanted = {alias.lower(): name for alias, name in data["aliases"].items()}.get(wanted.lower(), wanted)
    profiles = {name.lower(): profile for name, profile in npu_chip_profiles().items()}
    if wanted.lower() not in profiles:
        raise ValueError(f"{soc!r} is not an Ascend chip torchport knows; known: "
                         f"{', '.join([*npu_chip_profiles(), *data['aliases']])}")
    return profiles[wanted.lower()]


def device_chip(device: torch.device) -> ChipProfile | None:
    """The chip of an ``npu`` device, None for another device type or a chip torchport does not know.

    Example:
        >>> device_chip(torch.device("npu", 0)).family
        'A2'
    """
    from . import get_backend

    backend = get_backend(device.type) if device.type == "npu" else None
    return backend.chip(device.index or 0) if isinstance(backend, NpuBackend) else None


def _flag(value: str | None) -> bool:
    """An integer flag as torch_npu reads its variables (strtol: leading digits, anything else is 0)."""
    found = re.match(r"\s*[+-]?\d+", value or "")
    return bool(found and int(found.group(0)))


@register_backend("npu")
class NpuBackend(Backend):
    name = "npu"
    dist_backend = "hccl"
    visible_devices_variable = "ASCEND_RT_VISIBLE_DEVICES"
    safetensors_direct = True
    profiler_activity = "PrivateUse1"  # torch_npu registers as PyTorch's PrivateUse1 backend
    dispatch_key = "PrivateUse1"
    #: torch_npu's operator lists shipped for coverage where torch_npu is not loaded, by the release they come from
    OP_SNAPSHOTS = {(2, 6): "torch_npu_ops-2.6.txt", (2, 14): "torch_npu_ops-2.14.txt"}

    @property
    def host_fallback(self) -> bool:  # type: ignore[override]
        # torch_npu runs operators it has no kernel for on the CPU (its PrivateUse1 fallback,
        # VariableFallbackKernel.cpp, warning "CAUTION: The operator ... will fall back to run on the CPU" once per
        # operator), unless TORCH_NPU_FALLBACK_CPU_DISABLE is a non-zero integer (Ascend/pytorch master @9e73e708,
        # OptionsManager.cpp, read once per process there), which turns that fallback into an error
        return not _flag(os.environ.get("TORCH_NPU_FALLBACK_CPU_DISABLE"))

    def __init__(self) -> None:
        super().__init__()
        self._import_error: str | None = None

    @property
    def op_snapshot(self) -> str:  # type: ignore[override]
        """The operator list of the torch_npu release nearest to the installed torch_npu (read from its package
        metadata, without importing it), else to the installed torch: torch_npu releases pair with torch's."""
        try:
            wanted = importlib.metadata.version("torch_npu")
        except importlib.metadata.PackageNotFoundError:
            wanted = torch.__version__
        return self.OP_SNAPSHOTS[nearest_release(wanted, self.OP_SNAPSHOTS)]

    def module(self) -> types.ModuleType:
        if not hasattr(torch, "npu"):
            importlib.import_module("torch_npu")  # registers torch.npu, Tensor.npu() and the "npu" device
        return torch.npu

    def is_available(self) -> bool:
        if not hasattr(torch, "npu") and importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            return bool(self.module().is_available())
        except Exception as exc:  # torch_npu refuses to load beside another accelerator, or CANN is missing
            if self._import_error is None:
                self._import_error = f"{type(exc).__name__}: {exc}"
                logger.warning("torch_npu is installed but could not be used: %s", self._import_error)
            return False

    def unavailable_reason(self) -> str:
        if self._import_error is not None:
            return f"torch_npu failed to load ({self._import_error})"
        if not hasattr(torch, "npu") and importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed (pip install torch-npu matching your torch version, with CANN)"
        return super().unavailable_reason()

    def fused_op(self, name: str) -> Callable[..., Any] | None:
        # torch_npu exposes its fused operators as module functions (torch_npu.npu_rms_norm, npu_rotary_mul...);
        # which ones exist depends on the torch_npu and CANN release.
        if not self.is_available():
            return None
        return getattr(importlib.import_module("torch_npu"), name, None)

    def properties(self, index: int) -> dict[str, Any]:
        # torch_npu's 26.x releases set multi_processor_count to vector_core_num, else cube_core_num; its 7.3.0
        # releases declare the field and leave it None (Ascend/pytorch torch_npu/csrc/npu/Module.cpp, master
        # 9e73e708 and v2.6.0-7.3.0 0db038ca): the same rule fills it here. major and minor stay unset (None there).
        props = super().properties(index)
        if not props.get("multi_processor_count"):
            cores = props.get("vector_core_num") or props.get("cube_core_num")
            if cores:
                props["multi_processor_count"] = int(cores)
        return props

    def chip(self, index: int) -> ChipProfile | None:
        """The profile of device ``index``'s chip, found by the name torch_npu reports; None for a chip torchport
        does not know (or no NPU)."""
        if not self.is_available():
            return None
        return _profiles().get(self.device_name(index).strip())

    def chip_lacks(self, name: str, index: int) -> str | None:
        """Why fused operator ``name`` cannot run on device ``index``'s chip, or None. torch_npu defines every
        operator on every chip; on a chip without a kernel for one, the call fails (RuntimeError)."""
        chip = self.chip(index)
        return None if chip is None else chip.lacks(name)

    def attention_implementation(self, index: int) -> str:
        # torch_npu's npu_fusion_attention (FlashAttentionScore), registered with transformers by
        # torchport.attention: grouped-query attention without copying key/value heads, and causal attention
        # through the compressed mask (sparse_mode), which skips masked blocks. flash-attn does not install on
        # Ascend; SDPA on torch_npu reaches FlashAttentionScore too, but transformers repeats the key/value heads
        # before it whenever there is a mask.
        name = "npu_fusion_attention"
        return name if self.fused_op(name) is not None and self.chip_lacks(name, index) is None else "sdpa"

    def dynamo_compiler(self) -> tuple[str, Callable[..., Any] | None]:
        # TorchAir (shipped with torch_npu) compiles graphs for the Ascend graph engine; without it, torch_npu's
        # own dynamo backend "npu" where this release registers one; otherwise the graph runs op by op.
        if not self.is_available():
            return "eager", None
        try:
            torchair = importlib.import_module("torchair")
        except ImportError:
            torchair = None
        if torchair is not None and hasattr(torchair, "get_npu_backend"):
            return "torchair", torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
        from torch._dynamo.backends.registry import list_backends, lookup_backend

        if "npu" in list_backends(exclude_tags=()):
            return "npu", lookup_backend("npu")
        return "eager", None

    def inductor_compiles(self) -> bool:
        # torch_npu releases with NPU Inductor register its code generator for "npu" when a compile asks for
        # Inductor (Ascend/pytorch master 9e73e708: torch_npu/utils/_dynamo.py register_inductor_npu, called from
        # its Inductor setup; torch_npu/_inductor/__init__.py register_backend_for_device). Older releases have none.
        if not self.is_available():
            return False
        try:
            dynamo = importlib.import_module("torch_npu.utils._dynamo")
        except ImportError:
            return False
        return hasattr(dynamo, "register_inductor_npu")

    def utilization(self, index: int) -> float | None:
        # torch_npu's torch.npu.utilization(device): the device's busy rate, as its driver counts it.
        read = getattr(self.module(), "utilization", None) if self.is_available() else None
        if read is None:
            return None
        try:
            return float(read(index))
        except Exception:  # a driver without the query raises; that is "not reported", not a failure
            return None

    def versions(self) -> dict[str, str | None]:
        torch_npu = sys.modules.get("torch_npu")
        return {
            "torch_npu": getattr(torch_npu, "__version__", None),
            "cann": cann_version(),
        }

    # -- deployment ------------------------------------------------------------------------------------------------
    onnx_provider = "CANNExecutionProvider"
