"""Line-level boilerplate: lines that many documents of one source repeat (navigation, headers, footers,
cookie banners, "Show Source" / "Next topic" links) are removed from every document of that source.

Documentation pages and news sites repeat the same navigation lines on every page; FineWeb's
`char_dup_ratio` and Gopher's repetition rules then measure the navigation, not the page, and remove
clean technical prose. This step runs before them and removes those lines, leaving the page's own text.

A line's key is `line_hash` of its normalized form (NFKC, case-folded, whitespace runs as one space);
blank lines are never counted or removed. A line is boilerplate in a source when at least
`min_documents` documents of that source, and at least `min_fraction` of them, contain it (counted once
per document). Which lines those are needs every document of the source, so the counting is a
combine over the corpus (tokenmill.pipelines.line_boilerplate, a grouping stage of the recipe); the removal
is per document and lives here, Beam-free:

- `BoilerplateLines`: a tokenmill DocumentStep-like editor: given a source's frequent line hashes, it
  rewrites a document's text without them and says how many lines and characters went; a document with
  nothing but boilerplate is removed (`boilerplate_only`), so read = kept + removed + rejected holds.
- `BoilerplateLineFilter`: the same edit as a datatrove `BaseFilter` (it edits `doc.text` in place, as
  datatrove's C4 filter does), for use in a datatrove pipeline with a table of frequent lines computed
  elsewhere.

This step EDITS the text it keeps (unlike tokenmill's other filters, which only decide): the curated
text of an edited document is its text without the boilerplate lines, and `n_chars` is its new length.
Documents of `skip_domains` (by default code: `}` or `return None` repeat in every file of a
repository and are not boilerplate) are neither counted nor edited.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from datatrove.data import Document
from datatrove.pipeline.filters.base_filter import BaseFilter

STAGE = "line_boilerplate"
REASON = "boilerplate_only"
BY_SOURCE = "source"
BY_URL_HOST = "url_host"


def normalized_line(line: str) -> str:
    """The form a line is compared in: NFKC, case-folded, whitespace runs as one space."""
    return " ".join(unicodedata.normalize("NFKC", line).casefold().split())


def line_hash(line: str) -> int:
    """A 64-bit key of a line's normalized form (0 is never returned: blank lines have no key)."""
    digest = hashlib.blake2b(normalized_line(line).encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "big") or 1


def document_line_hashes(text: str) -> set[int]:
    """The distinct keys of a text's non-blank lines: a line counts once per document."""
    return {line_hash(line) for line in text.split("\n") if line.strip()}


def source_key(document: Mapping, by: str = BY_SOURCE) -> str:
    """Which source a document's lines are counted in: its input file (`source`), or the host of its
    `url` (`url_host`; a document without a URL counts in its input file)."""
    if by == BY_URL_HOST:
        url = document.get("url")
        if url:
            host = urlsplit(str(url)).hostname
            if host:
                return f"host:{host}"
    return f"source:{document.get('source', '')}"


@dataclass
class Stripped:
    """One document's edit: its new text and what went; `examples` holds, for the removed lines whose key
    the caller asked for, the line as this document writes it (surrounding whitespace stripped)."""

    text: str
    lines_removed: int
    characters_removed: int
    examples: dict[int, str] = field(default_factory=dict)


def strip_lines(text: str, frequent: Collection[int], examples: Collection[int] = ()) -> Stripped:
    """`text` without its lines whose key is in `frequent` (blank lines stay, so paragraphs stay apart);
    the removed lines whose key is in `examples` are kept, as written, in the result's `examples`."""
    if not frequent:
        return Stripped(text, 0, 0)
    kept, removed, found = [], 0, {}
    for line in text.split("\n"):
        if line.strip() and (key := line_hash(line)) in frequent:
            removed += 1
            if key in examples and key not in found:
                found[key] = line.strip()
        else:
            kept.append(line)
    if not removed:
        return Stripped(text, 0, 0)
    new_text = "\n".join(kept).strip("\n")
    return Stripped(new_text, removed, len(text) - len(new_text), found)


class BoilerplateLines:
    """Removes a source's frequent lines from its documents (the per-document half of the stage): the
    caller looks up the frequent line keys of the document's source (`key`), a small table (the lines
    repeated across a source, not its lines) that travels as a side input."""

    stage = STAGE

    def __init__(self, by: str = BY_SOURCE, skip_domains: Iterable[str] = ("code",)):
        if by not in (BY_SOURCE, BY_URL_HOST):
            raise ValueError(f"by must be {BY_SOURCE!r} or {BY_URL_HOST!r}, got {by!r}")
        self.by = by
        self.skip_domains = frozenset(skip_domains)

    def counted(self, document: Mapping) -> bool:
        return document.get("domain") not in self.skip_domains

    def key(self, document: Mapping) -> str:
        return source_key(document, self.by)

    def edit(
        self, document: dict, lines: Collection[int] | None, examples: Collection[int] = ()
    ) -> Stripped | None:
        """Edit `document` in place (text, n_chars) with its source's frequent `lines`; the edit, or None
        when nothing was removed (`examples`: as in `strip_lines`). A document left empty keeps its text:
        the caller removes it whole as `boilerplate_only`."""
        if not lines or not self.counted(document):
            return None
        stripped = strip_lines(document["text"], lines, examples)
        if not stripped.lines_removed:
            return None
        if stripped.text.strip():
            document["text"] = stripped.text
            document["n_chars"] = len(stripped.text)
        return stripped


class BoilerplateLineFilter(BaseFilter):
    """datatrove's form of the edit: drops a document's lines whose key is frequent in its source
    (`doc.metadata["source"]`, or the host of `doc.metadata["url"]` with by="url_host"), and drops the
    document when nothing else is left. The frequent lines come from a count over the corpus (in
    tokenmill, the `line_boilerplate` stage); this filter only applies them."""

    name = "🧭 Boilerplate lines"

    def __init__(
        self,
        frequent: Mapping[str, Collection[int]],
        by: str = BY_SOURCE,
        skip_domains: Iterable[str] = ("code",),
        exclusion_writer=None,
    ):
        super().__init__(exclusion_writer)
        self.frequent = frequent
        self.editor = BoilerplateLines(by, skip_domains)

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        document = {"text": doc.text, **doc.metadata}
        stripped = self.editor.edit(document, self.frequent.get(self.editor.key(document)))
        if stripped is None:
            return True
        if not stripped.text.strip():
            return False, REASON
        doc.text = stripped.text
        self.stat_update("lines_removed", value=stripped.lines_removed)
        return True
