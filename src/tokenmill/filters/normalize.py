"""Text normalization: the first step every document goes through.

Unicode NFC (so that equal text compares and hashes equal), `\n` line endings, and no control characters
except newline and tab (they break tokenizers and terminals and carry no text). The normalized text is
what every later step, the exact-dedupe hash and the character counts see.
"""

from __future__ import annotations

import re
import unicodedata

from tokenmill.filters.base import DocumentStep, Removal

# C0 and C1 control characters other than \t and \n, plus DEL; \r is handled first as a line ending.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_LINE_ENDINGS = re.compile("\r\n?|\u2028|\u2029|\x85")


def normalize_text(text: str) -> str:
    text = _LINE_ENDINGS.sub("\n", text)
    text = _CONTROL.sub("", text)
    return unicodedata.normalize("NFC", text)


def count_words(text: str) -> int:
    return len(text.split())


class Normalize(DocumentStep):
    """Normalize text; remove documents that are empty after it, or longer than `max_chars`."""

    stage = "normalize"

    def __init__(self, max_chars: int = 1_000_000):
        self.max_chars = max_chars

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        results: list[Removal | None] = []
        for document in documents:
            raw = document["text"]
            if len(raw) > self.max_chars:
                # Checked before normalizing: a 50 MB document should cost a length check, not an NFC pass.
                document["n_chars"] = len(raw)
                document["n_words"] = None
                results.append(Removal("too_long", {"n_chars": len(raw), "max_chars": self.max_chars}))
                continue
            text = normalize_text(raw)
            document["text"] = text
            document["n_chars"] = len(text)
            document["n_words"] = count_words(text)
            results.append(None if text.strip() else Removal("empty", {"n_chars": len(text)}))
        return results
