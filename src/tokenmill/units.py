"""Human token counts: `18.75T`, `926B`, `48e9`, `1_000_000` in; `18.75T` out. Byte sizes: `64MiB` in."""

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


_BINARY_BYTES = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_byte_size(value: int | float | str) -> int:
    """A size in bytes: `64MiB` (binary suffixes KiB, MiB, GiB, TiB), or a count as `parse_count`
    parses it (`256M` = 256,000,000, `1_000_000`, `1e9`)."""
    if isinstance(value, str):
        text = value.strip().upper()
        for suffix, scale in _BINARY_BYTES.items():
            if text.endswith(suffix):
                try:
                    size = float(text[: -len(suffix)].strip().replace("_", "")) * scale
                except ValueError:
                    size = -1.0
                if not math.isfinite(size) or size < 0 or size != int(size):
                    raise ValueError(f"not a size in bytes: {value!r} (expected e.g. 64MiB, 1.5GiB or 256M)")
                return int(size)
    return parse_count(value)


def format_duration(seconds: float) -> str:
    """Seconds as the unit a person reads at that size: 48 s, 12.5 min, 3.20 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def format_bytes(value: float) -> str:
    """Bytes in decimal units at three significant digits: 26295808 -> '26.3 MB', 4.5e10 -> '45.0 GB'."""
    for suffix, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(value) >= scale * 0.9995:  # what would print as 1000 of the unit below
            number = float(f"{value / scale:.3g}")
            return f"{number:.{max(0, 2 - math.floor(math.log10(abs(number))))}f} {suffix}"
    return f"{value:.0f} B"
