"""datatrove's heuristic filters (Gopher quality, Gopher repetition, C4, FineWeb quality), used as they are.

One exception, which changes no answer: with the shared split, Gopher repetition's n-gram counts come
from `tokenmill.filters.repetition` (datatrove's numbers at two fifths of their cost; its paragraph and
line checks, thresholds and reasons stay datatrove's own code).

Each filter runs as its own step over a batch; a document is judged through one `datatrove.data.Document`
per step, its text and id set afresh for every document: C4's filter rewrites the text it is given (it
drops lines), and that rewrite must not leak into the next filter or into what is kept. Filters decide;
they do not edit. The kept text is the normalized input text.

Word splitting dominates the cost of these filters, and a document is split once, whatever the chain.
datatrove splits a text with a full spaCy pipeline (tokenizer plus sentencizer) inside a memory zone per
call, and C4 splits every kept line again to count its sentences. Here every filter of a worker shares
one `SharedWordTokenizer`: the first filter to see a batch splits each text in it once, with spaCy's
tokenizer alone, and keeps the tokens' offsets and punctuation flags; words are those tokens (the
sentencizer only marks sentence starts), and the sentences of a line (C4's count) are found by the
sentencizer's own rule over the document's tokens on that line (spaCy splits at whitespace, so a line's
tokens are the same alone or in its document). datatrove accepts a `WordTokenizer` in place of a
language code, so its filters stay unmodified and give identical results; the tests compare against
datatrove called directly, and against spaCy's sentencizer line by line.

Memory. spaCy interns every new token string for the life of the process, and only caches a chunk's
tokenization outside a memory zone. A worker therefore splits outside a zone until its vocabulary has
grown by `permanent_strings` (the first few thousand documents: the common words, which then hit spaCy's
chunk cache), and every later batch inside one zone, whose strings are freed when the batch ends. Memory
per worker: those strings (about 10 MB) plus one batch's tokens, whatever the corpus.

Nothing downloads: these four filters need only spaCy's blank English pipeline, which ships with spaCy.
"""

from __future__ import annotations

import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from datatrove.data import Document
from datatrove.utils.word_tokenizers import SpaCyTokenizer, WordTokenizer, load_word_tokenizer

from tokenmill.filters.base import DocumentStep, Removal

FILTER_CLASSES = {
    "gopher_quality": "datatrove.pipeline.filters.gopher_quality_filter.GopherQualityFilter",
    "gopher_repetition": "datatrove.pipeline.filters.gopher_repetition_filter.GopherRepetitionFilter",
    "c4": "datatrove.pipeline.filters.c4_filters.C4QualityFilter",
    "fineweb_quality": "datatrove.pipeline.filters.fineweb_quality_filter.FineWebQualityFilter",
}
#: New vocabulary strings a worker keeps for its life (split outside a memory zone until then): enough
#: for the common words of a language, which then hit spaCy's chunk cache instead of its affix rules.
PERMANENT_STRINGS = 30_000


def datatrove_filter_class(kind: str) -> type:
    import importlib

    if kind not in FILTER_CLASSES:
        raise ValueError(f"unknown heuristic filter {kind!r}; known: {', '.join(sorted(FILTER_CLASSES))}")
    module_name, class_name = FILTER_CLASSES[kind].rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)


class _Split:
    """One text's spaCy tokens, kept for the batch: their texts, and spaCy's (IDX, LENGTH, IS_PUNCT) per
    token as one array, turned into lists only for a document whose sentences are asked for."""

    __slots__ = ("texts", "attributes", "starts", "punct", "lines")

    def __init__(self, texts: list[str], attributes: Any):
        self.texts = texts
        self.attributes = attributes
        self.starts: list[int] = []
        self.punct: list[int] = []
        self.lines: dict[str, list[tuple[int, int]]] | None = None  # stripped line -> sentence spans

    def unpack(self) -> None:
        if self.attributes is not None:
            self.starts = self.attributes[:, 0].tolist()
            self.punct = self.attributes[:, 2].tolist()
            self.attributes = None


@contextmanager
def torch_hidden() -> Iterator[None]:
    """While spaCy loads, `import torch` fails, unless torch is already loaded.

    spaCy imports thinc, and thinc imports torch whenever it is installed (it is in most training
    environments): 2.6 CPU-s of a 4-second spaCy import, paid by every curate worker, for interop that
    word splitting never uses. thinc then records that torch is absent, for this process only; torch
    itself imports normally afterwards.
    """
    if "torch" in sys.modules or "thinc" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]  # Python's marker for "not importable"
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


