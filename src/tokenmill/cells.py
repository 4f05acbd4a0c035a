"""Cells: the domain x quality partitions that curation writes and mixtures weigh.

A cell's name is its Hive partition path, `domain=<domain>/quality=<quality>`; the same string names the
folder under curated/ and tokens/ and the key in tokens/counts.json, so that mixture patterns such as
`domain=code/*` read the same everywhere.
"""

from __future__ import annotations

import re

QUALITY_BUCKETS = (0, 1, 2, 3, 4)
_DOMAIN = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
_CELL = re.compile(r"^domain=([a-z0-9][a-z0-9_.-]*)/quality=([0-4])$")


def cell_name(domain: str, quality: int) -> str:
    if not _DOMAIN.match(domain):
        raise ValueError(f"bad domain name {domain!r}: use lowercase letters, digits, '_', '.', '-'")
    if quality not in QUALITY_BUCKETS:
        raise ValueError(f"bad quality bucket {quality!r}: expected 0..4")
    return f"domain={domain}/quality={quality}"


def parse_cell(name: str) -> tuple[str, int]:
    """`domain=web/quality=3` -> ('web', 3)."""
    match = _CELL.match(name.strip("/"))
    if not match:
        raise ValueError(f"not a cell name: {name!r} (expected domain=<domain>/quality=<0..4>)")
    return match.group(1), int(match.group(2))
