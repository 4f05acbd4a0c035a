"""A planted-contamination corpus from real text, for tests/test_decontam_edits.py and the curve in
docs/decontam.md: 200 evaluation items cut from the language reference that Python ships
(pydoc_data.topics) and standard-library docstrings, planted whole, embedded mid-paragraph and lightly
edited in 600 documents, plus 400 clean documents made from the rest of that text, half of them near
misses that share phrases with items.

    python tests/decontam_planted.py        # prints recall and false positives over min_coverage

Items: 30 short (6 to 12 words), 40 sentences of 13 to 40 words, 130 paragraphs of 41 to 150 words. An
item shares no run of 6 words with the clean text or another item, so a clean document holds no item and
a planted one holds only its own, by construction. Near misses share runs of 3 to 5 words with items
(stock phrases of the documentation: "the value of the", "is used to"), quote a third of an item (at most
10 words) or two fifths of one (8 to 16 words) inside clean prose, or hold three short runs of one item
apart. A light edit lower- or upper-cases the item, changes its punctuation, and swaps one or two words:
replaces each with another word of the text, or exchanges it with its neighbour.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

ITEMS = {"short": (30, 6, 12), "sentence": (40, 13, 40), "paragraph": (130, 41, 150)}
SEED = 21
_WORD = re.compile(r"[\W_]+")


@dataclass
class Planted:
    text: str
    kind: str  # whole, embedded, edited, near_miss, clean
    item: int | None  # the planted item (None for clean documents)
    size: str = ""  # the item's size class: short, sentence, paragraph


def words_of(text: str) -> list[str]:
    return _WORD.sub(" ", text.lower()).split()


#: Standard-library modules whose docstrings add prose to the language reference.
PROSE_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "concurrent.futures",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "functools",
    "http.client",
    "inspect",
    "io",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "string",
    "subprocess",
    "tarfile",
    "threading",
    "unittest",
    "urllib.request",
    "zipfile",
)


def _prose_blocks(text: str) -> list[str]:
    """Blank-line separated blocks of 12+ words ending in a full stop, without code or tables."""
    blocks = []
    for block in re.split(r"\n\s*\n", text):
        joined = " ".join(line.strip() for line in block.splitlines())
        if (
            len(joined.split()) >= 12
            and joined.endswith(".")
            and sum(c in "{}[]()=<>_*" for c in joined) <= 0.04 * len(joined)
        ):
            blocks.append(joined)
    return blocks


def reference_paragraphs() -> list[str]:
    """Prose paragraphs of the language reference (pydoc_data.topics) and of standard-library docstrings,
    in a fixed order, without repeats."""
    import importlib
    import inspect
    from pydoc_data.topics import topics

    texts = [topics[name] for name in sorted(topics)]
    for module_name in PROSE_MODULES:
        module = importlib.import_module(module_name)
        # Modules a module imports are left out: they are not its prose (and some warn when read).
        members = [member for _, member in sorted(inspect.getmembers(module), key=lambda m: m[0])]
        for obj in [module, *(member for member in members if not inspect.ismodule(member))]:
            try:
                texts.append(inspect.getdoc(obj) or "")
            except Exception:  # noqa: BLE001 - some members refuse introspection
                continue
    return list(dict.fromkeys(block for text in texts for block in _prose_blocks(text)))


def sentences(paragraph: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", paragraph) if s]


def _ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def light_edit(rng: random.Random, text: str, vocabulary: list[str]) -> str:
    """Lower- or upper-case, other punctuation, and one or two words swapped (replaced, or exchanged with
    a neighbour)."""
    words = text.split()
    for _ in range(rng.randint(1, 2)):
        position = rng.randrange(len(words) - 1)
        if rng.random() < 0.7:
            words[position] = rng.choice(vocabulary)
        else:
            words[position], words[position + 1] = words[position + 1], words[position]
    edited = " ".join(words).replace(",", "").replace(".", ";").replace('"', "'")
    return edited.upper() if rng.random() < 0.2 else edited.lower()


def build(seed: int = SEED) -> tuple[list[str], list[str], list[Planted]]:
    """(items, their size classes, documents)."""
    rng = random.Random(seed)
    paragraphs = reference_paragraphs()
    rng.shuffle(paragraphs)
    held_out, pool = paragraphs[: len(paragraphs) // 2], paragraphs[len(paragraphs) // 2 :]
    # Items share no run of 6 words with the clean text or with each other: a document holding one item
    # holds no other, and no clean document holds any.
    taken_6grams = set().union(*(_ngrams(words_of(p), 6) for p in pool))
    items: list[str] = []
    sizes: list[str] = []
    for size, (count, low, high) in ITEMS.items():
        taken = 0
        for paragraph in held_out:
            candidates = [paragraph] if size == "paragraph" else sentences(paragraph)
            for text in candidates:
                words = words_of(text)
                if taken == count or not low <= len(words) <= high or _ngrams(words, 6) & taken_6grams:
                    continue
                items.append(text)
                sizes.append(size)
                taken_6grams |= _ngrams(words, 6)
                taken += 1
        if taken < count:
            raise RuntimeError(f"only {taken} {size} items in the reference text")
    vocabulary = sorted({word for paragraph in pool for word in paragraph.split() if word.isalpha()})
    item_words = [words_of(item) for item in items]

    def clean(count: int) -> list[str]:
        return rng.sample(pool, count)

    def mid_paragraph(text: str) -> str:
        long = sentences(" ".join(clean(3)))
        cut = max(1, len(long) // 2)
        return "\n\n".join([clean(1)[0], " ".join([*long[:cut], text, *long[cut:]]), clean(1)[0]])

    documents: list[Planted] = []
    for number, item in enumerate(items):
        parts = clean(rng.randint(1, 4))
        parts.insert(rng.randint(0, len(parts)), item)
        documents.append(Planted("\n\n".join(parts), "whole", number, sizes[number]))
        documents.append(Planted(mid_paragraph(item), "embedded", number, sizes[number]))
        edited = light_edit(rng, item, vocabulary)
        if rng.random() < 0.5:
            parts = clean(rng.randint(1, 4))
            parts.insert(rng.randint(0, len(parts)), edited)
            documents.append(Planted("\n\n".join(parts), "edited", number, sizes[number]))
        else:
            documents.append(Planted(mid_paragraph(edited), "edited", number, sizes[number]))
    # Near misses, 50 of each kind. Clean paragraphs that share the most 3- to 5-word runs with items
    # (stock phrases); clean prose quoting a third of an item (at most 10 words); clean prose quoting
    # two fifths of an item of 20 words or more in one run (8 to 16 words: n-gram matching with n = 8
    # flags most of these); and clean prose with three 3- or 4-word runs of one item, in its order, at
    # sentence breaks (the item's phrases, never side by side).
    item_grams = set().union(*(_ngrams(words, n) for words in item_words for n in (3, 4, 5)))
    shared = {p: len(set().union(*(_ngrams(words_of(p), n) for n in (3, 4, 5))) & item_grams) for p in pool}
    for paragraph in sorted(pool, key=lambda p: (-shared[p], p))[:50]:
        documents.append(Planted("\n\n".join([paragraph, *clean(rng.randint(1, 3))]), "near_miss", None))
    long_items = [number for number, size in enumerate(sizes) if size != "short"]
    longer_items = [number for number in long_items if len(items[number].split()) >= 20]
    for _ in range(50):
        words = items[rng.choice(long_items)].split()
        length = min(10, len(words) // 3)
        start = rng.randrange(len(words) - length + 1)
        documents.append(Planted(mid_paragraph(" ".join(words[start : start + length])), "near_miss", None))
    for _ in range(50):
        words = items[rng.choice(longer_items)].split()
        length = max(8, min(16, 2 * len(words) // 5))
        start = rng.randrange(len(words) - length + 1)
        documents.append(Planted(mid_paragraph(" ".join(words[start : start + length])), "near_miss", None))
    for _ in range(50):
        words = items[rng.choice(long_items)].split()
        cuts = sorted(rng.sample(range(0, len(words) - 4), 3))
        runs = [" ".join(words[cut : cut + rng.randint(3, 4)]) for cut in cuts]
        prose = sentences(" ".join(clean(4)))
        for run, where in zip(runs, sorted(rng.sample(range(1, len(prose)), 3)), strict=True):
            prose[where] = f"{run} {prose[where]}"
        documents.append(Planted(" ".join(prose), "near_miss", None))
    for _ in range(200):
        documents.append(Planted("\n\n".join(clean(rng.randint(2, 6))), "clean", None))
    rng.shuffle(documents)
    return items, sizes, documents


def curve(thresholds: tuple[float, ...] = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)) -> list[str]:
    """Recall and false positives over `min_coverage`, as a Markdown table (docs/decontam.md)."""
    import json
    import tempfile
    from pathlib import Path

    from tokenmill.cli import main
    from tokenmill.filters.decontam import Decontaminate

    items, _, documents = build()
    with tempfile.TemporaryDirectory() as folder:
        evals, index = Path(folder) / "reference.jsonl", Path(folder) / "reference.index"
        evals.write_text("".join(json.dumps({"question": item}) + "\n" for item in items))
        main(["decontam", "index", "--evals", str(evals), "--output", str(index)])
        step = Decontaminate(str(index), action="flag", min_coverage=thresholds[0])
        batch = [{"text": document.text, "metadata": None} for document in documents]
        step.apply(batch)
    # The best coverage of each document's own item (clean documents: of any item).
    best = []
    for document, annotated in zip(documents, batch, strict=True):
        matches = (
            json.loads(annotated["metadata"])["contamination"]["matches"] if annotated["metadata"] else []
        )
        if document.item is not None:
            matches = [m for m in matches if m["line"] == document.item + 1]
        best.append(max((1.0 if m["match"] != "edited" else m["coverage"] for m in matches), default=0.0))
    columns = [
        ("whole", ("short", "sentence", "paragraph")),
        ("embedded", ("short", "sentence", "paragraph")),
        ("edited", ("sentence",)),
        ("edited", ("paragraph",)),
        ("edited", ("short",)),
    ]
    lines = [
        "| min_coverage | whole | embedded | edited, 13-40 words | edited, 41-150 | edited, short "
        "| near misses flagged | clean flagged |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for threshold in thresholds:
        cells = []
        for kind, sizes in columns:
            hits = [
                b >= threshold
                for d, b in zip(documents, best, strict=True)
                if d.kind == kind and d.size in sizes
            ]
            cells.append(f"{sum(hits)}/{len(hits)}")
        for kind in ("near_miss", "clean"):
            flagged = [b >= threshold for d, b in zip(documents, best, strict=True) if d.kind == kind]
            cells.append(f"{sum(flagged)}/{len(flagged)}")
        lines.append(f"| {threshold:.2f} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    print("\n".join(curve()))
