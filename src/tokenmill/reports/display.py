"""How the pages show values from the inputs: links only to plain web URLs, previews cut to a length,
percentages, and a document as a sample row. Every string stays data; the templates escape it."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

# An http(s) URL whose host is plain ASCII letters, digits, dots and dashes: urlsplit would find its
# scheme and a non-empty netloc, so it is a link without parsing (the common case, 10,000 per page).
_PLAIN_WEB_URL = re.compile(r"https?://[A-Za-z0-9.-]+(?=[:/?#]|\Z)", re.ASCII | re.IGNORECASE)


def safe_href(url: Any) -> str:
    """The URL when it is plain http(s), else '' so that the page shows it as text, never as a link.

    `javascript:`, `data:` and relative URLs from input data must not become clickable.
    """
    if not isinstance(url, str) or not url or any(c in url for c in "\x00\n\r\t\\"):
        return ""
    url = url.strip()
    if _PLAIN_WEB_URL.match(url):
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return ""
    return url if parts.scheme.lower() in ("http", "https") and parts.netloc else ""


def preview(text: Any, limit: int) -> tuple[str, bool]:
    """The first `limit` characters of a document and whether it was cut."""
    text = "" if text is None else str(text)
    return (text[:limit], True) if len(text) > limit else (text, False)


def percent(part: float, whole: float) -> str:
    """`part` of `whole` as a percentage with one decimal, "–" of nothing."""
    return f"{100 * part / whole:.1f}%" if whole else "–"


def sample_row(row: dict[str, Any], cell: str, limit: int) -> dict[str, Any]:
    """A document as the page shows it: id, cell, source, URL (a link only when `safe_href` allows),
    text cut to `limit` characters, and what else the row says about it."""
    text, cut = preview(row.get("text"), limit)
    url = row.get("url")
    score = row.get("quality_score")
    return {
        "id": str(row.get("id")),
        "cell": cell,
        "source": "" if row.get("source") is None else str(row.get("source")),
        "url": "" if url is None else str(url),
        "href": safe_href(url),
        "text": text,
        "truncated": cut,
        "n_chars": row.get("n_chars"),
        "quality_score": None if score is None else round(float(score), 3),
        "language": row.get("language"),
    }
