"""Memory budgets as the user writes them: bytes, ``"8GiB"`` / ``"512MB"``, or a fraction of free memory."""

from __future__ import annotations

import math
import re
from typing import Union

from .._bytes import format_bytes  # noqa: F401 - part of this module's API

__all__ = ["Budget", "UNITS", "format_bytes", "parse_budget"]

Budget = Union[int, float, str]

#: Unit suffixes accepted in budget strings. Binary units (KiB, MiB...) are powers of 1024, decimal ones (KB, MB...)
#: powers of 1000, as in the IEC and SI standards; case is ignored ("8gib" is 8 GiB).
UNITS = {
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_TEXT = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-zA-Z]+)?\s*$")
_FORMS = ("an int of bytes (8589934592)", "a string with a unit: '8GiB', '512MB', '1.5GiB', '4096B' "
          "(units B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)",
          "a float in (0, 1]: that fraction of the free memory")


def _reject(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"{name}={value!r} {why}; write {'; or '.join(_FORMS)}")


def parse_budget(value: Budget, free: int | None = None, *, name: str = "budget") -> int:
    """Turn a budget into bytes.

    Args:
        value: bytes (int), a string with a unit (``"8GiB"``, ``"512MB"``, ``"1.5GiB"``), or a float in (0, 1]
            meaning that fraction of ``free``.
        free: the free bytes a fraction refers to (free device memory, or available host RAM); None when the
            memory does not report it, and then a fraction is refused.
        name: the argument's name, for error messages.

    Example:
        >>> parse_budget("1.5GiB")
        1610612736
    """
    if isinstance(value, bool):
        raise _reject(name, value, "is a bool, not a budget")
    if isinstance(value, int):
        if value <= 0:
            raise _reject(name, value, "is not a positive number of bytes")
        return value
    if isinstance(value, float):
        if not (math.isfinite(value) and 0 < value <= 1):
            raise _reject(name, value, "is a float outside (0, 1], so it is not a fraction of free memory")
        if free is None:
            raise ValueError(f"{name}={value!r} is a fraction of free memory, but this memory does not report how "
                             "much is free; give bytes or a string such as '8GiB'")
        return int(free * value)
    if isinstance(value, str):
        match = _TEXT.match(value)
        unit = (match.group("unit") or "").lower() if match else ""
        if match is None or not unit:
            raise _reject(name, value, "is not a budget (a string needs a unit)")
        if unit not in UNITS:
            raise _reject(name, value, f"has an unknown unit {match.group('unit')!r}")
        number = float(match.group("number")) * UNITS[unit]
        if number < 1:
            raise _reject(name, value, "is less than one byte")
        return int(number)
    raise _reject(name, value, f"is a {type(value).__name__}")
