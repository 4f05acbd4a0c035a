"""Cell selectors: which domain x quality cells a source draws from.

A selector is a cell name (`domain=web/quality=3`), a token-shard path that ends in one
(`tokens/domain=web/quality=3`, `gs://bucket/run/tokens/domain=web/quality=3/`), or a pattern:

    domain=code/*             every quality bucket of code
    quality>=3                every domain, buckets 3 and 4
    domain=web/quality>=3     web, buckets 3 and 4
    domain=*/quality=4        every domain, bucket 4
    domain!=web/quality<2     everything but web, buckets 0 and 1
    *                         every cell

Parts are separated by '/'; `domain` takes `=` or `!=` and a glob (`*`, `?`, `[...]`); `quality` takes
`=`, `!=` (an integer or a glob) or `<`, `<=`, `>`, `>=` (an integer 0..4). A missing part matches
anything. Whatever precedes the first `domain`/`quality` part is taken as the shard folder and ignored,
so that a path copied from `ls tokens/` works.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from tokenmill.cells import QUALITY_BUCKETS, parse_cell

_PART = re.compile(r"^(domain|quality)\s*(>=|<=|!=|=|>|<)\s*(\S.*?)\s*$")
_DOMAIN_GLOB = re.compile(r"^[a-z0-9_.\-*?\[\]!]+$")
_GLOB_CHARS = set("*?[")
_ORDER: dict[str, Callable[[int, int], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
# Characters that make a weights key a pattern rather than a source name (source names may not hold them).
PATTERN_CHARS = set("=*<>/!?[")


def looks_like_selector(text: str) -> bool:
    return any(char in PATTERN_CHARS for char in text)


@functools.lru_cache(maxsize=65536)
def _cell(name: str) -> tuple[str, int] | None:
    try:
        return parse_cell(name)
    except ValueError:
        return None


@dataclass(frozen=True)
class Selector:
    """A parsed selector; `text` is what the spec says, `matches(cell)` decides membership."""

    text: str
    domain: str | None = None  # glob, None for any
    domain_negated: bool = False
    quality_op: str | None = None  # '=', '!=', '<', '<=', '>', '>='; None for any
    quality: str | None = None  # an integer or (with = and !=) a glob

    @property
    def cell(self) -> str | None:
        """The single cell this selector names, or None for a pattern."""
        if (
            self.domain is not None
            and not self.domain_negated
            and not _GLOB_CHARS & set(self.domain)
            and self.quality_op == "="
            and self.quality is not None
            and self.quality.isdigit()
        ):
            return f"domain={self.domain}/quality={self.quality}"
        return None

    def matches(self, cell: str) -> bool:
        parsed = _cell(cell)
        if parsed is None:
            return False
        domain, quality = parsed
        if self.domain is not None and fnmatchcase(domain, self.domain) == self.domain_negated:
            return False
        if self.quality_op is None or self.quality is None:
            return True
        if self.quality_op in _ORDER:
            return _ORDER[self.quality_op](quality, int(self.quality))
        hit = fnmatchcase(str(quality), self.quality)
        return hit if self.quality_op == "=" else not hit

    def select(self, cells: Iterable[str]) -> list[str]:
        return [cell for cell in cells if self.matches(cell)]


def parse_selector(text: str) -> Selector:
    """Parse a selector; ValueError saying what is wrong otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("empty cell selector")
    parts = [part.strip() for part in text.strip().split("/") if part.strip()]
    start = next(
        (i for i, part in enumerate(parts) if part == "*" or part.startswith(("domain", "quality"))),
        None,
    )
    if start is None:
        raise ValueError(
            f"not a cell or pattern: {text!r} (expected parts such as domain=web, quality=3, quality>=3 or *)"
        )
    fields: dict[str, tuple[str, str]] = {}
    for part in parts[start:]:
        if part == "*":
            continue
        match = _PART.match(part)
        if not match:
            raise ValueError(
                f"bad selector part {part!r} in {text!r} (expected domain=..., quality=... or *)"
            )
        key, op, value = match.groups()
        if key in fields:
            raise ValueError(f"{key} given twice in {text!r}")
        if key == "domain":
            if op not in ("=", "!="):
                raise ValueError(f"domain takes = or != in {text!r}, not {op}")
            if not _DOMAIN_GLOB.match(value):
                raise ValueError(
                    f"bad domain {value!r} in {text!r}: use lowercase letters, digits, '_', '.', '-'"
                )
        elif op in _ORDER or not _GLOB_CHARS & set(value):
            if not value.isdigit() or int(value) not in QUALITY_BUCKETS:
                raise ValueError(f"bad quality {value!r} in {text!r}: expected a bucket 0..4")
        fields[key] = (op, value)
    domain = fields.get("domain")
    quality = fields.get("quality")
    return Selector(
        text=text,
        domain=domain[1] if domain else None,
        domain_negated=bool(domain and domain[0] == "!="),
        quality_op=quality[0] if quality else None,
        quality=quality[1] if quality else None,
    )
