"""Budgets: bytes, strings with units, fractions of free memory; garbage is refused with the allowed forms."""

from __future__ import annotations

import pytest

from torchport.offload import format_bytes, parse_budget


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5GiB", 3 * 2**29), ("4096B", 4096), ("8 gib", 8 * 2**30),
    ("2KiB", 2048), ("1TB", 10**12), (".5MiB", 2**19),
])
def test_strings_with_units(text: str, expected: int) -> None:
    assert parse_budget(text) == expected


def test_ints_are_bytes_and_floats_are_fractions() -> None:
    assert parse_budget(12345) == 12345
    assert parse_budget(0.25, free=1000) == 250
    assert parse_budget(1.0, free=1000) == 1000


@pytest.mark.parametrize("bad", ["8", "8G", "lots", "-1GiB", "GiB", "1e9B", "8 GiB extra", "", 0, -5, 1.5, 0.0,
                                 float("nan"), True, None, [1]])
def test_garbage_is_refused_with_the_allowed_forms(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_budget(bad, free=10**9)
    message = str(info.value)
    assert repr(bad) in message and "'8GiB'" in message and "(0, 1]" in message


def test_a_fraction_needs_a_memory_that_reports_free_bytes() -> None:
    with pytest.raises(ValueError, match="does not report how much is free"):
        parse_budget(0.5, free=None)


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(None) == "-"
