"""Human token counts: `18.75T`, `926B`, `48e9`, `1_000_000` in; `18.75T` out."""

from __future__ import annotations

import math
import re

SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12, "P": 10**15}
_COUNT = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9_]+)?(?:[eE][+-]?[0-9]+)?)\s*([KMBGTP]?)\s*$")


def parse_count(value: int | float | str) -> int:
    """Parse a count such as `18.75T`, `926B`, `48e9` or `1_000_000` into an int.

    Raises ValueError with the offending text when the value is not a whole, non-negative count.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a count: {value!r}")
    if isinstance(value, int):
        number = float(value)
    elif isinstance(value, float):
        number = value
    else:
        match = _COUNT.match(str(value).upper())
        if not match:
            raise ValueError(f"not a count: {value!r} (expected a number such as 18.75T, 926B, 48e9)")
        number = float(match.group(1).replace("_", "")) * SUFFIXES[match.group(2)]
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"not a count: {value!r} (must be finite and non-negative)")
    rounded = round(number)
    if abs(number - rounded) > 1e-6 * max(1.0, abs(number)):
        raise ValueError(f"not a whole count: {value!r}")
    return int(rounded)


def format_count(value: float, digits: int = 3) -> str:
    """Format a count with a suffix: 18750000000000 -> '18.75T'."""
    for suffix in ("P", "T", "B", "M", "K"):
        scale = SUFFIXES[suffix]
        if abs(value) >= scale:
            text = f"{value / scale:.{digits}g}"
            return f"{text}{suffix}"
    return (
        f"{value:.{digits}g}"
        if isinstance(value, float) and not float(value).is_integer()
        else str(int(value))
    )