class SharedWordTokenizer(WordTokenizer):
    """datatrove's spaCy word splitting, computed once per text and shared by every filter of a worker.

    `prime(texts)` names a batch, whose texts are split when first asked about; `word_tokenize` answers
    from those splits, and `span_tokenize` for the text itself or any stripped line of the text last
    named by `focus()` (what C4 asks for). Anything else falls back to datatrove's own tokenizer.
    `splits` counts the spaCy splits made and `split_seconds` their CPU time (the benches report them).
    """

    def __init__(
        self, language: str = "en", cache_size: int = 64, permanent_strings: int = PERMANENT_STRINGS
    ):
        super().__init__(language)
        self.cache_size = cache_size  # for texts met outside prime(); a primed batch is always held whole
        self.permanent_strings = permanent_strings
        self._reference = load_word_tokenizer(language)
        if not isinstance(self._reference, SpaCyTokenizer):
            raise ValueError(
                f"shared word splitting supports spaCy languages; {language!r} uses "
                f"{type(self._reference).__name__}"
            )
        with torch_hidden():
            self._nlp = self._reference.tokenizer  # datatrove's blank spaCy pipeline with its sentencizer
        self._punct_chars = self._nlp.get_pipe("sentencizer").punct_chars
        from spacy.attrs import IDX, IS_PUNCT, LENGTH  # spaCy loads with the tokenizer, not the recipe

        self._attributes = [IDX, LENGTH, IS_PUNCT]
        self._strings_at_start = len(self._nlp.vocab.strings)
        self._words: dict[str, list[str]] = {}
        self._splits: dict[str, _Split] = {}
        self._other_words: dict[str, list[str]] = {}
        self._other_spans: dict[str, list[tuple[int, int]]] = {}
        self._batch: dict[str, None] = {}
        self._unsplittable: set[str] = set()
        self._zone = ExitStack()
        self._focus_text: str | None = None
        self.splits = 0
        self.split_seconds = 0.0

    def _remember(self, cache: dict, text: str, value: Any) -> None:
        cache[text] = value
        if len(cache) > self.cache_size:
            del cache[next(iter(cache))]

    def permanent(self) -> bool:
        """Whether the next batch is split outside a memory zone (its new strings kept for good)."""
        return len(self._nlp.vocab.strings) - self._strings_at_start < self.permanent_strings

    def prime(self, texts: list[str]) -> None:
        """Name the batch the filters are about to judge. Each of its texts is split once, the first time
        a filter asks for its words or spans (a document a filter removes on its lines or paragraphs
        alone is never split: Gopher repetition removes about a sixth of web documents that way), and
        only this batch is held, so memory stays one batch."""
        batch = dict.fromkeys(texts)
        if all(text in self._batch for text in batch):
            return  # the batch's survivors, primed again by the next filter
        # Keep only what this batch shares with the last one: the cache holds one batch.
        self._words = {text: self._words[text] for text in batch if text in self._words}
        self._splits = {text: self._splits[text] for text in self._words if text in self._splits}
        self._batch = batch
        self._unsplittable = set()
        self._focus_text = None
        # Inside a memory zone spaCy frees the batch's new strings when it ends (at the next batch);
        # everything needed later is copied out (Python strings and ints) as each text is split.
        self._zone.close()
        self._zone = ExitStack()
        if not self.permanent():
            self._zone.enter_context(self._nlp.memory_zone())

    def _split(self, text: str) -> _Split | None:
        """The batch text's split, made now if it was not yet (None for a text outside the batch, or one
        spaCy fails on: word_tokenize then falls back to datatrove, which knows spaCy's quirks)."""
        split = self._splits.get(text)
        if split is not None or text not in self._batch or text in self._unsplittable:
            return split
        started = time.process_time()
        try:
            doc = self._nlp.tokenizer(text)
        except Exception:
            self._unsplittable.add(text)
            return None
        attributes = doc.to_array(self._attributes)
        # A token's text is its slice of the text (spaCy's tokens are never rewritten): slicing by the
        # offsets costs a third of making each Token object to ask for its text.
        tokens = [text[start : start + length] for start, length in attributes[:, :2].tolist()]
        # datatrove's strip_strings, with one strip per token
        self._words[text] = [word for token in tokens if (word := token.strip())]
        split = self._splits[text] = _Split(tokens, attributes)
        self.splits += 1
        self.split_seconds += time.process_time() - started
        return split

    def focus(self, text: str) -> None:
        """Name the document the next span_tokenize calls are about (its lines are answered from it)."""
        self._focus_text = text

    def word_tokenize(self, text: str) -> list[str]:
        words = self._words.get(text)
        if words is None and self._split(text) is not None:
            words = self._words[text]
        if words is None:
            words = self._other_words.get(text)
        if words is None:
            started = time.process_time()
            words = self._reference.word_tokenize(text)
            self.splits += 1
            self.split_seconds += time.process_time() - started
            self._remember(self._other_words, text, words)
        return words

    def sent_tokenize(self, text: str) -> list[str]:
        return self._reference.sent_tokenize(text)

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        split = self._split(text)
        if split is not None:
            split.unpack()
            return self._sentences(split, 0, len(split.starts), 0)
        focus = self._split(self._focus_text) if self._focus_text is not None else None
        if focus is not None:
            if focus.lines is None:
                focus.unpack()
                focus.lines = self._line_sentences(self._focus_text, focus)
            spans = focus.lines.get(text)
            if spans is not None:
                return spans
        spans = self._other_spans.get(text)
        if spans is None:  # a line C4 edited (citations cut), or a text never primed
            started = time.process_time()
            spans = self._reference.span_tokenize(text)
            self.splits += 1
            self.split_seconds += time.process_time() - started
            self._remember(self._other_spans, text, spans)
        return spans

    def _sentences(self, split: _Split, first: int, end: int, base: int) -> list[tuple[int, int]]:
        """Sentence spans of tokens [first, end) as spaCy's Sentencizer marks them on a Doc of just those
        tokens (its `predict`, step for step), offsets relative to `base`."""
        if first >= end:
            return []
        texts, starts, punct, punct_chars = split.texts, split.starts, split.punct, self._punct_chars
        spans = []
        start = first
        seen_period = False
        for index in range(first, end):
            in_punct_chars = texts[index] in punct_chars
            if seen_period and not punct[index] and not in_punct_chars:
                last = index - 1
                spans.append((starts[start] - base, starts[last] + len(texts[last]) - base))
                start = index
                seen_period = False
            elif in_punct_chars:
                seen_period = True
        spans.append((starts[start] - base, starts[end - 1] + len(texts[end - 1]) - base))
        return spans

    def _line_sentences(self, text: str, split: _Split) -> dict[str, list[tuple[int, int]]]:
        """Sentence spans of every stripped line of `text` (C4: `text.splitlines()`, each `.strip()`), from
        the document's tokens on that line: spaCy splits at whitespace first, so they are the line's own."""
        lines: dict[str, list[tuple[int, int]]] = {}
        offset = 0
        for raw in text.splitlines(keepends=True):
            line = raw.strip()
            if line and line not in lines:
                begin = offset + len(raw) - len(raw.lstrip())
                first = bisect_left(split.starts, begin)
                end = bisect_left(split.starts, begin + len(line), first)
                lines[line] = self._sentences(split, first, end, begin)
            offset += len(raw)
        return lines


