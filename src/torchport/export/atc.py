"""The ``atc`` command that compiles an ONNX file into an Ascend offline model (``.om``), written to a script.

ATC (CANN's model compiler) reads ONNX files (``--framework=5``) of opsets 9 to 18, needs the chip name
(``--soc_version``) and every input's shape (``--input_shape``, ``-1`` for a dynamic dimension, with the sizes to
compile for in ``--dynamic_batch_size``, or in ``--dynamic_dims`` together with ``--input_format=ND``).

Sources (the ATC documentation of CANN, hiascend.com): ``--dynamic_dims`` "is used with --input_shape and
--input_format" and excludes ``--dynamic_batch_size``, 2 to 100 profiles (``devaids/atctool/atlasatcparam_16_0020``,
CANN 7.0 to 9.0); the supported ONNX operators are listed per opset, v8/v9 up to v18 (the ONNX operator list of the
CANN operator reference, e.g. Div: "Opset v8/v9/v10/v11/v12/v13/v14/v15/v16/v17/v18"), and a newer opset fails with
E19010 "No parser is registered for Op" (Ascend case library, "ATC模型转换时ONNX文件Opset版本不兼容").
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
from collections.abc import Sequence

from ..device import DeviceLike, resolve
from .runtime import require

__all__ = ["ATC_OPSETS", "DEFAULT_BATCH_SIZES", "PRECISION_MODES", "SOC_EXAMPLES", "atc_command", "check_opset",
           "graph_inputs", "run_atc", "soc_version", "write_atc_script"]

#: ONNX opsets ATC reads (its operator parsers are documented per opset, up to v18; v9 is the oldest every
#: operator torchport exports has).
ATC_OPSETS = range(9, 19)
#: ATC's ``--precision_mode`` values (CANN 8): fp32/fp16/bf16 choices for matrix and vector operators.
PRECISION_MODES = ("force_fp32", "cube_fp16in_fp32out", "force_fp16", "allow_fp32_to_fp16", "must_keep_origin_dtype",
                   "allow_mix_precision", "allow_mix_precision_fp16", "allow_mix_precision_bf16",
                   "allow_fp32_to_bf16")
SOC_EXAMPLES = ("Ascend910B1", "Ascend910B3", "Ascend310P3", "Ascend310B1")
DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
_SOC = re.compile(r"^Ascend[0-9][0-9A-Za-z_]*(-[0-9A-Za-z_]+)?$")  # Ascend910B4-1, Ascend910_9391
_SOC_NAME = re.compile(r"Ascend[0-9][0-9A-Za-z_]*(-[0-9A-Za-z_]+)?")
_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


def check_opset(opset: int) -> None:
    """Raise ValueError when ATC cannot read ``opset``.

    Example:
        >>> check_opset(20)
        Traceback (most recent call last):
        ValueError: ATC reads ONNX opsets 9 to 18; opset 20 is outside that range: export with an opset from 9 to 18
    """
    if opset not in ATC_OPSETS:
        raise ValueError(f"ATC reads ONNX opsets {ATC_OPSETS[0]} to {ATC_OPSETS[-1]}; opset {opset} is outside that "
                         f"range: export with an opset from {ATC_OPSETS[0]} to {ATC_OPSETS[-1]}")


def soc_version(given: str | None = None, device: DeviceLike = None) -> str:
    """The ``--soc_version`` for ATC: ``given`` when set (checked), else the chip of ``device`` (default: the
    detected device) when it is an Ascend NPU.

    Example:
        >>> soc_version("Ascend910B1")
        'Ascend910B1'
    """
    examples = ", ".join(SOC_EXAMPLES)
    if given is not None:
        if not _SOC.match(given):
            raise ValueError(f"soc_version {given!r} is not an Ascend chip name; give one like {examples}")
        return given
    backend, index = resolve(device)
    # torch_npu reports the chip as ATC names it ("Ascend910B1", "Ascend310P3", "Ascend910_9392", "Ascend910B4-1");
    # other devices' names do not start with "Ascend"
    found = _SOC_NAME.match(backend.device_name(index).strip())
    if found is None:
        raise ValueError(f"ATC needs the Ascend chip to compile for, and {backend.device(index)} is not an Ascend "
                         f"NPU; pass --soc-version (soc_version=...), e.g. {examples} (on the Ascend machine, "
                         "`npu-smi info` shows the chip: Ascend followed by its Name)")
    return found.group(0)


def graph_inputs(model_path: str | os.PathLike[str]) -> list[tuple[str, tuple[int, ...]]]:
    """Name and shape of each input of an ONNX file, ``-1`` for a dynamic dimension.

    Example:
        >>> graph_inputs("cnn.onnx")
        [('input', (-1, 3, 32, 32))]
    """
    onnx = require("onnx", "to read the model's inputs")
    graph = onnx.load(os.fspath(model_path), load_external_data=False).graph
    weights = {init.name for init in graph.initializer}
    out = []
    for value in graph.input:
        if value.name in weights:
            continue
        dims = tuple(dim.dim_value if dim.HasField("dim_value") else -1 for dim in value.type.tensor_type.shape.dim)
        out.append((value.name, dims))
    return out


def _check_sizes(sizes: Sequence[int], what: str) -> list[int]:
    values = list(sizes)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"{what} {values!r}: give positive integers")
    if len(set(values)) != len(values):
        raise ValueError(f"{what} {values!r} repeats a size; ATC needs distinct sizes")
    return values


def atc_command(model_path: str | os.PathLike[str], *, soc_version: str,
                inputs: Sequence[tuple[str, Sequence[int]]] | None = None, batch_sizes: Sequence[int] | None = None,
                dynamic_dims: Sequence[Sequence[int]] | None = None, precision_mode: str | None = None,
                output: str | None = None) -> list[str]:
    """The ``atc`` command line (a list of arguments) that compiles ``model_path`` for ``soc_version``.

    ``inputs`` are (name, shape) pairs with ``-1`` for dynamic dimensions (default: read from the file). A model
    whose only dynamic dimension is dim 0 gets ``--dynamic_batch_size`` from ``batch_sizes`` (default 1,2,4,8);
    other dynamic dimensions need ``dynamic_dims``: one profile per line, the values of every ``-1`` in input order.
    ``output`` is the ``.om`` path without its suffix (default: the model's, beside it).

    Example:
        >>> atc_command("cnn.onnx", soc_version="Ascend910B1", inputs=[("input", (-1, 3, 32, 32))])
        ['atc', '--model=cnn.onnx', '--framework=5', '--output=cnn', '--soc_version=Ascend910B1',
         '--input_shape=input:-1,3,32,32', '--dynamic_batch_size=1,2,4,8']
    """
    model_path = os.fspath(model_path)
    if not _SOC.match(soc_version):
        raise ValueError(f"soc_version {soc_version!r} is not an Ascend chip name; give one like "
                         f"{', '.join(SOC_EXAMPLES)}")
    if precision_mode is not None and precision_mode not in PRECISION_MODES:
        raise ValueError(f"precision_mode {precision_mode!r} is not one of ATC's; valid: {', '.join(PRECISION_MODES)}")
    shapes = [(name, tuple(shape)) for name, shape in (inputs if inputs is not None else graph_inputs(model_path))]
    for name, _ in shapes:
        if any(c in name for c in ":;, "):
            raise ValueError(f"input name {name!r} holds a character ATC's --input_shape uses as a separator "
                             "(: ; , or space); export with other input names")
    unknown = [(name, i) for name, shape in shapes for i, d in enumerate(shape) if d < 0]
    beyond_batch = [f"{name} dim {i}" for name, i in unknown if i > 0]
    command = ["atc", f"--model={model_path}", "--framework=5",
               f"--output={output if output is not None else os.path.splitext(model_path)[0]}",
               f"--soc_version={soc_version}",
               "--input_shape=" + ";".join(f"{name}:{','.join(map(str, shape))}" for name, shape in shapes)]
    if dynamic_dims is not None:
        profiles = [_check_sizes(profile, "dynamic_dims profile") for profile in dynamic_dims]
        if not unknown or any(len(profile) != len(unknown) for profile in profiles):
            raise ValueError(f"dynamic_dims: each profile must give {len(unknown)} value(s), one per dynamic "
                             f"dimension ({', '.join(f'{n} dim {i}' for n, i in unknown) or 'none'})")
        if not 2 <= len(profiles) <= 100:
            raise ValueError(f"dynamic_dims has {len(profiles)} profile(s); ATC takes 2 to 100")
        command.append("--dynamic_dims=" + ";".join(",".join(map(str, profile)) for profile in profiles))
        command.append("--input_format=ND")  # ATC refuses --dynamic_dims without it
    elif beyond_batch:
        raise ValueError(f"the model has dynamic dimensions besides the batch ({', '.join(beyond_batch)}); give "
                         "dynamic_dims (the sizes to compile for), or export with those dimensions fixed")
    elif unknown:
        sizes = _check_sizes(batch_sizes if batch_sizes is not None else DEFAULT_BATCH_SIZES, "batch sizes")
        if not 2 <= len(sizes) <= 100:
            raise ValueError(f"batch sizes {sizes!r}: ATC compiles a dynamic batch for 2 to 100 sizes")
        command.append(f"--dynamic_batch_size={','.join(map(str, sizes))}")
    elif batch_sizes is not None:
        raise ValueError("batch sizes were given but the model's batch is fixed; export it with a dynamic batch "
                         "(--dynamic-batch)")
    if precision_mode is not None:
        command.append(f"--precision_mode={precision_mode}")
    return command


def write_atc_script(model_path: str | os.PathLike[str], *, soc_version: str, batch_sizes: Sequence[int] | None = None,
                     dynamic_dims: Sequence[Sequence[int]] | None = None, precision_mode: str | None = None) -> str:
    """Write ``<name>_atc.sh`` beside the ONNX file: the :func:`atc_command` that compiles it into ``<name>.om``
    beside it (paths relative to the script's folder, so the pair can be copied to an Ascend machine). Returns the
    script's path.

    Example:
        >>> write_atc_script("out/cnn.onnx", soc_version="Ascend910B1", precision_mode="allow_fp32_to_fp16")
        'out/cnn_atc.sh'
    """
    model_path = os.fspath(model_path)
    folder, name = os.path.split(model_path)
    stem = os.path.splitext(name)[0]
    command = atc_command(name, soc_version=soc_version, inputs=graph_inputs(model_path), batch_sizes=batch_sizes,
                          dynamic_dims=dynamic_dims, precision_mode=precision_mode, output=stem)
    lines = [
        "#!/bin/sh",
        f"# Compile {name} into an Ascend offline model, {stem}.om, with ATC (CANN's model compiler).",
        f"# On the Ascend machine: source {_SET_ENV} (or your CANN install's), then run this script.",
        "set -e",
        'cd "$(dirname "$0")"',
        " \\\n    ".join(shlex.quote(arg) for arg in command),
    ]
    script = os.path.join(folder, f"{stem}_atc.sh")
    with open(script, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(script, os.stat(script).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def run_atc(script: str | os.PathLike[str]) -> int | None:
    """Run a script from :func:`write_atc_script` when ``atc`` is on PATH; its exit code, or None when there is
    no ``atc`` here (the CANN toolkit is not installed, or its set_env.sh was not sourced).

    Example:
        >>> run_atc(write_atc_script("cnn.onnx", soc_version="Ascend910B1"))
        0
    """
    if shutil.which("atc") is None:
        return None
    return subprocess.run(["sh", os.fspath(script)], check=False).returncode