_SHARED: dict[str, SharedWordTokenizer] = {}
_SHARED_LOCK = threading.Lock()


def shared_word_tokenizer(language: str = "en") -> SharedWordTokenizer:
    """The worker-wide tokenizer for `language` (one per process, so that all filters share its cache; a
    warm pool's template makes it before it forks the workers, tokenmill.pipelines.warm_workers)."""
    with _SHARED_LOCK:
        if language not in _SHARED:
            _SHARED[language] = SharedWordTokenizer(language)
        return _SHARED[language]


class HeuristicFilter(DocumentStep):
    """One datatrove heuristic filter; `params` are its constructor arguments, as datatrove names them."""

    def __init__(
        self, kind: str, params: dict | None = None, language: str = "en", shared_words: bool = True
    ):
        datatrove_filter_class(kind)  # fail at recipe load, not on a worker
        self.kind = kind
        self.stage = kind
        self.params = dict(params or {})
        self.language = language
        self.shared_words = shared_words
        self._filter = None
        self._words: SharedWordTokenizer | None = None

    def setup(self) -> None:
        language: str | WordTokenizer = self.language
        if self.shared_words:
            self._words = shared_word_tokenizer(self.language)
            language = self._words
        filter_class = datatrove_filter_class(self.kind)
        if self.shared_words and self.kind == "gopher_repetition":
            from tokenmill.filters.repetition import GopherRepetition

            filter_class = GopherRepetition  # datatrove's, its n-gram counts made cheaper (same answers)
        self._filter = filter_class(language=language, **self.params)

    def warm_up_calls(self) -> list[tuple[str, tuple[str, ...]]]:
        calls = [("tokenmill.filters.heuristics:datatrove_filter_class", (self.kind,))]
        if self.shared_words:
            calls.append(("tokenmill.filters.heuristics:shared_word_tokenizer", (self.language,)))
        return calls

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_filter": None, "_words": None}  # a copy sets up in its own process

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        if self._filter is None:
            self.setup()
        words = self._words
        if words is not None:
            words.prime([document["text"] for document in documents])
        judge = self._filter.filter
        # One Document for the batch, its fields set afresh per document (C4 rewrites the text it holds).
        judged = Document(text="", id="")
        results: list[Removal | None] = []
        for document in documents:
            text = document["text"]
            judged.text = text
            judged.id = document["id"]
            judged.metadata = {}
            if words is not None:
                words.focus(text)
            verdict = judge(judged)
            keep, reason = verdict if isinstance(verdict, tuple) else (verdict, None)
            results.append(None if keep else Removal(reason or self.kind, {"filter": self.kind}))
        return results
